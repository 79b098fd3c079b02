// Host-side pieces of rms_norm and layer_norm (the same kernels, LayerNorm's `centered`) shared by the
// CPU and CUDA implementations: input checks, the rows x cols view every kernel works on, output
// allocation, and the operators written once for every device (each device supplies how to run the
// forward and the backward).
#pragma once
#include <ATen/ATen.h>

#include <cmath>
#include <optional>
#include <tuple>

namespace fuseforge::rms_norm {

// Every tensor is viewed as rows x cols, cols = the last dim (hidden).
struct ForwardArgs {
  at::Tensor x, weight, bias, residual;  // contiguous; optional ones undefined when absent (bias: LayerNorm's)
  int64_t rows = 0, cols = 0;
  double eps = 0, weight_offset = 0;
  at::ScalarType out_dtype = at::kFloat;
  bool centered = false;  // LayerNorm: h - mean(h) normalised by its standard deviation, then + bias
};

struct ForwardOutputs {
  // residual_out is empty without a residual; mean (LayerNorm) and rstd undefined when not asked for.
  at::Tensor out, residual_out, mean, rstd;
};

struct BackwardArgs {
  at::Tensor grad_out, grad_residual_out, h, weight, mean, rstd;  // contiguous; optional ones undefined when absent
  int64_t rows = 0, cols = 0;
  double weight_offset = 0;
  bool centered = false;
  bool need_grad_weight = false;  // and a weight was given
  // LayerNorm's bias gradient (the column sums of grad_out) in the bias's dtype (h's or float32), when
  // wanted.
  std::optional<at::ScalarType> grad_bias_dtype;
  bool need_grad_bias() const { return grad_bias_dtype.has_value(); }
};

struct Gradients {
  at::Tensor grad_input, grad_weight, grad_bias;  // grad_weight / grad_bias empty unless needed
};

// Checks the inputs (errors name the argument and what was expected) and returns contiguous ones.
ForwardArgs prepare_forward(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
                            double eps, double weight_offset, std::optional<at::ScalarType> out_dtype,
                            bool allow_double, bool centered);
BackwardArgs prepare_backward(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out,
                              const at::Tensor& h, const std::optional<at::Tensor>& weight,
                              const std::optional<at::Tensor>& mean, const at::Tensor& rstd, double weight_offset,
                              bool need_grad_weight, std::optional<at::ScalarType> grad_bias_dtype,
                              bool allow_double, bool centered);

ForwardOutputs allocate_forward(const ForwardArgs& a, bool need_rstd);
Gradients allocate_gradients(const BackwardArgs& a);

using ForwardRunner = void (*)(const ForwardArgs&, ForwardOutputs&);
using BackwardRunner = void (*)(const BackwardArgs&, Gradients&);

template <ForwardRunner kRunForward, bool kAllowDouble>
ForwardOutputs run_forward(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
                           double eps, double weight_offset, std::optional<at::ScalarType> out_dtype, bool need_rstd,
                           bool centered) {
  const ForwardArgs a = prepare_forward(x, weight, bias, residual, eps, weight_offset, out_dtype, kAllowDouble,
                                        centered);
  ForwardOutputs o = allocate_forward(a, need_rstd);
  if (need_rstd && a.rows > 0 && a.cols == 0) {  // the mean of no squares (and of no values) is 0
    o.rstd.fill_(1.0 / std::sqrt(eps));
    if (o.mean.defined()) o.mean.zero_();
  }
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
  ForwardOutputs o =
      run_forward<kRunForward, kAllowDouble>(x, weight, {}, residual, eps, weight_offset, out_dtype, true, false);
  return {o.out, o.residual_out, o.rstd};
}

// rms_norm: the forward that stores no rstd (no gradient wanted).
template <ForwardRunner kRunForward, bool kAllowDouble>
std::tuple<at::Tensor, at::Tensor> rms_norm_op(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                               const std::optional<at::Tensor>& residual, double eps,
                                               double weight_offset, std::optional<at::ScalarType> out_dtype) {
  ForwardOutputs o =
      run_forward<kRunForward, kAllowDouble>(x, weight, {}, residual, eps, weight_offset, out_dtype, false, false);
  return {o.out, o.residual_out};
}

template <BackwardRunner kRunBackward>
Gradients run_backward(const BackwardArgs& a) {
  Gradients g = allocate_gradients(a);
  if (a.rows > 0 && a.cols > 0) {
    kRunBackward(a, g);
  } else {  // sums over no rows
    if (a.need_grad_weight) g.grad_weight.zero_();
    if (a.need_grad_bias()) g.grad_bias.zero_();
  }
  return g;
}

template <BackwardRunner kRunBackward, bool kAllowDouble>
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_op(const at::Tensor& grad_out,
                                                   const std::optional<at::Tensor>& grad_residual_out,
                                                   const at::Tensor& h, const std::optional<at::Tensor>& weight,
                                                   const at::Tensor& rstd, double weight_offset,
                                                   bool need_grad_weight) {
  const BackwardArgs a = prepare_backward(grad_out, grad_residual_out, h, weight, {}, rstd, weight_offset,
                                          need_grad_weight, std::nullopt, kAllowDouble, false);
  Gradients g = run_backward<kRunBackward>(a);
  return {g.grad_input, g.grad_weight};
}

// layer_norm_fwd / layer_norm / layer_norm_bwd: the same kernels, centered, with a bias.
template <ForwardRunner kRunForward, bool kAllowDouble>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_op(
    const at::Tensor& x, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& residual, double eps, std::optional<at::ScalarType> out_dtype) {
  ForwardOutputs o =
      run_forward<kRunForward, kAllowDouble>(x, weight, bias, residual, eps, 0.0, out_dtype, true, true);
  return {o.out, o.residual_out, o.mean, o.rstd};
}

template <ForwardRunner kRunForward, bool kAllowDouble>
std::tuple<at::Tensor, at::Tensor> layer_norm_op(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                                 const std::optional<at::Tensor>& bias,
                                                 const std::optional<at::Tensor>& residual, double eps,
                                                 std::optional<at::ScalarType> out_dtype) {
  ForwardOutputs o =
      run_forward<kRunForward, kAllowDouble>(x, weight, bias, residual, eps, 0.0, out_dtype, false, true);
  return {o.out, o.residual_out};
}

template <BackwardRunner kRunBackward, bool kAllowDouble>
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_op(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out, const at::Tensor& h,
    const std::optional<at::Tensor>& weight, const at::Tensor& mean, const at::Tensor& rstd, bool need_grad_weight,
    std::optional<at::ScalarType> grad_bias_dtype) {
  const BackwardArgs a = prepare_backward(grad_out, grad_residual_out, h, weight, mean, rstd, 0.0, need_grad_weight,
                                          grad_bias_dtype, kAllowDouble, true);
  Gradients g = run_backward<kRunBackward>(a);
  return {g.grad_input, g.grad_weight, g.grad_bias};
}

}  // namespace fuseforge::rms_norm
