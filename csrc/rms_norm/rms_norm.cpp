// rms_norm: input checks and the CPU implementation (the reference the CUDA kernels must match;
// float64 serves gradcheck). Elementwise arithmetic in float (double for float64), as the CUDA kernels
// do; the CPU kernels (vectorized per ISA, rms_norm_cpu_kernel.h) sum a row in 64 float lanes added
// in a tree (a sequential float sum of a 16384-wide row is off by ~1e-6, the CUDA kernels' tree
// sums are not).
#include "rms_norm/rms_norm.h"
#include "rms_norm/rms_norm_cpu.h"

#include <torch/library.h>

#include "common/checks.h"
#include "common/cpu_isa.h"
#include "common/not_differentiable.h"

namespace fuseforge::rms_norm {

namespace {

int64_t rows_of(const at::Tensor& t) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  return rows;
}

at::ScalarType stat_dtype(at::ScalarType input) { return input == at::kDouble ? at::kDouble : at::kFloat; }

// The forward's out dtype: the input's, or bf16/fp16 for a float32 input (an fp32 residual stream
// feeding a 16-bit matmul).
bool allowed_out_dtype(at::ScalarType input, at::ScalarType out) {
  return out == input || (input == at::kFloat && (out == at::kBFloat16 || out == at::kHalf));
}

// weight (and LayerNorm's bias): ref's dtype or float32, shape (cols,).
void check_weight(const at::Tensor& ref, const char* ref_name, const at::Tensor& w, int64_t cols,
                  const char* name = "weight") {
  check_same_device(ref, ref_name, w, name);
  TORCH_CHECK(w.scalar_type() == ref.scalar_type() || w.scalar_type() == at::kFloat, name, " must have the dtype of ",
              ref_name, " (", ref.scalar_type(), ") or float32, got ", w.scalar_type());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == cols, name, " must have shape (", cols, ",) (the last dim of ", ref_name,
              "), got ", w.sizes());
}

void check_row_stat(const at::Tensor& h, const at::Tensor& stat, const char* name, int64_t rows) {
  check_same_device(h, "h", stat, name);
  TORCH_CHECK(stat.scalar_type() == stat_dtype(h.scalar_type()) && stat.dim() == 1 && stat.size(0) == rows, name,
              " must be the forward's (", rows, ",) ", stat_dtype(h.scalar_type()), " tensor, got ",
              stat.scalar_type(), " of shape ", stat.sizes());
}

const at::Tensor* present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined() ? &*t : nullptr; }

}  // namespace

ForwardArgs prepare_forward(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual,
                            double eps, double weight_offset, std::optional<at::ScalarType> out_dtype,
                            bool allow_double, bool centered) {
  ForwardArgs a;
  a.centered = centered;
  check_dtype_supported(x, "x", allow_double);
  TORCH_CHECK(x.dim() >= 1, "x must have at least one dimension (the hidden dim), got a 0-dim tensor");
  a.cols = x.size(-1);
  a.rows = rows_of(x);
  if (const at::Tensor* r = present(residual)) {
    check_same_device(x, "x", *r, "residual");
    check_same_dtype(x, "x", *r, "residual");
    check_same_shape(x, "x", *r, "residual");
    a.residual = r->contiguous();
  }
  if (const at::Tensor* w = present(weight)) {
    check_weight(x, "x", *w, a.cols);
    a.weight = w->contiguous();
  }
  if (const at::Tensor* b = present(bias)) {
    check_weight(x, "x", *b, a.cols, "bias");
    a.bias = b->contiguous();
  }
  a.out_dtype = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(allowed_out_dtype(x.scalar_type(), a.out_dtype), "out_dtype must be the dtype of x (",
              x.scalar_type(), ") or, for a float32 x, bfloat16 or float16; got ", a.out_dtype);
  a.x = x.contiguous();
  a.eps = eps;
  a.weight_offset = weight_offset;
  return a;
}

