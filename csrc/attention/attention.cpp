// attention: input checks (shared with the CUDA side) and the host side of the CPU implementation:
// FlashAttention-style tiled kernels (attention_cpu_kernel.h, one build per x86 ISA level) in float32,
// float64 for float64 inputs (gradcheck); float16/bfloat16 are computed in float32.
#include "attention/attention.h"

#include <torch/library.h>

#include <limits>

#include "attention/attention_cpu.h"
#include "common/checks.h"
#include "common/cpu_isa.h"

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

std::tuple<at::Tensor, at::Tensor> attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     bool causal, double scale) {
  const Shape s = check_inputs(q, k, v, /*cuda=*/false);
  at::Tensor out = at::empty_like(q);
  // float32 LSE, float64 for float64 inputs (so gradcheck sees no float32 rounding).
  at::Tensor lse = at::empty({s.batch, s.heads_q, s.seqlen_q}, q.options().dtype(lse_type(q)));
  if (out.numel() == 0) return {out, lse};
  if (s.seqlen_k == 0) {  // nothing to attend to
    out.zero_();
    lse.fill_(-std::numeric_limits<double>::infinity());
    return {out, lse};
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
  a.shape = cpu_shape(s);
  a.causal = causal;
  a.scale = scale;
  a.dtype = ct;
  FUSEFORGE_CPU_ISA_CALL(forward, a);
  if (!out_c.is_same(out)) out.copy_(out_c);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& q,
                                                                 const at::Tensor& k, const at::Tensor& v,
                                                                 const at::Tensor& out, const at::Tensor& lse,
                                                                 bool causal, double scale, bool /*deterministic*/) {
  // Always deterministic: no atomics, and a fixed summation order for any thread count.
  const Shape s = check_inputs(q, k, v, /*cuda=*/false);
  check_backward_inputs(s, q, grad_out, out, lse);
  at::Tensor grad_q = at::empty_like(q), grad_k = at::empty_like(k), grad_v = at::empty_like(v);
  if (s.seqlen_k == 0 || s.batch == 0) {  // no keys: grad_q is zero (grad_k, grad_v are empty)
    grad_q.zero_();
    return {grad_q, grad_k, grad_v};
  }
  if (grad_k.numel() == 0) return {grad_q, grad_k, grad_v};
  if (grad_q.numel() == 0) {  // no queries: keys and values get no gradient
    grad_k.zero_();
    grad_v.zero_();
    return {grad_q, grad_k, grad_v};
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
  a.causal = causal;
  a.scale = scale;
  a.dtype = ct;
  FUSEFORGE_CPU_ISA_CALL(backward, a);
  if (!gq.is_same(grad_q)) grad_q.copy_(gq);
  if (!gk.is_same(grad_k)) grad_k.copy_(gk);
  if (!gv.is_same(grad_v)) grad_v.copy_(gv);
  return {grad_q, grad_k, grad_v};
}

}  // namespace

}  // namespace fuseforge::attention

TORCH_LIBRARY_IMPL(fuseforge, CPU, m) {
  m.impl("attention_fwd", &fuseforge::attention::attention_fwd_cpu);
  m.impl("attention_bwd", &fuseforge::attention::attention_bwd_cpu);
}
