// The AdamW update of one element, written once for the CPU backend and the CUDA kernel. The
// rounding differs in one place: on the GPU it follows torch's fused CUDA kernel element for element
// (the reference the GPU bar names), on the CPU the more exact m + (1 - beta)(g - m) form. M is the math type:
// float for float32/float16/bfloat16 params, double for float64 params (CPU only).
#pragma once
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define FUSEFORGE_ADAMW_HD __host__ __device__ __forceinline__
#else
#define FUSEFORGE_ADAMW_HD inline
#endif

namespace fuseforge::adamw {

// Per-tensor scalars of one step, computed once per block from the group's hyperparameters and
// the tensor's step count (after the increment).
template <typename M>
struct StepScalars {
  M beta1, beta2, one_minus_beta1, one_minus_beta2, eps;
  M neg_lr_wd;    // -lr * weight_decay: decoupled decay, applied to the param first
  M step_size;    // lr / (1 - beta1^t)
  M bc2_sqrt;     // sqrt(1 - beta2^t)
  M grad_scale;   // GradScaler's scale (1 when absent): grads are divided by it
  uint32_t step_index;  // the step count t: seeds the stochastic rounding of bfloat16 states
  bool maximize;
  bool unscale;   // grad_scale given: divide, and write the unscaled grad back (as torch's fused AdamW)
};

template <typename M>
FUSEFORGE_ADAMW_HD StepScalars<M> make_step_scalars(double lr, double beta1, double beta2, double eps,
                                                    double weight_decay, bool maximize, double step,
                                                    const float* grad_scale) {
  StepScalars<M> s;
  s.beta1 = static_cast<M>(beta1);
  s.beta2 = static_cast<M>(beta2);
  s.eps = static_cast<M>(eps);
  s.grad_scale = grad_scale ? static_cast<M>(*grad_scale) : M(1);
  s.step_index = static_cast<uint32_t>(step);
  s.maximize = maximize;
  s.unscale = grad_scale != nullptr;
#if defined(__CUDA_ARCH__)
  // On the GPU the bar is torch.optim.AdamW(fused=True) element for element (rtol 1e-6): its kernel
  // (fused_adam_utils.cuh, torch 2.11 and 2.14) rounds every hyperparameter to float first and
  // forms the bias corrections, step size and decay factor in float, with the device's powf. Doing
  // them in double instead leaves a 3e-7 difference after 5 steps at lr 1e-2, past that bar.
  const M lr_m = static_cast<M>(lr), step_m = static_cast<M>(step);
  s.neg_lr_wd = -(lr_m * static_cast<M>(weight_decay));
  s.step_size = lr_m / (M(1) - pow(s.beta1, step_m));
  s.bc2_sqrt = sqrt(M(1) - pow(s.beta2, step_m));
  s.one_minus_beta1 = M(1) - s.beta1;  // unused on the GPU (see adamw_element)
  s.one_minus_beta2 = M(1) - s.beta2;
#else
  // The CPU keeps the more exact forms: 1 - beta and the bias corrections from the double values,
  // and moments updated as m + (1 - beta)(g - m), so only 1 - beta is rounded and the implied beta
  // is accurate to ~1e-10 for beta2 = 0.999 (beta m + (1 - beta) g with both rounded to float
  // biases the moments by ~1 ulp a step: ~1e-6 after 100 steps).
  s.one_minus_beta1 = static_cast<M>(1.0 - beta1);
  s.one_minus_beta2 = static_cast<M>(1.0 - beta2);
  s.neg_lr_wd = static_cast<M>(-(lr * weight_decay));
  s.step_size = static_cast<M>(lr / (1.0 - std::pow(beta1, step)));
  s.bc2_sqrt = static_cast<M>(std::sqrt(1.0 - std::pow(beta2, step)));
#endif
  return s;
}

template <typename M>
FUSEFORGE_ADAMW_HD M adamw_fma(M a, M b, M c) {
#if defined(__CUDA_ARCH__)
  return fma(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

template <typename M>
FUSEFORGE_ADAMW_HD M adamw_sqrt(M x) {
#if defined(__CUDA_ARCH__)
  return sqrt(x);
#else
  return std::sqrt(x);
#endif
}

// One element: p (param or master), g (grad; on return the unscaled grad), m, v, vmax (amsgrad).
template <typename M, bool kAmsgrad>
FUSEFORGE_ADAMW_HD void adamw_element(M& p, M& g, M& m, M& v, M& vmax, const StepScalars<M>& s) {
  if (s.unscale) g = g / s.grad_scale;
  const M d = s.maximize ? -g : g;
  p = adamw_fma(s.neg_lr_wd, p, p);
#if defined(__CUDA_ARCH__)
  // torch's fused CUDA form (see make_step_scalars): beta m + (g - beta g), both as fmas.
  m = adamw_fma(s.beta1, m, adamw_fma(-s.beta1, d, d));
  const M dd = d * d;
  v = adamw_fma(s.beta2, v, adamw_fma(-s.beta2, dd, dd));
#else
  m = adamw_fma(s.one_minus_beta1, d - m, m);
  v = adamw_fma(s.one_minus_beta2, d * d - v, v);
#endif
  M second = v;
  if constexpr (kAmsgrad) {
    vmax = vmax > v ? vmax : v;
    second = vmax;
  }
  const M denom = adamw_sqrt(second) / s.bc2_sqrt + s.eps;
  p = p - (s.step_size * m) / denom;
}

}  // namespace fuseforge::adamw
