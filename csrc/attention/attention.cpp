// attention: input checks and the CPU implementation (the reference the CUDA kernels must match;
// float64 serves gradcheck). The CPU path computes one batch element at a time with ATen matmuls in
// float32 (float64 for float64 inputs): memory O(Hq * Sq * Sk) per batch element, fine for CI sizes.
#include "attention/attention.h"

#include <torch/library.h>

#include <limits>

#include "common/checks.h"

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
    TORCH_CHECK(cuda_head_dim_supported(s.head_dim), "attention on CUDA supports head dims 64 and 128, got ",
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

namespace {

at::ScalarType compute_type(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Scores of one batch element, (Hq, Sq, Sk), with the causal mask (bottom-right aligned: query i
// sees key j when j <= i + Sk - Sq) applied as -inf; k expanded over the query heads of each group.
at::Tensor masked_scores(const at::Tensor& q, const at::Tensor& k, bool causal, double scale) {
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)).mul_(scale);
  if (causal) {
    const int64_t sq = q.size(-2), sk = k.size(-2);
    auto opts = at::TensorOptions().dtype(at::kLong);
    at::Tensor rows = at::arange(sq, opts).unsqueeze(1);
    at::Tensor cols = at::arange(sk, opts).unsqueeze(0);
    s.masked_fill_(cols > rows + (sk - sq), -std::numeric_limits<double>::infinity());
  }
  return s;
}

// exp(s - lse) with rows whose lse is -inf (nothing to attend to) all zero instead of NaN.
at::Tensor probabilities(const at::Tensor& s, const at::Tensor& lse) {
  at::Tensor finite_lse = at::where(at::isinf(lse), at::zeros_like(lse), lse);
  return at::exp(s - finite_lse.unsqueeze(-1));
}

at::Tensor expand_kv(const at::Tensor& t, int64_t group) {
  return group == 1 ? t : t.repeat_interleave(group, /*dim=*/0);
}

std::tuple<at::Tensor, at::Tensor> attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     bool causal, double scale) {
  const Shape s = check_inputs(q, k, v, /*cuda=*/false);
  at::Tensor out = at::empty_like(q);
  // float32 LSE, float64 for float64 inputs (so gradcheck sees no float32 rounding).
  at::Tensor lse = at::empty({s.batch, s.heads_q, s.seqlen_q}, q.options().dtype(lse_type(q)));
  const auto ct = compute_type(q);
  for (int64_t b = 0; b < s.batch; ++b) {
    at::Tensor qb = q[b].to(ct), kb = expand_kv(k[b].to(ct), s.group()), vb = expand_kv(v[b].to(ct), s.group());
    at::Tensor sc = masked_scores(qb, kb, causal, scale);
    at::Tensor lse_b = s.seqlen_k == 0 ? at::full({s.heads_q, s.seqlen_q}, -std::numeric_limits<double>::infinity(),
                                                  qb.options())
                                       : at::logsumexp(sc, -1);
    out[b].copy_(at::matmul(probabilities(sc, lse_b), vb));
    lse[b].copy_(lse_b);
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& q,
                                                                 const at::Tensor& k, const at::Tensor& v,
                                                                 const at::Tensor& out, const at::Tensor& lse,
                                                                 bool causal, double scale, bool /*deterministic*/) {
  const Shape s = check_inputs(q, k, v, /*cuda=*/false);
  check_backward_inputs(s, q, grad_out, out, lse);
  at::Tensor grad_q = at::empty_like(q), grad_k = at::empty_like(k), grad_v = at::empty_like(v);
  const auto ct = compute_type(q);
  const int64_t g = s.group();
  for (int64_t b = 0; b < s.batch; ++b) {
    at::Tensor qb = q[b].to(ct), kb = expand_kv(k[b].to(ct), g), vb = expand_kv(v[b].to(ct), g);
    at::Tensor dob = grad_out[b].to(ct), ob = out[b].to(ct);
    at::Tensor p = probabilities(masked_scores(qb, kb, causal, scale), lse[b].to(ct));
    at::Tensor dp = at::matmul(dob, vb.transpose(-2, -1));
    at::Tensor row_dot = (dob * ob).sum(-1, /*keepdim=*/true);  // D_i = sum_d dO * O = sum_j P dP
    at::Tensor ds = p * (dp - row_dot);
    grad_q[b].copy_(at::matmul(ds, kb).mul_(scale));
    at::Tensor dk = at::matmul(ds.transpose(-2, -1), qb).mul_(scale);
    at::Tensor dv = at::matmul(p.transpose(-2, -1), dob);
    // GQA: the key/value gradient sums over the query heads of its group.
    grad_k[b].copy_(dk.view({s.heads_kv, g, s.seqlen_k, s.head_dim}).sum(1));
    grad_v[b].copy_(dv.view({s.heads_kv, g, s.seqlen_k, s.head_dim}).sum(1));
  }
  return {grad_q, grad_k, grad_v};
}

}  // namespace

}  // namespace fuseforge::attention

TORCH_LIBRARY_IMPL(fuseforge, CPU, m) {
  m.impl("attention_fwd", &fuseforge::attention::attention_fwd_cpu);
  m.impl("attention_bwd", &fuseforge::attention::attention_bwd_cpu);
}
