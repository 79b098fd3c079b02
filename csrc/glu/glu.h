// Host-side pieces of glu shared by the CPU and CUDA implementations: the activation names it takes,
// input checks, the rows x cols addressing every kernel works on, and output allocation.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

#include "common/activation.h"

namespace fuseforge::glu {

// The activations glu builds kernels for (each one costs a set of instantiations); any other name,
// even one of common/activation.h's, is an error listing these.
Activation parse_glu_activation(c10::string_view name);

// Calls f.template operator()<A>() for glu's activations only (FUSEFORGE_ACTIVATION_SWITCH would
// instantiate all six).
#define FUSEFORGE_GLU_ACTIVATION_SWITCH(ACT, CONST_NAME, ...)                                                  \
  [&] {                                                                                                         \
    using ::fuseforge::Activation;                                                                              \
    switch (ACT) {                                                                                              \
      case Activation::kGelu: { constexpr Activation CONST_NAME = Activation::kGelu; return __VA_ARGS__(); }   \
      case Activation::kGeluTanh: { constexpr Activation CONST_NAME = Activation::kGeluTanh; return __VA_ARGS__(); } \
      default: { constexpr Activation CONST_NAME = Activation::kSilu; return __VA_ARGS__(); }                  \
    }                                                                                                           \
  }()

// A rows x cols matrix inside some tensor's memory: element (r, c) at data + r * row_stride + c.
// `owner` keeps the memory alive (a contiguous copy when the input's rows could not be addressed
// with one stride).
struct RowMatrix {
  at::Tensor owner;
  const void* data = nullptr;
  int64_t row_stride = 0;  // elements
};

struct ForwardArgs {
  RowMatrix gate, up;  // up: the second half of each fused row when the op got no up
  int64_t rows = 0, cols = 0;
  Activation act = Activation::kSilu;
  std::vector<int64_t> out_shape;  // (..., cols)
  at::TensorOptions options;       // gate's dtype and device
};

struct BackwardArgs {
  RowMatrix grad_out, gate, up;
  int64_t rows = 0, cols = 0;
  Activation act = Activation::kSilu;
  bool fused = false;
};

// Checks gate, up and activation (errors name the argument); allow_double: float64 (CPU).
ForwardArgs prepare_forward(const at::Tensor& gate, const std::optional<at::Tensor>& up, c10::string_view activation,
                            bool allow_double);
BackwardArgs prepare_backward(const at::Tensor& grad_out, const at::Tensor& gate, const std::optional<at::Tensor>& up,
                              c10::string_view activation, bool allow_double);

// The backward's outputs: grad_gate of gate's shape (the fused [grad_gate | grad_up] when fused),
// grad_up of up's shape (empty when fused), contiguous; the kernels write through the pointers
// and row strides below.
struct Gradients {
  at::Tensor grad_gate, grad_up;
  void* gate_data = nullptr;
  void* up_data = nullptr;
  int64_t gate_row_stride = 0, up_row_stride = 0;
};
Gradients allocate_gradients(const BackwardArgs& a, const at::Tensor& gate, const std::optional<at::Tensor>& up);

// The two operators, written once for every device: each device supplies how to run the kernels
// (never called for an empty problem) and whether it takes float64.
using ForwardRunner = void (*)(const ForwardArgs&, at::Tensor& out);
using BackwardRunner = void (*)(const BackwardArgs&, Gradients& grads);

template <ForwardRunner kRunForward, bool kAllowDouble>
at::Tensor glu_fwd_op(const at::Tensor& gate, const std::optional<at::Tensor>& up, c10::string_view activation) {
  const ForwardArgs a = prepare_forward(gate, up, activation, kAllowDouble);
  at::Tensor out = at::empty(a.out_shape, a.options);
  if (a.rows > 0 && a.cols > 0) kRunForward(a, out);
  return out;
}

template <BackwardRunner kRunBackward, bool kAllowDouble>
std::tuple<at::Tensor, at::Tensor> glu_bwd_op(const at::Tensor& grad_out, const at::Tensor& gate,
                                              const std::optional<at::Tensor>& up, c10::string_view activation) {
  const BackwardArgs a = prepare_backward(grad_out, gate, up, activation, kAllowDouble);
  Gradients g = allocate_gradients(a, gate, up);
  if (a.rows > 0 && a.cols > 0) kRunBackward(a, g);
  return {g.grad_gate, g.grad_up};
}

}  // namespace fuseforge::glu
