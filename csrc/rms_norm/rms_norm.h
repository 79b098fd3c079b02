// Host-side pieces of rms_norm shared by the CPU and CUDA implementations: input checks, the
// rows x cols view every kernel works on, output allocation, and the two operators written once
// for every device (each device supplies how to run the forward and the backward).
#pragma once
#include <ATen/ATen.h>

#include <cmath>
#include <optional>
#include <tuple>

namespace fuseforge::rms_norm {

// Every tensor is viewed as rows x cols, cols = the last dim (hidden).
struct ForwardArgs {
  at::Tensor x, weight, residual;  // contiguous; weight and residual undefined when absent
  int64_t rows = 0, cols = 0;
  double eps = 0, weight_offset = 0;
  at::ScalarType out_dtype = at::kFloat;
};

struct ForwardOutputs {
  at::Tensor out, residual_out, rstd;  // residual_out is empty without a residual; rstd undefined when not asked for
};

struct BackwardArgs {
  at::Tensor grad_out, grad_residual_out, h, weight, rstd;  // contiguous; optional ones undefined when absent
  int64_t rows = 0, cols = 0;
  double weight_offset = 0;
  bool need_grad_weight = false;  // and a weight was given
};

struct Gradients {
  at::Tensor grad_input, grad_weight;  // grad_weight empty unless needed
};

// Checks the inputs (errors name the argument and what was expected) and returns contiguous ones.
ForwardArgs prepare_forward(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& residual, double eps, double weight_offset,
                            std::optional<at::ScalarType> out_dtype, bool allow_double);
BackwardArgs prepare_backward(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out,
                              const at::Tensor& h, const std::optional<at::Tensor>& weight, const at::Tensor& rstd,
                              double weight_offset, bool need_grad_weight, bool allow_double);

ForwardOutputs allocate_forward(const ForwardArgs& a, bool need_rstd);
Gradients allocate_gradients(const BackwardArgs& a);

using ForwardRunner = void (*)(const ForwardArgs&, ForwardOutputs&);
using BackwardRunner = void (*)(const BackwardArgs&, Gradients&);

template <ForwardRunner kRunForward, bool kAllowDouble>
ForwardOutputs run_forward(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& residual, double eps, double weight_offset,
                           std::optional<at::ScalarType> out_dtype, bool need_rstd) {
  const ForwardArgs a = prepare_forward(x, weight, residual, eps, weight_offset, out_dtype, kAllowDouble);
  ForwardOutputs o = allocate_forward(a, need_rstd);
  if (need_rstd && a.rows > 0 && a.cols == 0) o.rstd.fill_(1.0 / std::sqrt(eps));  // the mean of no squares is 0
  if (a.rows > 0 && a.cols > 0) kRunForward(a, o);
  return o;
}

// rms_norm_fwd: the training forward (rstd for the backward).
template <ForwardRunner kRunForward, bool kAllowDouble>
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_fwd_op(const at::Tensor& x,
                                                               const std::optional<at::Tensor>& weight,
                                                               const std::optional<at::Tensor>& residual, double eps,
                                                               double weight_offset,
                                                               std::optional<at::ScalarType> out_dtype) {
  ForwardOutputs o = run_forward<kRunForward, kAllowDouble>(x, weight, residual, eps, weight_offset, out_dtype, true);
  return {o.out, o.residual_out, o.rstd};
}

// rms_norm: the forward that stores no rstd (no gradient wanted).
template <ForwardRunner kRunForward, bool kAllowDouble>
std::tuple<at::Tensor, at::Tensor> rms_norm_op(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                               const std::optional<at::Tensor>& residual, double eps,
                                               double weight_offset, std::optional<at::ScalarType> out_dtype) {
  ForwardOutputs o = run_forward<kRunForward, kAllowDouble>(x, weight, residual, eps, weight_offset, out_dtype, false);
  return {o.out, o.residual_out};
}

template <BackwardRunner kRunBackward, bool kAllowDouble>
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_op(const at::Tensor& grad_out,
                                                   const std::optional<at::Tensor>& grad_residual_out,
                                                   const at::Tensor& h, const std::optional<at::Tensor>& weight,
                                                   const at::Tensor& rstd, double weight_offset,
                                                   bool need_grad_weight) {
  const BackwardArgs a = prepare_backward(grad_out, grad_residual_out, h, weight, rstd, weight_offset,
                                          need_grad_weight, kAllowDouble);
  Gradients g = allocate_gradients(a);
  if (a.rows > 0 && a.cols > 0) {
    kRunBackward(a, g);
  } else if (a.need_grad_weight) {
    g.grad_weight.zero_();  // a sum over no rows
  }
  return {g.grad_input, g.grad_weight};
}

}  // namespace fuseforge::rms_norm
