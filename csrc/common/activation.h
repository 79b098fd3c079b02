// Elementwise activations shared by the ops (add_mul_act, glu), as host/device functors on the math
// type (float or double), so the CPU and CUDA implementations compute the same function.
#pragma once
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>

#include <cmath>
#include <optional>
#include <string>
#include <type_traits>

namespace fuseforge {

enum class Activation { kIdentity, kRelu, kGelu, kGeluTanh, kSilu, kSigmoid };
constexpr int kNumActivations = 6;

// The activation a name spells, or nullopt when it spells none.
inline std::optional<Activation> activation_from_name(c10::string_view name) {
  if (name == "identity") return Activation::kIdentity;
  if (name == "relu") return Activation::kRelu;
  if (name == "gelu") return Activation::kGelu;
  if (name == "gelu_tanh") return Activation::kGeluTanh;
  if (name == "silu") return Activation::kSilu;
  if (name == "sigmoid") return Activation::kSigmoid;
  return std::nullopt;
}

// Any of the six (an op that builds kernels for fewer checks its own list).
inline Activation parse_activation(c10::string_view name) {
  const std::optional<Activation> act = activation_from_name(name);
  TORCH_CHECK(act.has_value(), "activation must be one of identity, relu, gelu, gelu_tanh, silu, sigmoid; got '",
              std::string(name.data(), name.size()), "'");
  return *act;
}

C10_HOST_DEVICE inline float math_exp(float v) { return expf(v); }
C10_HOST_DEVICE inline double math_exp(double v) { return exp(v); }
C10_HOST_DEVICE inline float math_erf(float v) { return erff(v); }
C10_HOST_DEVICE inline double math_erf(double v) { return erf(v); }
C10_HOST_DEVICE inline float math_tanh(float v) { return tanhf(v); }
// e^v for gelu_tanh's logistic: on the GPU ex2.approx of v * log2(e), 2 instructions against
// expf's 8 (GeGLU's bf16 forward 1.5% faster), relative error ~2^-22 + |v| 2^-24; the tests'
// per-element match with PyTorch holds in every dtype.
C10_HOST_DEVICE inline float math_exp_fast(float v) {
#ifdef __CUDA_ARCH__
  return __expf(v);
#else
  return expf(v);
#endif
}
// n / d for the logistic terms; on the GPU a fast divide (2 ulp; d = 1 + exp(-z) > 2^126 gives 0,
// the right limit).
C10_HOST_DEVICE inline float math_div(float n, float d) {
#ifdef __CUDA_ARCH__
  return __fdividef(n, d);
#else
  return n / d;
#endif
}
C10_HOST_DEVICE inline double math_div(double n, double d) { return n / d; }
C10_HOST_DEVICE inline double math_tanh(double v) { return tanh(v); }

template <Activation A>
struct Act;

template <>
struct Act<Activation::kIdentity> {
  template <typename M> C10_HOST_DEVICE static M forward(M z) { return z; }
  template <typename M> C10_HOST_DEVICE static M derivative(M) { return M(1); }
};

template <>
struct Act<Activation::kRelu> {
  template <typename M> C10_HOST_DEVICE static M forward(M z) { return z > M(0) ? z : M(0); }
  template <typename M> C10_HOST_DEVICE static M derivative(M z) { return z > M(0) ? M(1) : M(0); }
};

// gelu(z) = z * Phi(z), Phi the standard normal CDF (erf form).
template <>
struct Act<Activation::kGelu> {
  template <typename M> C10_HOST_DEVICE static M forward(M z) {
    return M(0.5) * z * (M(1) + math_erf(z * M(0.70710678118654752440)));
  }
  template <typename M> C10_HOST_DEVICE static M derivative(M z) {
    const M cdf = M(0.5) * (M(1) + math_erf(z * M(0.70710678118654752440)));
    const M pdf = math_exp(M(-0.5) * z * z) * M(0.39894228040143267794);
    return cdf + z * pdf;
  }
};

// The tanh approximation: 0.5 z (1 + tanh(y)), y = sqrt(2/pi) (z + 0.044715 z^3). In float it is
// computed as z * sigmoid(2y) = z / (1 + exp(-2y)), the same function with one exp instead of a
// tanh (tanhf cost the GPU forward 2%) and no cancellation in 1 + tanh(y) for z << 0, as the CPU
// vector kernels compute it (common/cpu_activation.h). double keeps the tanh form (the float64
// reference). inner / dinner (y, y') also serve the CPU kernels' vectors as M.
template <>
struct Act<Activation::kGeluTanh> {
  template <typename M> C10_HOST_DEVICE static M inner(M z) {
    return M(0.79788456080286535588) * (z + M(0.044715) * z * z * z);
  }
  template <typename M> C10_HOST_DEVICE static M dinner(M z) {
    return M(0.79788456080286535588) * (M(1) + M(3 * 0.044715) * z * z);
  }
  template <typename M> C10_HOST_DEVICE static M forward(M z) {
    if constexpr (std::is_same_v<M, float>) {
      return math_div(z, M(1) + math_exp_fast(M(-2) * inner(z)));
    } else {
      return M(0.5) * z * (M(1) + math_tanh(inner(z)));
    }
  }
  // s = sigmoid(2y) = (1 + tanh y) / 2: d = s + z * 0.5 (1 - tanh^2 y) y' = s + 2 z s (1 - s) y'.
  template <typename M> C10_HOST_DEVICE static M derivative(M z) {
    if constexpr (std::is_same_v<M, float>) {
      const M s = math_div(M(1), M(1) + math_exp_fast(M(-2) * inner(z)));
      return s + M(2) * z * s * (M(1) - s) * dinner(z);
    } else {
      const M t = math_tanh(inner(z));
      return M(0.5) * (M(1) + t) + M(0.5) * z * (M(1) - t * t) * dinner(z);
    }
  }
};

template <>
struct Act<Activation::kSigmoid> {
  template <typename M> C10_HOST_DEVICE static M forward(M z) { return math_div(M(1), M(1) + math_exp(-z)); }
  template <typename M> C10_HOST_DEVICE static M derivative(M z) {
    const M s = forward(z);
    return s * (M(1) - s);
  }
};

template <>
struct Act<Activation::kSilu> {
  template <typename M> C10_HOST_DEVICE static M forward(M z) { return math_div(z, M(1) + math_exp(-z)); }
  template <typename M> C10_HOST_DEVICE static M derivative(M z) {
    const M s = math_div(M(1), M(1) + math_exp(-z));
    return s * (M(1) + z * (M(1) - s));
  }
};

// Calls f.template operator()<A>() with A the compile-time activation.
#define FUSEFORGE_ACTIVATION_SWITCH(ACT, CONST_NAME, ...)                                                      \
  [&] {                                                                                                         \
    using ::fuseforge::Activation;                                                                              \
    switch (ACT) {                                                                                              \
      case Activation::kIdentity: { constexpr Activation CONST_NAME = Activation::kIdentity; return __VA_ARGS__(); } \
      case Activation::kRelu: { constexpr Activation CONST_NAME = Activation::kRelu; return __VA_ARGS__(); }   \
      case Activation::kGelu: { constexpr Activation CONST_NAME = Activation::kGelu; return __VA_ARGS__(); }   \
      case Activation::kGeluTanh: { constexpr Activation CONST_NAME = Activation::kGeluTanh; return __VA_ARGS__(); } \
      case Activation::kSilu: { constexpr Activation CONST_NAME = Activation::kSilu; return __VA_ARGS__(); }   \
      default: { constexpr Activation CONST_NAME = Activation::kSigmoid; return __VA_ARGS__(); }               \
    }                                                                                                           \
  }()

}  // namespace fuseforge
