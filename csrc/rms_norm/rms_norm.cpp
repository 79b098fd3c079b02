// rms_norm: input checks and the CPU implementation (the reference the CUDA kernels must match;
// float64 serves gradcheck). Elementwise arithmetic in float (double for float64), as the CUDA kernels
// do; the sums over a row and over rows in double (a sequential float sum of a 16384-wide row is
// off by ~1e-6, the CUDA kernels' tree sums are not).
#include "rms_norm/rms_norm.h"

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "common/checks.h"

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

void check_weight(const at::Tensor& ref, const char* ref_name, const at::Tensor& w, int64_t cols) {
  check_same_device(ref, ref_name, w, "weight");
  TORCH_CHECK(w.scalar_type() == ref.scalar_type() || w.scalar_type() == at::kFloat, "weight must have the dtype of ",
              ref_name, " (", ref.scalar_type(), ") or float32, got ", w.scalar_type());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == cols, "weight must have shape (", cols, ",) (the last dim of ", ref_name,
              "), got ", w.sizes());
}

const at::Tensor* present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined() ? &*t : nullptr; }

}  // namespace

ForwardArgs prepare_forward(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& residual, double eps, double weight_offset,
                            std::optional<at::ScalarType> out_dtype, bool allow_double) {
  ForwardArgs a;
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
  a.out_dtype = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(allowed_out_dtype(x.scalar_type(), a.out_dtype), "out_dtype must be the dtype of x (",
              x.scalar_type(), ") or, for a float32 x, bfloat16 or float16; got ", a.out_dtype);
  a.x = x.contiguous();
  a.eps = eps;
  a.weight_offset = weight_offset;
  return a;
}

BackwardArgs prepare_backward(const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_residual_out,
                              const at::Tensor& h, const std::optional<at::Tensor>& weight, const at::Tensor& rstd,
                              double weight_offset, bool need_grad_weight, bool allow_double) {
  BackwardArgs a;
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
  check_same_device(h, "h", rstd, "rstd");
  TORCH_CHECK(rstd.scalar_type() == stat_dtype(h.scalar_type()) && rstd.dim() == 1 && rstd.size(0) == a.rows,
              "rstd must be the forward's (", a.rows, ",) ", stat_dtype(h.scalar_type()), " tensor, got ",
              rstd.scalar_type(), " of shape ", rstd.sizes());
  a.grad_out = grad_out.contiguous();
  a.h = h.contiguous();
  a.rstd = rstd.contiguous();
  a.weight_offset = weight_offset;
  a.need_grad_weight = need_grad_weight && a.weight.defined();
  return a;
}

ForwardOutputs allocate_forward(const ForwardArgs& a) {
  ForwardOutputs o;
  o.out = at::empty(a.x.sizes(), a.x.options().dtype(a.out_dtype));
  o.residual_out = a.residual.defined() ? at::empty(a.x.sizes(), a.x.options()) : at::empty({0}, a.x.options());
  o.rstd = at::empty({a.rows}, a.x.options().dtype(stat_dtype(a.x.scalar_type())));
  return o;
}

Gradients allocate_gradients(const BackwardArgs& a) {
  Gradients g;
  g.grad_input = at::empty(a.h.sizes(), a.h.options());
  const auto grad_weight_options = a.weight.defined() ? a.weight.options() : a.h.options();
  g.grad_weight = at::empty({a.need_grad_weight ? a.cols : 0}, grad_weight_options);
  return g;
}

namespace {

// Elements of a tensor of any supported dtype, to and from the math type M.
template <typename M>
void read_as(const at::Tensor& t, int64_t offset, int64_t n, M* dst) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "rms_norm_read", [&] {
    const scalar_t* src = t.const_data_ptr<scalar_t>() + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<M>(src[i]);
  });
}

template <typename M>
void write_as(at::Tensor& t, int64_t offset, int64_t n, const M* src) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "rms_norm_write", [&] {
    scalar_t* dst = t.mutable_data_ptr<scalar_t>() + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<scalar_t>(src[i]);
  });
}

// weight_offset + weight in M, or empty without a weight (no scale).
template <typename M>
std::vector<M> scale_of(const at::Tensor& weight, double weight_offset, int64_t cols) {
  std::vector<M> w;
  if (!weight.defined()) return w;
  w.resize(cols);
  read_as<M>(weight, 0, cols, w.data());
  for (auto& v : w) v = static_cast<M>(weight_offset) + v;
  return w;
}

// Elements a task at least: below this, threads cost more than they save.
constexpr int64_t kGrainElems = 1 << 15;
// Row blocks of the weight gradient's partial sums (a constant, so the sum's order is too).
constexpr int64_t kWeightGradBlocks = 64;

