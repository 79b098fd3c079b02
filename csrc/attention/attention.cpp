// attention: input checks (shared with the CUDA side) and the host side of the CPU implementation:
// FlashAttention-style tiled kernels (attention_cpu_kernel.h, one build per x86 ISA level) in float32,
// float64 for float64 inputs (gradcheck); float16/bfloat16 are computed in float32.
#include "attention/attention.h"

#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "attention/cpu/attention_cpu.h"
#include "common/checks.h"
#include "common/cpu_isa.h"
#include "common/not_differentiable.h"

namespace fuseforge::attention {

Shape check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool cuda) {
  TORCH_CHECK(q.dim() == 4, "q must be 4-D (batch, heads_q, seqlen_q, head_dim), got shape ", q.sizes());
  TORCH_CHECK(k.dim() == 4, "k must be 4-D (batch, heads_kv, seqlen_k, head_dim), got shape ", k.sizes());
  TORCH_CHECK(v.dim() == 4, "v must be 4-D (batch, heads_kv, seqlen_k, head_dim), got shape ", v.sizes());
  check_same_device(q, "q", k, "k");
  check_same_device(q, "q", v, "v");
  check_dtype_supported(q, "q", /*allow_double=*/!cuda);
  check_same_dtype(q, "q", k, "k");
  check_same_dtype(q, "q", v, "v");
  if (cuda) {
    TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
                "attention on CUDA takes float16 or bfloat16 q, k, v, got ", q.scalar_type());
  }
  Shape s;
  s.batch = q.size(0);
  s.heads_q = q.size(1);
  s.seqlen_q = q.size(2);
  s.head_dim = q.size(3);
  s.heads_kv = k.size(1);
  s.seqlen_k = k.size(2);
  TORCH_CHECK(k.size(0) == s.batch && v.size(0) == s.batch, "k and v must have the batch size of q (", s.batch,
              "), got k ", k.sizes(), " and v ", v.sizes());
  TORCH_CHECK(k.size(3) == s.head_dim, "k must have the head dim of q (", s.head_dim, "), got k ", k.sizes());
  TORCH_CHECK(v.size(3) == s.head_dim, "v must have the head dim of q (", s.head_dim, "), got v ", v.sizes(),
              " (a different value head dim is not supported)");
  TORCH_CHECK(v.size(1) == s.heads_kv && v.size(2) == s.seqlen_k, "v must have the heads and sequence length of k ",
              k.sizes(), ", got v ", v.sizes());
  TORCH_CHECK(s.heads_kv > 0 || s.heads_q == 0, "k must have at least one head when q has heads, got k ", k.sizes());
  TORCH_CHECK(s.heads_kv == 0 || s.heads_q % s.heads_kv == 0, "the heads of q (", s.heads_q,
              ") must be a multiple of the heads of k and v (", s.heads_kv, ") for grouped-query attention");
  TORCH_CHECK(s.head_dim > 0, "q, k, v must have a positive head dim, got ", s.head_dim);
  if (cuda) {
    TORCH_CHECK(cuda_head_dim_supported(s.head_dim),
                "attention on CUDA supports head dims that are multiples of 8 up to 128 (e.g. 64, 96, 128) and 256, got ",
                s.head_dim);
  }
  TORCH_CHECK(q.stride(3) == 1 || q.size(3) == 1, "q must have a contiguous last dim (stride 1), got strides ",
              q.strides());
  TORCH_CHECK(k.stride(3) == 1 || k.size(3) == 1, "k must have a contiguous last dim (stride 1), got strides ",
              k.strides());
  TORCH_CHECK(v.stride(3) == 1 || v.size(3) == 1, "v must have a contiguous last dim (stride 1), got strides ",
              v.strides());
  return s;
}

