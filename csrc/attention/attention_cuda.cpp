// attention CUDA implementation, host side: checks, device guard, allocation, params, the dtype and
// head-dim dispatch to the launchers (instantiations/*.cu). No host sync. Compiled by the C++
// compiler, not nvcc (see docs/DEVELOPING.md).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "attention/attention.h"
#include "attention/attention_params.h"

namespace fuseforge::attention {
namespace {

// The kernels copy rows with 16-byte cp.async: every stride of a dim with more than one element
// must be a multiple of 8 elements and the data 16-byte aligned. Dense tensors always are (the head
// dim is 64 or 128); anything else (an odd slice) is copied once.
at::Tensor kernel_ready(const at::Tensor& t) {
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(3) == 1;
  for (int d = 0; d < 3; ++d) ok = ok && (t.size(d) <= 1 || t.stride(d) % 8 == 0);
  return ok ? t : t.contiguous();
}

void check_grid_limits(const Shape& s) {
  TORCH_CHECK(s.batch <= 65535 && s.heads_q <= 65535, "attention on CUDA supports batch and heads up to 65535, got ",
              s.batch, " and ", s.heads_q);
  TORCH_CHECK(s.seqlen_q < (int64_t(1) << 31) && s.seqlen_k < (int64_t(1) << 31),
              "attention on CUDA supports sequence lengths below 2^31");
}

void set_strides(const at::Tensor& t, int64_t& batch, int64_t& head, int64_t& row) {
  batch = t.stride(0);
  head = t.stride(1);
  row = t.stride(2);
}

void fill_forward(FwdParams& p, const Shape& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& out, const at::Tensor& lse, double scale) {
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  set_strides(q, p.q_batch_stride, p.q_head_stride, p.q_row_stride);
  set_strides(k, p.k_batch_stride, p.k_head_stride, p.k_row_stride);
  set_strides(v, p.v_batch_stride, p.v_head_stride, p.v_row_stride);
  set_strides(out, p.out_batch_stride, p.out_head_stride, p.out_row_stride);
  p.batch = static_cast<int>(s.batch);
  p.heads_q = static_cast<int>(s.heads_q);
  p.heads_kv = static_cast<int>(s.heads_kv);
  p.group = static_cast<int>(s.group());
  p.seqlen_q = static_cast<int>(s.seqlen_q);
  p.seqlen_k = static_cast<int>(s.seqlen_k);
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
}

// Calls f.template operator()<T, kHeadDim>() for the tensor's dtype and head dim.
template <typename F>
void dispatch_dtype_head_dim(at::ScalarType dtype, int64_t head_dim, F&& f) {
  auto by_dim = [&](auto tag) {
    using T = decltype(tag);
    if (head_dim == 64) {
      f.template operator()<T, 64>();
    } else {
      f.template operator()<T, 128>();
    }
  };
  if (dtype == at::kHalf) {
    by_dim(at::Half{});
  } else {
    by_dim(at::BFloat16{});
  }
}

std::tuple<at::Tensor, at::Tensor> attention_fwd_cuda(const at::Tensor& q_in, const at::Tensor& k_in,
                                                      const at::Tensor& v_in, bool causal, double scale) {
  const Shape s = check_inputs(q_in, k_in, v_in, /*cuda=*/true);
  check_grid_limits(s);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = kernel_ready(q_in), k = kernel_ready(k_in), v = kernel_ready(v_in);
  at::Tensor out = at::empty_like(q_in);
  at::Tensor lse = at::empty({s.batch, s.heads_q, s.seqlen_q}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) return {out, lse};
  at::Tensor out_k = kernel_ready(out);
  FwdParams p;
  fill_forward(p, s, q, k, v, out_k, lse, scale);
  dispatch_dtype_head_dim(q.scalar_type(), s.head_dim,
                          [&]<typename T, int kD>() { run_attention_fwd<T, kD>(p, causal); });
  if (!out_k.is_same(out)) out.copy_(out_k);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cuda(const at::Tensor& grad_out_in,
                                                                  const at::Tensor& q_in, const at::Tensor& k_in,
                                                                  const at::Tensor& v_in, const at::Tensor& out_in,
                                                                  const at::Tensor& lse_in, bool causal, double scale,
                                                                  bool deterministic) {
  const Shape s = check_inputs(q_in, k_in, v_in, /*cuda=*/true);
  check_backward_inputs(s, q_in, grad_out_in, out_in, lse_in);
  check_grid_limits(s);
  const c10::cuda::CUDAGuard guard(q_in.device());
  at::Tensor grad_q = at::empty_like(q_in), grad_k = at::empty_like(k_in), grad_v = at::empty_like(v_in);
  if (s.batch == 0 || s.heads_q == 0 || s.seqlen_q == 0 || s.seqlen_k == 0) {
    grad_q.zero_();
    grad_k.zero_();
    grad_v.zero_();
    return {grad_q, grad_k, grad_v};
  }
  // grad_out may come with any strides (an expanded ones_like, a transposed view): copy if needed.
  const at::Tensor grad_out = kernel_ready(grad_out_in.stride(3) == 1 ? grad_out_in : grad_out_in.contiguous());
  const at::Tensor q = kernel_ready(q_in), k = kernel_ready(k_in), v = kernel_ready(v_in);
  const at::Tensor out = kernel_ready(out_in), lse = lse_in.contiguous();
  at::Tensor dq = kernel_ready(grad_q), dk = kernel_ready(grad_k), dv = kernel_ready(grad_v);

  BwdParams p;
  fill_forward(p, s, q, k, v, out, lse, scale);
  p.grad_out = grad_out.data_ptr();
  set_strides(grad_out, p.do_batch_stride, p.do_head_stride, p.do_row_stride);
  p.grad_q = dq.data_ptr();
  p.grad_k = dk.data_ptr();
  p.grad_v = dv.data_ptr();
  set_strides(dq, p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride);
  set_strides(dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride);
  set_strides(dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride);
  at::Tensor row_dot = at::empty({s.batch, s.heads_q, s.seqlen_q}, q.options().dtype(at::kFloat));
  p.row_dot = row_dot.data_ptr<float>();
  at::Tensor dq_accum;
  if (!deterministic) {
    // Rows padded to a multiple of 16: the kernels add whole 16 x 8 tiles (attention_bwd_kernel.cuh).
    const int64_t rows = (s.seqlen_q + 15) / 16 * 16;
    dq_accum = at::zeros({s.batch, s.heads_q, rows, s.head_dim}, q.options().dtype(at::kFloat));
    p.dq_accum = dq_accum.data_ptr<float>();
  }
  dispatch_dtype_head_dim(q.scalar_type(), s.head_dim,
                          [&]<typename T, int kD>() { run_attention_bwd<T, kD>(p, causal, deterministic); });
  if (!dq.is_same(grad_q)) grad_q.copy_(dq);
  if (!dk.is_same(grad_k)) grad_k.copy_(dk);
  if (!dv.is_same(grad_v)) grad_v.copy_(dv);
  return {grad_q, grad_k, grad_v};
}

}  // namespace
}  // namespace fuseforge::attention

TORCH_LIBRARY_IMPL(fuseforge, CUDA, m) {
  m.impl("attention_fwd", &fuseforge::attention::attention_fwd_cuda);
  m.impl("attention_bwd", &fuseforge::attention::attention_bwd_cuda);
}
