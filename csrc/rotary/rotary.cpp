// rotary: input checks and the CPU implementation (the reference the CUDA kernel must match;
// float64 serves gradcheck).
#include "rotary/rotary.h"
#include "rotary/rotary_cpu.h"

#include <torch/library.h>

#include "common/checks.h"
#include "common/cpu_isa.h"

namespace fuseforge::rotary {

namespace {

bool is_supported_out_dtype(at::ScalarType t, bool allow_double) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || (allow_double && t == at::kDouble);
}

// The kernels take any strides but need the last dim dense.
at::Tensor last_dim_dense(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

}  // namespace

Problem prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& inv_freq, const at::Tensor& position_ids,
                std::optional<at::ScalarType> out_dtype, bool allow_double) {
  TORCH_CHECK(q.dim() == 4, "q must have shape (B, Hq, S, D), got ", q.sizes());
  TORCH_CHECK(k.dim() == 4, "k must have shape (B, Hk, S, D), got ", k.sizes());
  check_dtype_supported(q, "q", allow_double);
  check_same_dtype(q, "q", k, "k");
  check_same_device(q, "q", k, "k");
  check_same_device(q, "q", inv_freq, "inv_freq");
  check_same_device(q, "q", position_ids, "position_ids");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.size(3) == q.size(3),
              "k must have q's batch, sequence and head dims (", q.size(0), ", Hk, ", q.size(2), ", ", q.size(3),
              "), got ", k.sizes());
  TORCH_CHECK(inv_freq.dim() == 1 && inv_freq.scalar_type() == at::kFloat && inv_freq.numel() >= 1,
              "inv_freq must be a 1-D float32 tensor of R / 2 >= 1 elements, got ", inv_freq.scalar_type(),
              " of shape ", inv_freq.sizes());
  TORCH_CHECK(2 * inv_freq.numel() <= q.size(3), "inv_freq has ", inv_freq.numel(), " elements: R = ",
              2 * inv_freq.numel(), " rotary dims exceed the head dim D = ", q.size(3), " of q and k");
  const auto pos_type = position_ids.scalar_type();
  TORCH_CHECK(pos_type == at::kLong || pos_type == at::kInt, "position_ids must be int64 or int32, got ", pos_type);
  TORCH_CHECK(position_ids.dim() == 2 && position_ids.size(1) == q.size(2) &&
                  (position_ids.size(0) == q.size(0) || position_ids.size(0) == 1),
              "position_ids must have shape (B, S) = (", q.size(0), ", ", q.size(2), ") or (1, ", q.size(2),
              "), got ", position_ids.sizes());
  Problem p;
  p.out_dtype = out_dtype.value_or(q.scalar_type());
  TORCH_CHECK(is_supported_out_dtype(p.out_dtype, allow_double), "out_dtype must be float32, float16 or bfloat16",
              allow_double ? " (or float64 on the CPU)" : " (float64 only on the CPU)", ", got ", p.out_dtype);
  p.q = last_dim_dense(q);
  p.k = last_dim_dense(k);
  p.inv_freq = inv_freq.contiguous();
  p.position_ids = position_ids;
  p.batch = q.size(0);
  p.heads_q = q.size(1);
  p.seq = q.size(2);
  p.head_dim = q.size(3);
  p.heads_k = k.size(1);
  p.rot_half = inv_freq.numel();
  return p;
}

namespace {

// The kernel is vectorized and built per CPU ISA (rotary_cpu_kernel.h, common/cpu_isa.h).
void rotary_cpu(const Problem& p, double scaling, bool interleaved, bool inverse, at::Tensor& q_out,
                at::Tensor& k_out) {
  CpuArgs a{};
  a.q = p.q.const_data_ptr();
  a.k = p.k.const_data_ptr();
  for (int d = 0; d < 3; ++d) {
    a.q_stride[d] = p.q.stride(d);
    a.k_stride[d] = p.k.stride(d);
  }
  a.inv_freq = p.inv_freq.const_data_ptr<float>();
  a.positions = p.position_ids.const_data_ptr();
  a.positions_int64 = p.position_ids.scalar_type() == at::kLong;
  a.pos_stride_b = p.position_stride_b();
  a.pos_stride_s = p.position_ids.stride(1);
  a.q_out = q_out.mutable_data_ptr();
  a.k_out = k_out.mutable_data_ptr();
  a.batch = p.batch;
  a.seq = p.seq;
  a.heads_q = p.heads_q;
  a.heads_k = p.heads_k;
  a.head_dim = p.head_dim;
  a.rot_half = p.rot_half;
  a.scaling = scaling;
  a.interleaved = interleaved;
  a.inverse = inverse;
  a.dtype = p.q.scalar_type();
  a.out_dtype = p.out_dtype;
  FUSEFORGE_CPU_ISA_CALL(rotate, a);
}

}  // namespace

TORCH_LIBRARY_IMPL(fuseforge, CPU, m) {
  // float64 is allowed on the CPU (gradcheck).
  m.impl("rotary", &rotary_op<rotary_cpu, true>);
}

}  // namespace fuseforge::rotary