void check_backward_inputs(const Shape& s, const at::Tensor& q, const at::Tensor& grad_out, const at::Tensor& out,
                           const at::Tensor& lse) {
  check_same_device(q, "q", grad_out, "grad_out");
  check_same_device(q, "q", out, "out");
  check_same_device(q, "q", lse, "lse");
  check_same_dtype(q, "q", grad_out, "grad_out");
  check_same_dtype(q, "q", out, "out");
  check_same_shape(q, "q", grad_out, "grad_out");
  check_same_shape(q, "q", out, "out");
  TORCH_CHECK(lse.scalar_type() == lse_type(q), "lse must be ", lse_type(q), " (as attention_fwd returns it), got ",
              lse.scalar_type());
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == s.batch && lse.size(1) == s.heads_q && lse.size(2) == s.seqlen_q,
              "lse must have shape (", s.batch, ", ", s.heads_q, ", ", s.seqlen_q, "), got ", lse.sizes());
}

void check_varlen_backward_inputs(const Shape& s, const at::Tensor& q, const at::Tensor& grad_out,
                                  const at::Tensor& out, const at::Tensor& lse) {
  check_same_device(q, "q", grad_out, "grad_out");
  check_same_device(q, "q", out, "out");
  check_same_device(q, "q", lse, "lse");
  check_same_dtype(q, "q", grad_out, "grad_out");
  check_same_dtype(q, "q", out, "out");
  check_same_shape(q, "q", grad_out, "grad_out");
  check_same_shape(q, "q", out, "out");
  TORCH_CHECK(lse.scalar_type() == lse_type(q), "lse must be ", lse_type(q),
              " (as attention_varlen_fwd returns it), got ", lse.scalar_type());
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == s.heads_q && lse.size(1) == q.size(0), "lse must have shape (",
              s.heads_q, ", ", q.size(0), "), got ", lse.sizes());
}

MaskOptions check_mask_options(bool causal, int64_t window_left, int64_t window_right, double softcap) {
  TORCH_CHECK(window_left >= -1, "window_left must be >= 0 (or -1 for no bound on the left), got ", window_left);
  TORCH_CHECK(window_right >= -1, "window_right must be >= 0 (or -1 for no bound on the right), got ", window_right);
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0.0,
              "softcap must be a positive number (or 0 for none), got ", softcap);
  MaskOptions o;
  o.window_left = window_left;
  o.window_right = causal ? 0 : window_right;
  o.softcap = softcap;
  return o;
}

namespace {
void check_cu_seqlens_meta(const at::Tensor& cu, const char* name, const at::Tensor& q) {
  TORCH_CHECK(cu.scalar_type() == at::kInt, name, " must be an int32 tensor (cumulative sequence lengths), got ",
              cu.scalar_type());
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1, name, " must be 1-D with (number of sequences + 1) entries, got shape ",
              cu.sizes());
  check_same_device(q, "q", cu, name);
}
}  // namespace

Shape check_varlen_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                          const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool cuda) {
  TORCH_CHECK(q.dim() == 3, "q must be 3-D (total_q, heads_q, head_dim) for varlen attention, got shape ", q.sizes());
  TORCH_CHECK(k.dim() == 3, "k must be 3-D (total_k, heads_kv, head_dim) for varlen attention, got shape ", k.sizes());
  TORCH_CHECK(v.dim() == 3, "v must be 3-D (total_k, heads_kv, head_dim) for varlen attention, got shape ", v.sizes());
  check_cu_seqlens_meta(cu_seqlens_q, "cu_seqlens_q", q);
  check_cu_seqlens_meta(cu_seqlens_k, "cu_seqlens_k", q);
  TORCH_CHECK(cu_seqlens_q.size(0) == cu_seqlens_k.size(0),
              "cu_seqlens_k must have as many entries as cu_seqlens_q (", cu_seqlens_q.size(0), "), got ",
              cu_seqlens_k.size(0));
  TORCH_CHECK(max_seqlen_q >= 0, "max_seqlen_q must be >= 0, got ", max_seqlen_q);
  TORCH_CHECK(max_seqlen_k >= 0, "max_seqlen_k must be >= 0, got ", max_seqlen_k);
  Shape s = check_inputs(as_batch_of_one(q), as_batch_of_one(k), as_batch_of_one(v), cuda);
  s.batch = cu_seqlens_q.size(0) - 1;
  s.seqlen_q = max_seqlen_q;
  s.seqlen_k = max_seqlen_k;
  return s;
}

