// The four add_mul_act operators, written once for every device: checks, allocation, and the
// in-place write-back here; each device supplies how to run the forward and the backward
// (kRunForward / kRunBackward) and whether it takes float64. Host-only (plain C++).
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "add_mul_act/add_mul_act.h"

namespace fuseforge::add_mul_act {

using ForwardRunner = void (*)(const ForwardArgs&, double alpha, at::Tensor& out, at::Tensor* saved);
using BackwardRunner = void (*)(const BackwardArgs&, double alpha, Gradients& grads);

template <ForwardRunner kRunForward, bool kAllowDouble>
at::Tensor add_mul_act_op(const at::Tensor& x, const at::Tensor& y, const std::optional<at::Tensor>& bias,
                          double alpha, c10::string_view activation) {
  const ForwardArgs a = prepare_forward(x, y, bias, activation, kAllowDouble);
  at::Tensor out = at::empty(x.sizes(), x.options());
  kRunForward(a, alpha, out, nullptr);
  return out;
}

template <ForwardRunner kRunForward, bool kAllowDouble>
std::tuple<at::Tensor, at::Tensor> add_mul_act_fwd_op(const at::Tensor& x, const at::Tensor& y,
                                                      const std::optional<at::Tensor>& bias, double alpha,
                                                      c10::string_view activation) {
  const ForwardArgs a = prepare_forward(x, y, bias, activation, kAllowDouble);
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor saved = allocate_saved(x, a.shape, a.act);
  kRunForward(a, alpha, out, &saved);
  return {out, saved};
}

template <ForwardRunner kRunForward, bool kAllowDouble>
void add_mul_act_inplace_op(at::Tensor& x, const at::Tensor& y, const std::optional<at::Tensor>& bias, double alpha,
                            c10::string_view activation) {
  const ForwardArgs a = prepare_forward(x, y, bias, activation, kAllowDouble);
  // a.x is x itself when x is contiguous; otherwise compute into a.x's copy and copy back.
  at::Tensor out = a.x;
  kRunForward(a, alpha, out, nullptr);
  if (!out.is_same(x)) x.copy_(out);
}

template <BackwardRunner kRunBackward, bool kAllowDouble>
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_mul_act_bwd_op(const at::Tensor& grad_out, const at::Tensor& saved,
                                                                  double alpha, c10::string_view activation,
                                                                  bool need_grad_y, bool need_grad_bias) {
  const BackwardArgs a = prepare_backward(grad_out, saved, activation, kAllowDouble);
  Gradients g = allocate_gradients(grad_out, a.shape, need_grad_y, need_grad_bias);
  kRunBackward(a, alpha, g);
  return {g.grad_x, g.grad_y, g.grad_bias};
}

}  // namespace fuseforge::add_mul_act
