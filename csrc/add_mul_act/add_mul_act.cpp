// add_mul_act: input checks and the CPU implementation (the reference the CUDA kernels must match;
// float64 serves gradcheck).
#include "add_mul_act/add_mul_act.h"
#include "add_mul_act/add_mul_act_ops.h"

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/checks.h"
#include "common/dispatch.h"

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

// Columns are split across threads so each column's bias sum is one thread's, in row order:
// deterministic.
constexpr int64_t kColumnGrain = 256;

template <typename T, Activation A>
void forward_cpu_kernel(const ForwardArgs& a, double alpha_d, at::Tensor& out, at::Tensor* saved) {
  using M = at::opmath_type<T>;
  const M alpha = static_cast<M>(alpha_d);
  const T* x = a.x.const_data_ptr<T>();
  const T* y = a.y.const_data_ptr<T>();
  const T* bias = a.bias.defined() ? a.bias.const_data_ptr<T>() : nullptr;
  T* o = out.mutable_data_ptr<T>();
  T* z_out = (saved && !saves_mask(A)) ? saved->mutable_data_ptr<T>() : nullptr;
  uint8_t* mask = (saved && saves_mask(A)) ? saved->mutable_data_ptr<uint8_t>() : nullptr;
  const Shape2d s = a.shape;
  const int64_t groups = s.mask_row_bytes();
  at::parallel_for(0, groups, std::max<int64_t>(1, kColumnGrain / 8), [&](int64_t g0, int64_t g1) {
    for (int64_t r = 0; r < s.rows; ++r) {
      for (int64_t g = g0; g < g1; ++g) {
        uint8_t bits = 0;
        for (int64_t c = g * 8, j = 0; j < 8 && c < s.cols; ++j, ++c) {
          const int64_t i = r * s.cols + c;
          M z = static_cast<M>(x[i]) + alpha * static_cast<M>(y[i]);
          if (bias) z += static_cast<M>(bias[c]);
          o[i] = static_cast<T>(Act<A>::forward(z));
          if (z_out) z_out[i] = static_cast<T>(z);
          bits |= static_cast<uint8_t>(z > M(0)) << j;
        }
        if (mask) mask[r * groups + g] = bits;
      }
    }
  });
}

template <typename T, Activation A>
void backward_cpu_kernel(const BackwardArgs& a, double alpha_d, Gradients& g) {
  using M = at::opmath_type<T>;
  const M alpha = static_cast<M>(alpha_d);
  const T* go = a.grad_out.const_data_ptr<T>();
  const T* z_in = saves_mask(A) ? nullptr : a.saved.const_data_ptr<T>();
  const uint8_t* mask = saves_mask(A) ? a.saved.const_data_ptr<uint8_t>() : nullptr;
  T* gx = g.grad_x.mutable_data_ptr<T>();
  T* gy = g.grad_y.numel() ? g.grad_y.mutable_data_ptr<T>() : nullptr;
  T* gb = g.grad_bias.numel() ? g.grad_bias.mutable_data_ptr<T>() : nullptr;
  const Shape2d s = a.shape;
  const int64_t groups = s.mask_row_bytes();
  at::parallel_for(0, s.cols, kColumnGrain, [&](int64_t c0, int64_t c1) {
    std::vector<M> bias_sum(gb ? c1 - c0 : 0, M(0));
    for (int64_t r = 0; r < s.rows; ++r) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t i = r * s.cols + c;
        const M d = mask ? M((mask[r * groups + c / 8] >> (c % 8)) & 1) : Act<A>::derivative(static_cast<M>(z_in[i]));
        const M gxi = static_cast<M>(go[i]) * d;
        gx[i] = static_cast<T>(gxi);
        if (gy) gy[i] = static_cast<T>(alpha * gxi);
        if (gb) bias_sum[c - c0] += gxi;
      }
    }
    if (gb)
      for (int64_t c = c0; c < c1; ++c) gb[c] = static_cast<T>(bias_sum[c - c0]);
  });
}

void forward_cpu_dispatch(const ForwardArgs& a, double alpha, at::Tensor& out, at::Tensor* saved) {
  FUSEFORGE_DISPATCH_FLOATING(a.x.scalar_type(), "add_mul_act_cpu", [&] {
    FUSEFORGE_ACTIVATION_SWITCH(a.act, kAct, [&] { forward_cpu_kernel<scalar_t, kAct>(a, alpha, out, saved); });
  });
}

void backward_cpu_dispatch(const BackwardArgs& a, double alpha, Gradients& g) {
  FUSEFORGE_DISPATCH_FLOATING(a.grad_out.scalar_type(), "add_mul_act_bwd_cpu", [&] {
    FUSEFORGE_ACTIVATION_SWITCH(a.act, kAct, [&] { backward_cpu_kernel<scalar_t, kAct>(a, alpha, g); });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fuseforge, CPU, m) {
  // float64 is allowed on the CPU (gradcheck).
  m.impl("add_mul_act", &add_mul_act_op<forward_cpu_dispatch, true>);
  m.impl("add_mul_act_fwd", &add_mul_act_fwd_op<forward_cpu_dispatch, true>);
  m.impl("add_mul_act_bwd", &add_mul_act_bwd_op<backward_cpu_dispatch, true>);
  m.impl("add_mul_act_", &add_mul_act_inplace_op<forward_cpu_dispatch, true>);
}

}  // namespace fuseforge::add_mul_act
