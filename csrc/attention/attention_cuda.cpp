// attention CUDA implementation, host side: checks, device guard, allocation, params, the dtype and
// head-dim dispatch to the launchers (instantiations/*.cu). No host sync. Compiled by the C++
// compiler, not nvcc (CONTRIBUTING.md, Layout).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention/attention.h"
#include "attention/attention_heuristics.h"
#include "attention/attention_params.h"
#include "common/cuda_utils.h"

namespace fuseforge::attention {
namespace {

// The kernels copy rows with 16-byte cp.async: every stride of a dim with more than one element
// must be a multiple of 8 elements and the data 16-byte aligned. Dense tensors always are (the head
// dim is a multiple of 8); anything else (an odd slice) is copied once.
at::Tensor kernel_ready(const at::Tensor& t) {
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(3) == 1;
  for (int d = 0; d < 3; ++d) ok = ok && (t.size(d) <= 1 || t.stride(d) % 8 == 0);
  return ok ? t : t.contiguous();
}

void check_grid_limits(const Shape& s) {
  TORCH_CHECK(s.batch <= 65535 && s.heads_q <= 65535, "attention on CUDA supports batch and heads up to 65535, got ",
              s.batch, " and ", s.heads_q);
  // The kernels add row, offset and window bounds in 32-bit ints.
  TORCH_CHECK(s.seqlen_q < (int64_t(1) << 29) && s.seqlen_k < (int64_t(1) << 29),
              "attention on CUDA supports sequence lengths below 2^29, got ", s.seqlen_q, " and ", s.seqlen_k);
}

void set_strides(const at::Tensor& t, int64_t& batch, int64_t& head, int64_t& row) {
  batch = t.stride(0);
  head = t.stride(1);
  row = t.stride(2);
}

// q, k, v, out are (B, H, S, D) tensors (varlen: the (1, H, total, D) views), lse (B, Hq, S) or
// (Hq, total); s.batch, s.seqlen_q/k: the batch (number of sequences) and the max lengths.
void fill_forward(FwdParams& p, const Shape& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& out, const at::Tensor& lse, double scale, const MaskOptions& o) {
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.lse_head_stride = lse.stride(lse.dim() - 2);
  p.lse_batch_stride = lse.dim() == 3 ? lse.stride(0) : 0;
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
  p.rows_q = q.size(2);
  p.rows_k = k.size(2);
  p.head_dim = static_cast<int>(s.head_dim);
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  // Unbounded sides become the max lengths: as good as infinite, and no 32-bit sum overflows.
  p.window_left = static_cast<int>(o.window_left < 0 ? s.seqlen_k : std::min(o.window_left, s.seqlen_k));
  p.window_right = static_cast<int>(o.window_right < 0 ? s.seqlen_q : std::min(o.window_right, s.seqlen_q));
  if (o.softcap > 0.0) {
    p.softcap_in = static_cast<float>(scale / o.softcap);
    p.softcap_out = static_cast<float>(o.softcap / scale);
  }
}

// Varlen: batch strides 0 (the views are a batch of one), the sequences from cu_seqlens.
struct VarlenArgs {
  at::Tensor cu_q, cu_k;
  at::Tensor seq_order;  // the kernels' order of the sequences (FwdParams::seq_order)
  at::Tensor key_block_prefix;  // the backward's (BwdParams::key_block_prefix); undefined in the forward
};

// Checks cu_seqlens and writes the sequence order (and for the backward its key blocks' prefix sums),
// on the device (check_and_order_sequences_async).
VarlenArgs prepare_varlen(const Shape& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cu_seqlens_q,
                          const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool backward) {
  VarlenArgs a{cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
               at::empty({std::max<int64_t>(s.batch, 1)}, cu_seqlens_q.options()), {}};
  if (backward) a.key_block_prefix = at::empty({s.batch + 1}, cu_seqlens_q.options());
  check_and_order_sequences_async(a.cu_q.data_ptr<int>(), a.cu_k.data_ptr<int>(), static_cast<int>(s.batch), q.size(0),
                                  k.size(0), max_seqlen_q, max_seqlen_k, varlen_longest_first(),
                                  a.seq_order.data_ptr<int>(),
                                  backward ? a.key_block_prefix.data_ptr<int>() : nullptr, kBwdZeroKeyBlockRows);
  return a;
}

void set_varlen(FwdParams& p, const VarlenArgs& a) {
  p.cu_seqlens_q = a.cu_q.data_ptr<int>();
  p.cu_seqlens_k = a.cu_k.data_ptr<int>();
  p.seq_order = a.seq_order.data_ptr<int>();
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.out_batch_stride = 0;
  p.lse_batch_stride = 0;
}

// Calls f.template operator()<T, kHeadDim, kSoftcap, kPadHeadDim>() for the tensor's dtype, the
// kernel head dim (cuda_kernel_head_dim), softcap and whether the head dim is below the kernel's.
template <typename F>
void dispatch_dtype_head_dim(at::ScalarType dtype, int64_t head_dim, bool softcap, F&& f) {
  auto by_dim = [&](auto tag) {
    using T = decltype(tag);
    auto by_cap = [&]<int kD, bool kPad>() {
      if (softcap) {
        f.template operator()<T, kD, true, kPad>();
      } else {
        f.template operator()<T, kD, false, kPad>();
      }
    };
    if (head_dim == 64) {
      by_cap.template operator()<64, false>();
    } else if (head_dim == 128) {
      by_cap.template operator()<128, false>();
    } else if (head_dim == 256) {
      by_cap.template operator()<256, false>();
    } else {
      by_cap.template operator()<128, true>();
    }
  };
  if (dtype == at::kHalf) {
    by_dim(at::Half{});
  } else {
    by_dim(at::BFloat16{});
  }
}

// The forward on (B, H, S, D) views; lse preallocated. Shared by the fixed-length and varlen ops.
void forward(const Shape& s, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
             const at::Tensor& out, const at::Tensor& lse, double scale, const MaskOptions& o,
             const VarlenArgs* varlen) {
  if (out.numel() == 0) return;
  const at::Tensor q = kernel_ready(q_in), k = kernel_ready(k_in), v = kernel_ready(v_in);
  at::Tensor out_k = kernel_ready(out);
  FwdParams p;
  fill_forward(p, s, q, k, v, out_k, lse, scale, o);
  if (varlen != nullptr) set_varlen(p, *varlen);
  const at::Tensor tile_counter = at::zeros({1}, q.options().dtype(at::kInt));
  p.tile_counter = tile_counter.data_ptr<int>();
  dispatch_dtype_head_dim(q.scalar_type(), s.head_dim, o.softcap > 0.0,
                          [&]<typename T, int kD, bool kSoftcap, bool kPad>() {
                            run_attention_fwd<T, kD, kSoftcap, kPad>(p, o.local());
                          });
  if (!out_k.is_same(out)) out.copy_(out_k);
}

// The backward on (B, H, S, D) views into grad_q, grad_k, grad_v (views of the results).
void backward(const Shape& s, const at::Tensor& grad_out_in, const at::Tensor& q_in, const at::Tensor& k_in,
              const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse_in, double scale,
              const MaskOptions& o, bool deterministic, const at::Tensor& grad_q, const at::Tensor& grad_k,
              const at::Tensor& grad_v, const VarlenArgs* varlen, int64_t kv_head_split = 1) {
  // grad_out may come with any strides (an expanded ones_like, a transposed view): copy if needed.
  const at::Tensor grad_out = kernel_ready(grad_out_in.stride(3) == 1 ? grad_out_in : grad_out_in.contiguous());
  const at::Tensor q = kernel_ready(q_in), k = kernel_ready(k_in), v = kernel_ready(v_in);
  const at::Tensor out = kernel_ready(out_in), lse = lse_in.contiguous();
  at::Tensor dq = kernel_ready(grad_q), dk = kernel_ready(grad_k), dv = kernel_ready(grad_v);

  BwdParams p;
  fill_forward(p, s, q, k, v, out, lse, scale, o);
  p.kv_head_split = static_cast<int>(kv_head_split);  // s counts the split's heads, k / v the real ones
  p.grad_out = grad_out.data_ptr();
  set_strides(grad_out, p.do_batch_stride, p.do_head_stride, p.do_row_stride);
  p.grad_q = dq.data_ptr();
  p.grad_k = dk.data_ptr();
  p.grad_v = dv.data_ptr();
  set_strides(dq, p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride);
  set_strides(dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride);
  set_strides(dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride);
  at::Tensor row_dot = at::empty(lse.sizes(), q.options().dtype(at::kFloat));  // lse's layout
  p.row_dot = row_dot.data_ptr<float>();
  at::Tensor dq_accum, dq_zero_counts;
  if (!deterministic) {
    // Whole 16-row tiles (the kernels add 16 x 8 tiles or, the 80-query dk/dv kernel, 16-row units of
    // dQ^T; attention_bwd_kernel.cuh). Varlen: sequence b from row 16 (cu[b] / 16 + b)
    // (dq_accum_seq_tile0), so R = 16 (total / 16 + B + 1) rows a head.
    const int64_t rows = varlen != nullptr ? 16 * (q.size(2) / 16 + s.batch + 1) : (s.seqlen_q + 15) / 16 * 16;
    const int64_t batches = varlen != nullptr ? 1 : s.batch;
    // The kernel head dim's columns: the kernels add the zero columns past the head dim too. Zeroed
    // by the row_dot kernel, or by the dk/dv kernel ahead of its use (BwdParams::dq_zero_ahead).
    dq_accum = at::empty({batches, s.heads_q, rows, cuda_kernel_head_dim(s.head_dim)}, q.options().dtype(at::kFloat));
    p.dq_accum = dq_accum.data_ptr<float>();
    p.dq_accum_floats = dq_accum.numel();
    p.dq_accum_head_tiles = rows / 16;
    p.dq_accum_batch_tiles = varlen != nullptr ? 0 : s.heads_q * rows / 16;
    // An int a row of the dk/dv grid (kv head, batch or sequence) for the dk/dv kernel's own zeroing of
    // dq_accum (BwdParams::dq_zero_ahead); zeroed on the device by the launcher's kernels.
    dq_zero_counts = at::empty({s.heads_kv * s.batch}, q.options().dtype(at::kInt));
    p.dq_zero_counts = dq_zero_counts.data_ptr<int>();
  }
  // The row_dot kernel's view: every row of q once (varlen: one sequence of total_q rows).
  BwdParams row_dot_params = p;
  if (varlen != nullptr) {
    set_varlen(p, *varlen);
    p.key_block_prefix = varlen->key_block_prefix.data_ptr<int>();
    p.do_batch_stride = p.dq_batch_stride = p.dk_batch_stride = p.dv_batch_stride = 0;
    row_dot_params.batch = 1;
    row_dot_params.seqlen_q = static_cast<int>(q.size(2));
  }
  dispatch_dtype_head_dim(q.scalar_type(), s.head_dim, o.softcap > 0.0, [&]<typename T, int kD, bool kSoftcap, bool kPad>() {
    run_attention_bwd<T, kD, kSoftcap, kPad>(p, row_dot_params, o.local(), deterministic);
  });
  if (!dq.is_same(grad_q)) grad_q.copy_(dq);
  if (!dk.is_same(grad_k)) grad_k.copy_(dk);
  if (!dv.is_same(grad_v)) grad_v.copy_(dv);
}

std::tuple<at::Tensor, at::Tensor> attention_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      bool causal, double scale, int64_t window_left,
                                                      int64_t window_right, double softcap) {
  const Shape s = check_inputs(q, k, v, /*cuda=*/true);
  const MaskOptions o = check_mask_options(causal, window_left, window_right, softcap);
  check_grid_limits(s);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({s.batch, s.heads_q, s.seqlen_q}, q.options().dtype(at::kFloat));
  forward(s, q, k, v, out, lse, scale, o, nullptr);
  return {out, lse};
}

// Gradients that are zero or empty without running a kernel: no keys, no queries, no heads.
bool backward_is_trivial(const Shape& s, at::Tensor& grad_q, at::Tensor& grad_k, at::Tensor& grad_v) {
  if (s.batch == 0 || s.heads_q == 0 || s.seqlen_q == 0 || s.seqlen_k == 0) {
    grad_q.zero_();
    grad_k.zero_();
    grad_v.zero_();
    return true;
  }
  return false;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& q,
                                                                  const at::Tensor& k, const at::Tensor& v,
                                                                  const at::Tensor& out, const at::Tensor& lse,
                                                                  bool causal, double scale, bool deterministic,
                                                                  int64_t window_left, int64_t window_right,
                                                                  double softcap) {
  const Shape s = check_inputs(q, k, v, /*cuda=*/true);
  check_backward_inputs(s, q, grad_out, out, lse);
  const MaskOptions o = check_mask_options(causal, window_left, window_right, softcap);
  check_grid_limits(s);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor grad_q = at::empty_like(q), grad_k = at::empty_like(k), grad_v = at::empty_like(v);
  if (backward_is_trivial(s, grad_q, grad_k, grad_v)) return {grad_q, grad_k, grad_v};
  // Few dk/dv blocks with grouped-query heads (bwd_gqa_head_split): each KV head's K / V read by
  // `split` blocks of group / split query heads each; their dK / dV partials summed in float32.
  const int64_t key_block_rows = bwd_key_block_rows(s.head_dim);
  const int64_t blocks = ceil_div(s.seqlen_k, key_block_rows) * s.heads_kv * s.batch;
  const int64_t split = s.group() > 1 ? bwd_gqa_head_split(blocks, s.group(), num_sms()) : 1;
  if (split == 1) {
    backward(s, grad_out, q, k, v, out, lse, scale, o, deterministic, grad_q, grad_k, grad_v, nullptr);
    return {grad_q, grad_k, grad_v};
  }
  // K / V read in place (BwdParams::kv_head_split); dK / dV partials a split head, summed below.
  const std::vector<int64_t> split_shape{s.batch, s.heads_kv * split, s.seqlen_k, s.head_dim};
  at::Tensor grad_k_rep = at::empty(split_shape, k.options()), grad_v_rep = at::empty(split_shape, v.options());
  Shape s_split = s;
  s_split.heads_kv *= split;
  backward(s_split, grad_out, q, k, v, out, lse, scale, o, deterministic, grad_q, grad_k_rep, grad_v_rep, nullptr,
           split);
  // Both sums in one launch (head_split_sum_async), through kernel_ready as backward() takes its
  // outputs (empty_like's gradients are always kernel-ready, so no copy in practice).
  const at::Tensor dk = kernel_ready(grad_k), dv = kernel_ready(grad_v);
  HeadSplitSumParams hp;
  hp.parts[0] = grad_k_rep.data_ptr();
  hp.parts[1] = grad_v_rep.data_ptr();
  hp.grad[0] = dk.data_ptr();
  hp.grad[1] = dv.data_ptr();
  set_strides(dk, hp.batch_stride[0], hp.head_stride[0], hp.row_stride[0]);
  set_strides(dv, hp.batch_stride[1], hp.head_stride[1], hp.row_stride[1]);
  hp.batch = s.batch;
  hp.heads_kv = s.heads_kv;
  hp.seqlen = s.seqlen_k;
  hp.head_dim = s.head_dim;
  hp.split = static_cast<int>(split);
  head_split_sum_async(hp, q.scalar_type() == at::kBFloat16);
  if (!dk.is_same(grad_k)) grad_k.copy_(dk);
  if (!dv.is_same(grad_v)) grad_v.copy_(dv);
  return {grad_q, grad_k, grad_v};
}

std::tuple<at::Tensor, at::Tensor> attention_varlen_fwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                                                             const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                                             int64_t max_seqlen_k, bool causal, double scale,
                                                             int64_t window_left, int64_t window_right,
                                                             double softcap) {
  const Shape s = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, true);
  const MaskOptions o = check_mask_options(causal, window_left, window_right, softcap);
  check_grid_limits(s);
  const c10::cuda::CUDAGuard guard(q.device());
  const VarlenArgs varlen = prepare_varlen(s, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, false);
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({s.heads_q, q.size(0)}, q.options().dtype(at::kFloat));
  if (s.batch > 0) {
    forward(s, as_batch_of_one(q), as_batch_of_one(k), as_batch_of_one(v), as_batch_of_one(out), lse, scale, o,
            &varlen);
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, bool causal, double scale, bool deterministic, int64_t window_left, int64_t window_right,
    double softcap) {
  const Shape s = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, true);
  check_varlen_backward_inputs(s, q, grad_out, out, lse);
  const MaskOptions o = check_mask_options(causal, window_left, window_right, softcap);
  check_grid_limits(s);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor grad_q = at::empty_like(q), grad_k = at::empty_like(k), grad_v = at::empty_like(v);
  if (backward_is_trivial(s, grad_q, grad_k, grad_v)) return {grad_q, grad_k, grad_v};
  const VarlenArgs varlen = prepare_varlen(s, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, true);
  backward(s, as_batch_of_one(grad_out), as_batch_of_one(q), as_batch_of_one(k), as_batch_of_one(v),
           as_batch_of_one(out), lse.unsqueeze(0), scale, o, deterministic, as_batch_of_one(grad_q),
           as_batch_of_one(grad_k), as_batch_of_one(grad_v), &varlen);
  return {grad_q, grad_k, grad_v};
}

}  // namespace
}  // namespace fuseforge::attention

TORCH_LIBRARY_IMPL(fuseforge, CUDA, m) {
  m.impl("attention_fwd", &fuseforge::attention::attention_fwd_cuda);
  m.impl("attention_bwd", &fuseforge::attention::attention_bwd_cuda);
  m.impl("attention_varlen_fwd", &fuseforge::attention::attention_varlen_fwd_cuda);
  m.impl("attention_varlen_bwd", &fuseforge::attention::attention_varlen_bwd_cuda);
}