namespace {

// The kernels' math type: float64 stays float64; float32, float16 and bfloat16 compute in float32
// (the half types are converted to float32 tensors first: attention is compute-bound, the copies are
// O(S D) against O(S^2 D) work).
at::ScalarType compute_type(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// t in the math type with a contiguous last dim, as the kernels read it (grad_out may arrive with any
// strides, e.g. expanded from a scalar under torch.compile; q, k, v are checked to have one).
at::Tensor as_compute(const at::Tensor& t, at::ScalarType ct) {
  at::Tensor r = t.scalar_type() == ct ? t : t.to(ct);
  return r.size(3) == 1 || r.stride(3) == 1 ? r : r.contiguous();
}

CpuOperand operand(const at::Tensor& t) { return {t.const_data_ptr(), t.stride(0), t.stride(1), t.stride(2)}; }
CpuOutput output(at::Tensor& t) { return {t.mutable_data_ptr(), t.stride(0), t.stride(1), t.stride(2)}; }

CpuShape cpu_shape(const Shape& s) {
  return {s.batch, s.heads_q, s.heads_kv, s.seqlen_q, s.seqlen_k, s.head_dim};
}

// Forward of one fixed-length problem into out and lse (views of the caller's tensors: a varlen
// sequence is a strided (1, H, S, D) slice of the packed batch).
void forward_into(const Shape& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor out,
                  at::Tensor lse, const MaskOptions& o, double scale) {
  if (out.numel() == 0) return;
  if (s.seqlen_k == 0) {  // nothing to attend to
    out.zero_();
    lse.fill_(-std::numeric_limits<double>::infinity());
    return;
  }
  const auto ct = compute_type(q);
  const at::Tensor qc = as_compute(q, ct), kc = as_compute(k, ct), vc = as_compute(v, ct);
  at::Tensor out_c = out.scalar_type() == ct ? out : at::empty_like(qc);
  CpuForwardArgs a;
  a.q = operand(qc);
  a.k = operand(kc);
  a.v = operand(vc);
  a.out = output(out_c);
  a.lse = lse.mutable_data_ptr();
  a.lse_sb = lse.stride(0);
  a.lse_sh = lse.stride(1);
  a.lse_ss = lse.stride(2);
  a.shape = cpu_shape(s);
  a.window_left = o.window_left;
  a.window_right = o.window_right;
  a.softcap = o.softcap;
  a.scale = scale;
  a.dtype = ct;
  FUSEFORGE_CPU_ISA_CALL(forward, a);
  if (!out_c.is_same(out)) out.copy_(out_c);
}

// Backward of one fixed-length problem into grad_q, grad_k, grad_v (views, as forward_into's).
// Always deterministic: no atomics, and a fixed summation order for any thread count.
void backward_into(const Shape& s, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, const MaskOptions& o, double scale,
                   at::Tensor grad_q, at::Tensor grad_k, at::Tensor grad_v) {
  if (s.seqlen_k == 0 || s.batch == 0) {  // no keys: grad_q is zero (grad_k, grad_v are empty)
    grad_q.zero_();
    return;
  }
  if (grad_k.numel() == 0) return;
  if (grad_q.numel() == 0) {  // no queries: keys and values get no gradient
    grad_k.zero_();
    grad_v.zero_();
    return;
  }
  const auto ct = compute_type(q);
  const at::Tensor qc = as_compute(q, ct), kc = as_compute(k, ct), vc = as_compute(v, ct);
  const at::Tensor gc = as_compute(grad_out, ct), oc = as_compute(out, ct);
  at::Tensor gq = grad_q.scalar_type() == ct ? grad_q : at::empty_like(qc);
  at::Tensor gk = grad_k.scalar_type() == ct ? grad_k : at::empty_like(kc);
  at::Tensor gv = grad_v.scalar_type() == ct ? grad_v : at::empty_like(vc);
  CpuBackwardArgs a;
  a.grad_out = operand(gc);
  a.q = operand(qc);
  a.k = operand(kc);
  a.v = operand(vc);
  a.out = operand(oc);
  a.lse = lse.const_data_ptr();
  a.lse_sb = lse.stride(0);
  a.lse_sh = lse.stride(1);
  a.lse_ss = lse.stride(2);
  a.grad_q = output(gq);
  a.grad_k = output(gk);
  a.grad_v = output(gv);
  a.shape = cpu_shape(s);
  a.window_left = o.window_left;
  a.window_right = o.window_right;
  a.softcap = o.softcap;
  a.scale = scale;
  a.dtype = ct;
  FUSEFORGE_CPU_ISA_CALL(backward, a);
  if (!gq.is_same(grad_q)) grad_q.copy_(gq);
  if (!gk.is_same(grad_k)) grad_k.copy_(gk);
  if (!gv.is_same(grad_v)) grad_v.copy_(gv);
}

std::tuple<at::Tensor, at::Tensor> attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     bool causal, double scale, int64_t window_left,
                                                     int64_t window_right, double softcap) {
  const Shape s = check_inputs(q, k, v, /*cuda=*/false);
  const MaskOptions o = check_mask_options(causal, window_left, window_right, softcap);
  at::Tensor out = at::empty_like(q);
  // float32 LSE, float64 for float64 inputs (so gradcheck sees no float32 rounding).
  at::Tensor lse = at::empty({s.batch, s.heads_q, s.seqlen_q}, q.options().dtype(lse_type(q)));
  forward_into(s, q, k, v, out, lse, o, scale);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& q,
                                                                 const at::Tensor& k, const at::Tensor& v,
                                                                 const at::Tensor& out, const at::Tensor& lse,
                                                                 bool causal, double scale, bool /*deterministic*/,
                                                                 int64_t window_left, int64_t window_right,
                                                                 double softcap) {
  const Shape s = check_inputs(q, k, v, /*cuda=*/false);
  check_backward_inputs(s, q, grad_out, out, lse);
  const MaskOptions o = check_mask_options(causal, window_left, window_right, softcap);
  at::Tensor grad_q = at::empty_like(q), grad_k = at::empty_like(k), grad_v = at::empty_like(v);
  backward_into(s, grad_out, q, k, v, out, lse, o, scale, grad_q, grad_k, grad_v);
  return {grad_q, grad_k, grad_v};
}

// cu_seqlens on the host (the CPU path reads it: no device to synchronize with), checked: starts at
// 0, never decreases, ends at `total`, no sequence longer than max_seqlen.
std::vector<int64_t> read_cu_seqlens(const at::Tensor& cu, const char* name, int64_t total, int64_t max_seqlen,
                                     const char* max_name) {
  const at::Tensor c = cu.contiguous();
  const int32_t* d = c.const_data_ptr<int32_t>();
  const int64_t n = c.numel();
  std::vector<int64_t> r(d, d + n);
  TORCH_CHECK(r[0] == 0, name, "[0] must be 0, got ", r[0]);
  for (int64_t b = 0; b + 1 < n; ++b) {
    TORCH_CHECK(r[b + 1] >= r[b], name, " must be non-decreasing (cumulative lengths), got ", r[b], " then ",
                r[b + 1], " at index ", b + 1);
    TORCH_CHECK(r[b + 1] - r[b] <= max_seqlen, "sequence ", b, " has ", r[b + 1] - r[b], " rows (", name,
                "), more than ", max_name, " = ", max_seqlen);
  }
  TORCH_CHECK(r[n - 1] == total, name, "[-1] must equal the packed length (", total, "), got ", r[n - 1]);
  return r;
}

// Sequence b of a packed (total, H, D) tensor as a (1, H, len, D) view.
at::Tensor sequence(const at::Tensor& t, const std::vector<int64_t>& cu, int64_t b) {
  return as_batch_of_one(t.narrow(0, cu[b], cu[b + 1] - cu[b]));
}
// Its rows of a (H, total) lse as (1, H, len).
at::Tensor sequence_lse(const at::Tensor& lse, const std::vector<int64_t>& cu, int64_t b) {
  return lse.narrow(1, cu[b], cu[b + 1] - cu[b]).unsqueeze(0);
}

Shape sequence_shape(const Shape& s, const std::vector<int64_t>& cq, const std::vector<int64_t>& ck, int64_t b) {
  Shape r = s;
  r.batch = 1;
  r.seqlen_q = cq[b + 1] - cq[b];
  r.seqlen_k = ck[b + 1] - ck[b];
  return r;
}

std::tuple<at::Tensor, at::Tensor> attention_varlen_fwd_cpu(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                                                            const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                                            int64_t max_seqlen_k, bool causal, double scale,
                                                            int64_t window_left, int64_t window_right,
                                                            double softcap) {
  const Shape s = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, false);
  const MaskOptions o = check_mask_options(causal, window_left, window_right, softcap);
  const auto cq = read_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.size(0), max_seqlen_q, "max_seqlen_q");
  const auto ck = read_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.size(0), max_seqlen_k, "max_seqlen_k");
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty({s.heads_q, q.size(0)}, q.options().dtype(lse_type(q)));
  for (int64_t b = 0; b < s.batch; ++b) {
    forward_into(sequence_shape(s, cq, ck, b), sequence(q, cq, b), sequence(k, ck, b), sequence(v, ck, b),
                 sequence(out, cq, b), sequence_lse(lse, cq, b), o, scale);
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, bool causal, double scale, bool /*deterministic*/, int64_t window_left,
    int64_t window_right, double softcap) {
  const Shape s = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, false);
  check_varlen_backward_inputs(s, q, grad_out, out, lse);
  const MaskOptions o = check_mask_options(causal, window_left, window_right, softcap);
  const auto cq = read_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.size(0), max_seqlen_q, "max_seqlen_q");
  const auto ck = read_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.size(0), max_seqlen_k, "max_seqlen_k");
  at::Tensor grad_q = at::empty_like(q), grad_k = at::empty_like(k), grad_v = at::empty_like(v);
  for (int64_t b = 0; b < s.batch; ++b) {
    backward_into(sequence_shape(s, cq, ck, b), sequence(grad_out, cq, b), sequence(q, cq, b), sequence(k, ck, b),
                  sequence(v, ck, b), sequence(out, cq, b), sequence_lse(lse, cq, b), o, scale,
                  sequence(grad_q, cq, b), sequence(grad_k, ck, b), sequence(grad_v, ck, b));
  }
  return {grad_q, grad_k, grad_v};
}

}  // namespace

}  // namespace fuseforge::attention

TORCH_LIBRARY_IMPL(fuseforge, CPU, m) {
  m.impl("attention_fwd", &fuseforge::attention::attention_fwd_cpu);
  m.impl("attention_bwd", &fuseforge::attention::attention_bwd_cpu);
  m.impl("attention_varlen_fwd", &fuseforge::attention::attention_varlen_fwd_cpu);
  m.impl("attention_varlen_bwd", &fuseforge::attention::attention_varlen_bwd_cpu);
}

// The backward ops have no backward of their own (common/not_differentiable.h).
TORCH_LIBRARY_IMPL(fuseforge, Autograd, m) {
  m.impl("attention_bwd", fuseforge::not_differentiable());
  m.impl("attention_varlen_bwd", fuseforge::not_differentiable());
}
