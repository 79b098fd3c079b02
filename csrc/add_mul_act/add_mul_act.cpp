// add_mul_act: input checks and the CPU implementation (the reference the CUDA kernels must match;
// float64 serves gradcheck).
#include "add_mul_act/add_mul_act.h"
#include "add_mul_act/add_mul_act_cpu.h"
#include "add_mul_act/add_mul_act_ops.h"

#include <torch/library.h>

#include "common/checks.h"
#include "common/cpu_isa.h"
#include "common/not_differentiable.h"

namespace fuseforge::add_mul_act {

namespace {

Shape2d shape_of(const at::Tensor& t) {
  Shape2d s;
  s.cols = t.dim() == 0 ? 1 : t.size(-1);
  s.rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) s.rows *= t.size(d);
  return s;
}

}  // namespace

ForwardArgs prepare_forward(const at::Tensor& x, const at::Tensor& y, const std::optional<at::Tensor>& bias,
                            c10::string_view activation, bool allow_double) {
  ForwardArgs args;
  args.act = parse_activation(activation);
  check_dtype_supported(x, "x", allow_double);
  check_same_device(x, "x", y, "y");
  check_same_dtype(x, "x", y, "y");
  check_same_shape(x, "x", y, "y");
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(x.dim() >= 1, "bias needs x with at least one dimension, got a 0-dim x");
    check_same_device(x, "x", *bias, "bias");
    check_same_dtype(x, "x", *bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == x.size(-1), "bias must have shape (", x.size(-1),
                ",) (the last dim of x), got ", bias->sizes());
    args.bias = bias->contiguous();
  }
  args.x = x.contiguous();
  args.y = y.contiguous();
  args.shape = shape_of(x);
  return args;
}

BackwardArgs prepare_backward(const at::Tensor& grad_out, const at::Tensor& saved, c10::string_view activation,
                              bool allow_double) {
  BackwardArgs args;
  args.act = parse_activation(activation);
  check_dtype_supported(grad_out, "grad_out", allow_double);
  check_same_device(grad_out, "grad_out", saved, "saved");
  args.shape = shape_of(grad_out);
  if (saves_mask(args.act)) {
    TORCH_CHECK(saved.scalar_type() == at::kByte && saved.dim() == 1 &&
                    saved.numel() == args.shape.rows * args.shape.mask_row_bytes(),
                "saved must be the uint8 bit mask add_mul_act_fwd returned for relu (",
                args.shape.rows * args.shape.mask_row_bytes(), " bytes), got ", saved.scalar_type(), " of shape ",
                saved.sizes());
  } else {
    check_same_dtype(grad_out, "grad_out", saved, "saved");
    check_same_shape(grad_out, "grad_out", saved, "saved");
  }
  args.grad_out = grad_out.contiguous();
  args.saved = saved.contiguous();
  return args;
}

at::Tensor allocate_saved(const at::Tensor& x, const Shape2d& shape, Activation act) {
  if (saves_mask(act)) return at::empty({shape.rows * shape.mask_row_bytes()}, x.options().dtype(at::kByte));
  return at::empty(x.sizes(), x.options());
}

Gradients allocate_gradients(const at::Tensor& grad_out, const Shape2d& shape, bool need_grad_y,
                             bool need_grad_bias) {
  Gradients g;
  g.grad_x = at::empty(grad_out.sizes(), grad_out.options());
  g.grad_y = need_grad_y ? at::empty(grad_out.sizes(), grad_out.options()) : at::empty({0}, grad_out.options());
  g.grad_bias = at::empty({need_grad_bias ? shape.cols : 0}, grad_out.options());
  return g;
}

namespace {

// The kernels are vectorized and built per CPU ISA (add_mul_act_cpu_kernel.h, common/cpu_isa.h).
void forward_cpu_dispatch(const ForwardArgs& a, double alpha, at::Tensor& out, at::Tensor* saved) {
  CpuForwardArgs k{};
  k.x = a.x.const_data_ptr();
  k.y = a.y.const_data_ptr();
  k.bias = a.bias.defined() ? a.bias.const_data_ptr() : nullptr;
  k.out = out.mutable_data_ptr();
  k.saved_z = (saved && !saves_mask(a.act)) ? saved->mutable_data_ptr() : nullptr;
  k.mask = (saved && saves_mask(a.act)) ? saved->mutable_data_ptr<uint8_t>() : nullptr;
  k.rows = a.shape.rows;
  k.cols = a.shape.cols;
  k.alpha = alpha;
  k.act = a.act;
  k.dtype = a.x.scalar_type();
  FUSEFORGE_CPU_ISA_CALL(forward, k);
}

void backward_cpu_dispatch(const BackwardArgs& a, double alpha, Gradients& g) {
  CpuBackwardArgs k{};
  k.grad_out = a.grad_out.const_data_ptr();
  k.saved_z = saves_mask(a.act) ? nullptr : a.saved.const_data_ptr();
  k.mask = saves_mask(a.act) ? a.saved.const_data_ptr<uint8_t>() : nullptr;
  k.grad_x = g.grad_x.mutable_data_ptr();
  k.grad_y = g.grad_y.numel() ? g.grad_y.mutable_data_ptr() : nullptr;
  k.grad_bias = g.grad_bias.numel() ? g.grad_bias.mutable_data_ptr() : nullptr;
  k.rows = a.shape.rows;
  k.cols = a.shape.cols;
  k.alpha = alpha;
  k.act = a.act;
  k.dtype = a.grad_out.scalar_type();
  FUSEFORGE_CPU_ISA_CALL(backward, k);
}

}  // namespace

TORCH_LIBRARY_IMPL(fuseforge, CPU, m) {
  // float64 is allowed on the CPU (gradcheck).
  m.impl("add_mul_act", &add_mul_act_op<forward_cpu_dispatch, true>);
  m.impl("add_mul_act_fwd", &add_mul_act_fwd_op<forward_cpu_dispatch, true>);
  m.impl("add_mul_act_bwd", &add_mul_act_bwd_op<backward_cpu_dispatch, true>);
  m.impl("add_mul_act_", &add_mul_act_inplace_op<forward_cpu_dispatch, true>);
}

// The backward ops have no backward of their own (common/not_differentiable.h).
TORCH_LIBRARY_IMPL(fuseforge, Autograd, m) {
  m.impl("add_mul_act_bwd", fuseforge::not_differentiable());
}

}  // namespace fuseforge::add_mul_act