template <typename T>
void forward_typed(const ForwardArgs& a, ForwardOutputs& o) {
  using M = at::opmath_type<T>;
  const int64_t cols = a.cols;
  const std::vector<M> w = scale_of<M>(a.weight, a.weight_offset, cols);
  const T* x = a.x.const_data_ptr<T>();
  const T* res = a.residual.defined() ? a.residual.const_data_ptr<T>() : nullptr;
  T* h_out = res ? o.residual_out.mutable_data_ptr<T>() : nullptr;
  M* rstd = o.rstd.mutable_data_ptr<M>();
  const M eps = static_cast<M>(a.eps);
  const int64_t grain = std::max<int64_t>(1, kGrainElems / cols);
  at::parallel_for(0, a.rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<M> row_out(cols);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t base = r * cols;
      double sumsq = 0;
      for (int64_t c = 0; c < cols; ++c) {
        // h rounded to T, as the unfused `residual + x` is, before it is squared.
        const T h = res ? static_cast<T>(static_cast<M>(x[base + c]) + static_cast<M>(res[base + c])) : x[base + c];
        if (h_out) h_out[base + c] = h;
        const M hv = static_cast<M>(h);
        sumsq += static_cast<double>(hv) * hv;
      }
      const M rs = M(1) / std::sqrt(static_cast<M>(sumsq / static_cast<double>(cols)) + eps);
      rstd[r] = rs;
      const T* h = h_out ? h_out + base : x + base;
      for (int64_t c = 0; c < cols; ++c) {
        const M xhat = static_cast<M>(h[c]) * rs;
        row_out[c] = w.empty() ? xhat : xhat * w[c];
      }
      write_as<M>(o.out, base, cols, row_out.data());
    }
  });
}

template <typename T>
void backward_typed(const BackwardArgs& a, Gradients& g) {
  using M = at::opmath_type<T>;
  const int64_t cols = a.cols;
  const std::vector<M> w = scale_of<M>(a.weight, a.weight_offset, cols);
  const T* h = a.h.const_data_ptr<T>();
  const T* grad_res = a.grad_residual_out.defined() ? a.grad_residual_out.const_data_ptr<T>() : nullptr;
  const M* rstd = a.rstd.const_data_ptr<M>();
  T* grad_input = g.grad_input.mutable_data_ptr<T>();
  const int64_t blocks = std::min(a.rows, kWeightGradBlocks);
  const int64_t rows_per_block = (a.rows + blocks - 1) / blocks;
  std::vector<double> partial(a.need_grad_weight ? blocks * cols : 0, 0.0);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<M> go(cols);
    for (int64_t b = b0; b < b1; ++b) {
      double* dw = a.need_grad_weight ? partial.data() + b * cols : nullptr;
      for (int64_t r = b * rows_per_block; r < std::min(a.rows, (b + 1) * rows_per_block); ++r) {
        const int64_t base = r * cols;
        const M rs = rstd[r];
        read_as<M>(a.grad_out, base, cols, go.data());
        double dot = 0;
        for (int64_t c = 0; c < cols; ++c) {
          const M xhat = static_cast<M>(h[base + c]) * rs;
          if (dw) dw[c] += static_cast<double>(go[c]) * xhat;
          if (!w.empty()) go[c] *= w[c];
          dot += static_cast<double>(go[c]) * xhat;
        }
        const M mean = static_cast<M>(dot / static_cast<double>(cols));
        for (int64_t c = 0; c < cols; ++c) {
          const M xhat = static_cast<M>(h[base + c]) * rs;
          M gi = rs * (go[c] - xhat * mean);
          if (grad_res) gi += static_cast<M>(grad_res[base + c]);
          grad_input[base + c] = static_cast<T>(gi);
        }
      }
    }
  });
  if (!a.need_grad_weight) return;
  std::vector<double> total(cols, 0.0);
  for (int64_t b = 0; b < blocks; ++b)  // in order: deterministic
    for (int64_t c = 0; c < cols; ++c) total[c] += partial[b * cols + c];
  write_as<double>(g.grad_weight, 0, cols, total.data());
}

void forward_cpu(const ForwardArgs& a, ForwardOutputs& o) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.x.scalar_type(), "rms_norm_fwd_cpu",
                                  [&] { forward_typed<scalar_t>(a, o); });
}

void backward_cpu(const BackwardArgs& a, Gradients& g) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.h.scalar_type(), "rms_norm_bwd_cpu",
                                  [&] { backward_typed<scalar_t>(a, g); });
}

}  // namespace

TORCH_LIBRARY_IMPL(fuseforge, CPU, m) {
  // float64 is allowed on the CPU (gradcheck).
  m.impl("rms_norm_fwd", &rms_norm_fwd_op<forward_cpu, true>);
  m.impl("rms_norm_bwd", &rms_norm_bwd_op<backward_cpu, true>);
}

}  // namespace fuseforge::rms_norm
