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

// The score transform and mask every implementation takes. Query i of a sequence sees key j when
// i + off - window_left <= j <= i + off + window_right (off = Sk - Sq: aligned bottom-right), -1
// meaning unbounded on that side; causal is folded in as window_right = 0. softcap > 0 replaces the
// score z = scale q.k by softcap * tanh(z / softcap).
struct MaskOptions {
  int64_t window_left = -1, window_right = -1;
  double softcap = 0.0;
  bool local() const { return window_left >= 0 || window_right >= 0; }
};

// Checks the window and softcap (errors name the argument) and folds causal into the window.
MaskOptions check_mask_options(bool causal, int64_t window_left, int64_t window_right, double softcap);

// Packed variable-length batches: q (total_q, Hq, D), k and v (total_k, Hk, D), cu_seqlens_q/k int32
// (B + 1,) on q's device. Checks what can be checked without reading cu_seqlens (dtype, device,
// length, ranks, max lengths) and returns the shape with batch = B and seqlen_q/k = the max lengths.
Shape check_varlen_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                          const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool cuda);

// The varlen backward's extra tensors: grad_out and out like q, lse (Hq, total_q).
void check_varlen_backward_inputs(const Shape& s, const at::Tensor& q, const at::Tensor& grad_out,
                                  const at::Tensor& out, const at::Tensor& lse);

// A (total, H, D) varlen operand as the (1, H, total, D) view the fixed-length code takes.
inline at::Tensor as_batch_of_one(const at::Tensor& t) { return t.transpose(0, 1).unsqueeze(0); }

// Head dims the CUDA kernels take: multiples of 8 (16-byte rows) up to 128, and 256 (Gemma 2). The
// kernels are built for 64, 128 and 256, and for 128 with a padded head dim: any other head dim up to
// 128 runs that one, its columns past the head dim zero in shared memory (attention_kernel_traits.h,
// kPadHeadDim). Head dims between 128 and 256 are not padded to 256 (not built).
inline bool cuda_head_dim_supported(int64_t d) { return d == 256 || (d > 0 && d <= 128 && d % 8 == 0); }
inline int cuda_kernel_head_dim(int64_t d) { return d == 64 ? 64 : d == 256 ? 256 : 128; }

}  // namespace fuseforge::attention
