// Host-side pieces of attention shared by the CPU and CUDA implementations: input checks and the
// shape every implementation works on.
#pragma once
#include <ATen/ATen.h>

namespace fuseforge::attention {

// q (B, Hq, Sq, D), k and v (B, Hk, Sk, D); Hk divides Hq (GQA/MQA).
struct Shape {
  int64_t batch = 0, heads_q = 0, heads_kv = 0, seqlen_q = 0, seqlen_k = 0, head_dim = 0;
  int64_t group() const { return heads_kv == 0 ? 1 : heads_q / heads_kv; }
};

// Checks q, k, v (errors name the argument): 4-D, same dtype and device, batch and head dims that
// match, Hk dividing Hq, a contiguous last dim. `cuda` adds the GPU limits (fp16/bf16, head dim).
Shape check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool cuda);

// Checks the backward's extra tensors against the forward's shape.
void check_backward_inputs(const Shape& s, const at::Tensor& q, const at::Tensor& grad_out, const at::Tensor& out,
                           const at::Tensor& lse);

// The LSE's dtype: float32, float64 for float64 inputs (CPU).
inline at::ScalarType lse_type(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Head dims the CUDA kernels are instantiated for.
inline bool cuda_head_dim_supported(int64_t d) { return d == 64 || d == 128; }

}  // namespace fuseforge::attention