BackwardArgs prepare_backward(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out,
                              const at::Tensor& h, const std::optional<at::Tensor>& weight,
                              const std::optional<at::Tensor>& mean, const at::Tensor& rstd, double weight_offset,
                              bool need_grad_weight, std::optional<at::ScalarType> grad_bias_dtype,
                              bool allow_double, bool centered) {
  BackwardArgs a;
  a.centered = centered;
  check_dtype_supported(h, "h", allow_double);
  TORCH_CHECK(h.dim() >= 1, "h must have at least one dimension (the hidden dim), got a 0-dim tensor");
  a.cols = h.size(-1);
  a.rows = rows_of(h);
  check_same_device(h, "h", grad_out, "grad_out");
  check_same_shape(h, "h", grad_out, "grad_out");
  TORCH_CHECK(allowed_out_dtype(h.scalar_type(), grad_out.scalar_type()),
              "grad_out must have the forward's out dtype: the dtype of h (", h.scalar_type(),
              ") or, for a float32 h, bfloat16 or float16; got ", grad_out.scalar_type());
  if (const at::Tensor* gr = present(grad_residual_out)) {
    check_same_device(h, "h", *gr, "grad_residual_out");
    check_same_dtype(h, "h", *gr, "grad_residual_out");
    check_same_shape(h, "h", *gr, "grad_residual_out");
    a.grad_residual_out = gr->contiguous();
  }
  if (const at::Tensor* w = present(weight)) {
    check_weight(h, "h", *w, a.cols);
    a.weight = w->contiguous();
  }
  check_row_stat(h, rstd, "rstd", a.rows);
  if (centered) {
    const at::Tensor* m = present(mean);
    TORCH_CHECK(m != nullptr, "mean must be given (the forward's row means)");
    check_row_stat(h, *m, "mean", a.rows);
    a.mean = m->contiguous();
  }
  a.grad_out = grad_out.contiguous();
  a.h = h.contiguous();
  a.rstd = rstd.contiguous();
  a.weight_offset = weight_offset;
  a.need_grad_weight = need_grad_weight && a.weight.defined();
  if (centered && grad_bias_dtype.has_value()) {
    TORCH_CHECK(*grad_bias_dtype == h.scalar_type() || *grad_bias_dtype == at::kFloat,
                "grad_bias_dtype (the bias's dtype) must be the dtype of h (", h.scalar_type(),
                ") or float32, got ", *grad_bias_dtype);
    a.grad_bias_dtype = grad_bias_dtype;
  }
  return a;
}

ForwardOutputs allocate_forward(const ForwardArgs& a, bool need_rstd) {
  ForwardOutputs o;
  o.out = at::empty(a.x.sizes(), a.x.options().dtype(a.out_dtype));
  o.residual_out = a.residual.defined() ? at::empty(a.x.sizes(), a.x.options()) : at::empty({0}, a.x.options());
  if (need_rstd) o.rstd = at::empty({a.rows}, a.x.options().dtype(stat_dtype(a.x.scalar_type())));
  if (need_rstd && a.centered) o.mean = at::empty_like(o.rstd);
  return o;
}

Gradients allocate_gradients(const BackwardArgs& a) {
  Gradients g;
  g.grad_input = at::empty(a.h.sizes(), a.h.options());
  const auto grad_weight_options = a.weight.defined() ? a.weight.options() : a.h.options();
  g.grad_weight = at::empty({a.need_grad_weight ? a.cols : 0}, grad_weight_options);
  // grad_bias in the bias's dtype (no cast after the op: a launch less); empty in the statistics' dtype
  // when not wanted.
  g.grad_bias = a.need_grad_bias() ? at::empty({a.cols}, a.h.options().dtype(*a.grad_bias_dtype))
                                   : at::empty({0}, a.h.options().dtype(stat_dtype(a.h.scalar_type())));
  return g;
}

