// The activations of common/activation.h on CPU vectors (at::vec::Vectorized<M>, M float or double),
// shared by the per-ISA kernels of add_mul_act and glu: include only from an `<op>_cpu_kernel.h`
// (internal linkage, as common/cpu_vec.h). T is the storage type the results are rounded to.
//   forward<T, M>(z)        act(z)
//   derivative<T, M>(z)     act'(z)
//   both<T, M>(z, f, d)     act(z) and act'(z) from one set of transcendental calls (silu, gelu,
//                           gelu_tanh: glu's backward needs both)
// float: gelu_tanh as z * sigmoid(2y) (one exp a vector instead of SLEEF's tanh, which cost more than
// the rest of an op, and no cancellation in 1 + tanh(y) for z << 0; the GPU kernels compute the same
// form); for 16-bit T, silu's exp is at::vec's 20-ulp polynomial. double keeps activation.h's forms.
#pragma once
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

#include "common/activation.h"
#include "common/cpu_vec.h"
#include "common/cpu_vec_tile.h"

namespace fuseforge {
namespace {

// exp for outputs of type T: at::vec's 20-ulp polynomial (exp_u20, what torch.compile's CPU code
// calls) when T is 16-bit, whose rounding is 2^13 times coarser; SLEEF's 1-ulp exp otherwise.
template <typename T, typename M>
CpuVec<M> exp_for(CpuVec<M> v) {
  if constexpr (kIsReducedFloat<T>) return v.exp_u20();
  else return v.exp();
}

template <Activation A>
struct CpuAct;

template <>
struct CpuAct<Activation::kIdentity> {
  template <typename T, typename M> static CpuVec<M> forward(CpuVec<M> z) { return z; }
  template <typename T, typename M> static CpuVec<M> derivative(CpuVec<M>) { return CpuVec<M>(M(1)); }
};

template <>
struct CpuAct<Activation::kRelu> {
  // z > 0 ? z : 0 (NaN gives 0, as the scalar form)
  template <typename T, typename M> static CpuVec<M> forward(CpuVec<M> z) {
    return CpuVec<M>::blendv(CpuVec<M>(M(0)), z, z > CpuVec<M>(M(0)));
  }
  template <typename T, typename M> static CpuVec<M> derivative(CpuVec<M> z) {
    return CpuVec<M>::blendv(CpuVec<M>(M(0)), CpuVec<M>(M(1)), z > CpuVec<M>(M(0)));
  }
};

template <>
struct CpuAct<Activation::kSigmoid> {
  template <typename T, typename M> static CpuVec<M> forward(CpuVec<M> z) {
    return CpuVec<M>(M(1)) / (CpuVec<M>(M(1)) + z.neg().exp());
  }
  template <typename T, typename M> static CpuVec<M> derivative(CpuVec<M> z) {
    const CpuVec<M> s = forward<T, M>(z);
    return s * (CpuVec<M>(M(1)) - s);
  }
};

template <>
struct CpuAct<Activation::kSilu> {
  template <typename T, typename M> static CpuVec<M> forward(CpuVec<M> z) {
    return z / (CpuVec<M>(M(1)) + exp_for<T>(z.neg()));
  }
  template <typename T, typename M> static void both(CpuVec<M> z, CpuVec<M>& f, CpuVec<M>& d) {
    const CpuVec<M> one(M(1));
    const CpuVec<M> s = one / (one + exp_for<T>(z.neg()));
    f = z * s;  // one divide a vector (the forward's z / (1 + exp(-z)) differs by an ulp at most)
    d = s * (one + z * (one - s));
  }
  template <typename T, typename M> static CpuVec<M> derivative(CpuVec<M> z) {
    CpuVec<M> f, d;
    both<T, M>(z, f, d);
    return d;
  }
};

template <>
struct CpuAct<Activation::kGeluTanh> {
  // y and y' on vectors: common/activation.h's polynomials, instantiated for CpuVec<M>.
  template <typename M> static CpuVec<M> inner(CpuVec<M> z) { return Act<Activation::kGeluTanh>::inner(z); }
  template <typename M> static CpuVec<M> dinner(CpuVec<M> z) { return Act<Activation::kGeluTanh>::dinner(z); }
  template <typename T, typename M> static CpuVec<M> forward(CpuVec<M> z) {
    const CpuVec<M> one(M(1));
    if constexpr (std::is_same_v<M, float>) {
      return z / (one + (CpuVec<M>(M(-2)) * inner(z)).exp());
    } else {
      return CpuVec<M>(M(0.5)) * z * (one + inner(z).tanh());
    }
  }
  template <typename T, typename M> static void both(CpuVec<M> z, CpuVec<M>& f, CpuVec<M>& d) {
    const CpuVec<M> one(M(1)), half(M(0.5));
    if constexpr (std::is_same_v<M, float>) {
      // s = sigmoid(2y) = (1 + tanh y) / 2; d = s + z * 0.5 (1 - tanh^2 y) y' = s + 2 z s (1 - s) y'.
      const CpuVec<M> s = one / (one + (CpuVec<M>(M(-2)) * inner(z)).exp());
      f = z * s;
      d = s + CpuVec<M>(M(2)) * z * s * (one - s) * dinner(z);
    } else {
      const CpuVec<M> t = inner(z).tanh();
      f = half * z * (one + t);
      d = half * (one + t) + half * z * (one - t * t) * dinner(z);
    }
  }
  template <typename T, typename M> static CpuVec<M> derivative(CpuVec<M> z) {
    CpuVec<M> f, d;
    both<T, M>(z, f, d);
    return d;
  }
};

template <>
struct CpuAct<Activation::kGelu> {
  template <typename T, typename M> static CpuVec<M> forward(CpuVec<M> z) {
    return CpuVec<M>(M(0.5)) * z * (CpuVec<M>(M(1)) + accurate_erf(z * CpuVec<M>(M(0.70710678118654752440))));
  }
  template <typename T, typename M> static void both(CpuVec<M> z, CpuVec<M>& f, CpuVec<M>& d) {
    const CpuVec<M> one(M(1)), half(M(0.5));
    const CpuVec<M> erf = accurate_erf(z * CpuVec<M>(M(0.70710678118654752440)));
    f = half * z * (one + erf);
    const CpuVec<M> cdf = half * (one + erf);
    const CpuVec<M> pdf = (CpuVec<M>(M(-0.5)) * z * z).exp() * CpuVec<M>(M(0.39894228040143267794));
    d = cdf + z * pdf;
  }
  template <typename T, typename M> static CpuVec<M> derivative(CpuVec<M> z) {
    using V = CpuVec<M>;
    const V half(M(0.5)), one(M(1));
    if constexpr (std::is_same_v<M, float>) {
      // erf(z / sqrt 2) in the form of at::vec's AVX2/AVX-512 float erf (Abramowitz-Stegun 7.1.26,
      // |error| < 1.5e-7), whose exp(-z^2 / 2) is also the pdf's: one exp a vector instead of two
      // (a derivative alone was bound by its two exps).
      const V x = z * V(M(0.70710678118654752440));
      const V t = one / at::vec::fmadd(V(M(0.3275911f)), x.abs(), one);
      V r = at::vec::fmadd(V(M(1.061405429f)), t, V(M(-1.453152027f)));
      r = at::vec::fmadd(r, t, V(M(1.421413741f)));
      r = at::vec::fmadd(r, t, V(M(-0.284496736f)));
      r = at::vec::fmadd(r, t, V(M(0.254829592f)));
      const V e = (x * x).neg().exp();
      const V erf_abs = one - r * t * e;
      const V erf = V::blendv(erf_abs, erf_abs.neg(), x < V(M(0)));
      return half * (one + erf) + z * (e * V(M(0.39894228040143267794)));
    } else {
      const V cdf = half * (one + (z * V(M(0.70710678118654752440))).erf());
      const V pdf = (V(M(-0.5)) * z * z).exp() * V(M(0.39894228040143267794));
      return cdf + z * pdf;
    }
  }
};

}  // namespace
}  // namespace fuseforge
