// Host-side pieces of add_mul_act shared by the CPU and CUDA implementations: input checks, the
// 2-D view every kernel works on, and output allocation.
#pragma once
#include <ATen/ATen.h>

#include <optional>

#include "common/activation.h"

namespace fuseforge::add_mul_act {

// relu saves a bit per element (its derivative is z > 0); the others save the pre-activation z.
constexpr bool saves_mask(Activation a) { return a == Activation::kRelu; }

// Every tensor is viewed as rows x cols, cols = the last dim (the bias dim).
struct Shape2d {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t mask_row_bytes() const { return (cols + 7) / 8; }  // relu mask: one bit a column, rows byte-aligned
};

struct ForwardArgs {
  at::Tensor x, y, bias;  // contiguous; bias undefined when absent
  Shape2d shape;
  Activation act;
};

struct BackwardArgs {
  at::Tensor grad_out, saved;  // contiguous
  Shape2d shape;
  Activation act;
};

struct Gradients {
  at::Tensor grad_x, grad_y, grad_bias;
};

// Checks x, y, bias and activation (errors name the argument) and returns contiguous inputs.
ForwardArgs prepare_forward(const at::Tensor& x, const at::Tensor& y, const std::optional<at::Tensor>& bias,
                            c10::string_view activation, bool allow_double);
BackwardArgs prepare_backward(const at::Tensor& grad_out, const at::Tensor& saved, c10::string_view activation,
                              bool allow_double);

// The relu bit mask (rows * mask_row_bytes() bytes) or the pre-activation z (shape of x).
at::Tensor allocate_saved(const at::Tensor& x, const Shape2d& shape, Activation act);
// grad_x always; grad_y and grad_bias only when asked (else empty tensors).
Gradients allocate_gradients(const at::Tensor& grad_out, const Shape2d& shape, bool need_grad_y, bool need_grad_bias);

}  // namespace fuseforge::add_mul_act