namespace {

// The kernels are vectorized and built per CPU ISA (rms_norm_cpu_kernel.h, common/cpu_isa.h).
void forward_cpu(const ForwardArgs& a, ForwardOutputs& o) {
  CpuForwardArgs k{};
  k.x = a.x.const_data_ptr();
  k.residual = a.residual.defined() ? a.residual.const_data_ptr() : nullptr;
  k.weight = a.weight.defined() ? a.weight.const_data_ptr() : nullptr;
  k.weight_dtype = a.weight.defined() ? a.weight.scalar_type() : a.x.scalar_type();
  k.bias = a.bias.defined() ? a.bias.const_data_ptr() : nullptr;
  k.bias_dtype = a.bias.defined() ? a.bias.scalar_type() : a.x.scalar_type();
  k.centered = a.centered;
  k.weight_offset = a.weight_offset;
  k.eps = a.eps;
  k.out = o.out.mutable_data_ptr();
  k.mean = o.mean.defined() ? o.mean.mutable_data_ptr() : nullptr;
  k.residual_out = a.residual.defined() ? o.residual_out.mutable_data_ptr() : nullptr;
  k.rstd = o.rstd.defined() ? o.rstd.mutable_data_ptr() : nullptr;
  k.rows = a.rows;
  k.cols = a.cols;
  k.dtype = a.x.scalar_type();
  k.out_dtype = o.out.scalar_type();
  FUSEFORGE_CPU_ISA_CALL(forward, k);
}

void backward_cpu(const BackwardArgs& a, Gradients& g) {
  CpuBackwardArgs k{};
  k.grad_out = a.grad_out.const_data_ptr();
  k.grad_residual_out = a.grad_residual_out.defined() ? a.grad_residual_out.const_data_ptr() : nullptr;
  k.h = a.h.const_data_ptr();
  k.weight = a.weight.defined() ? a.weight.const_data_ptr() : nullptr;
  k.weight_dtype = a.weight.defined() ? a.weight.scalar_type() : a.h.scalar_type();
  k.weight_offset = a.weight_offset;
  k.rstd = a.rstd.const_data_ptr();
  k.mean = a.centered ? a.mean.const_data_ptr() : nullptr;
  k.grad_input = g.grad_input.mutable_data_ptr();
  k.grad_weight = a.need_grad_weight ? g.grad_weight.mutable_data_ptr() : nullptr;
  k.grad_bias = a.need_grad_bias() ? g.grad_bias.mutable_data_ptr() : nullptr;
  k.bias_dtype = a.grad_bias_dtype.value_or(at::kFloat);
  k.rows = a.rows;
  k.cols = a.cols;
  k.dtype = a.h.scalar_type();
  k.grad_out_dtype = a.grad_out.scalar_type();
  FUSEFORGE_CPU_ISA_CALL(backward, k);
}

}  // namespace

TORCH_LIBRARY_IMPL(fuseforge, CPU, m) {
  // float64 is allowed on the CPU (gradcheck).
  m.impl("rms_norm_fwd", &rms_norm_fwd_op<forward_cpu, true>);
  m.impl("rms_norm", &rms_norm_op<forward_cpu, true>);
  m.impl("rms_norm_bwd", &rms_norm_bwd_op<backward_cpu, true>);
  m.impl("layer_norm_fwd", &layer_norm_fwd_op<forward_cpu, true>);
  m.impl("layer_norm", &layer_norm_op<forward_cpu, true>);
  m.impl("layer_norm_bwd", &layer_norm_bwd_op<backward_cpu, true>);
}

// The backward ops have no backward of their own (common/not_differentiable.h).
TORCH_LIBRARY_IMPL(fuseforge, Autograd, m) {
  m.impl("rms_norm_bwd", fuseforge::not_differentiable());
  m.impl("layer_norm_bwd", fuseforge::not_differentiable());
}

}  // namespace fuseforge::rms_norm
