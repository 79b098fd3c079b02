// Host-side pieces of rotary shared by the CPU and CUDA implementations: input checks, the problem
// every kernel works on, and the operator itself (written once; each device supplies its runner).
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace fuseforge::rotary {

struct Problem {
  at::Tensor q, k;          // (B, H, S, D), the last dim dense (an input whose last dim is not is copied once)
  at::Tensor inv_freq;      // (R / 2,) float32, contiguous
  at::Tensor position_ids;  // (B or 1, S), int32 or int64, any strides
  int64_t batch = 0, seq = 0, heads_q = 0, heads_k = 0, head_dim = 0, rot_half = 0;
  at::ScalarType out_dtype = at::kFloat;

  int64_t rot_dims() const { return 2 * rot_half; }
  // position_ids' stride over the batch: 0 when one row serves every batch row.
  int64_t position_stride_b() const { return position_ids.size(0) == 1 ? 0 : position_ids.stride(0); }
};

// Checks every argument (errors name it) and fills the sizes. allow_double: float64 inputs and
// outputs (CPU only).
Problem prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& inv_freq, const at::Tensor& position_ids,
                std::optional<at::ScalarType> out_dtype, bool allow_double);

// Writes the rotated q and k into q_out (B, S, Hq, D) and k_out (B, S, Hk, D), both contiguous and
// not empty; inverse rotates by -angle.
using Runner = void (*)(const Problem&, double attention_scaling, bool interleaved, bool inverse, at::Tensor& q_out,
                        at::Tensor& k_out);

template <Runner kRun, bool kAllowDouble>
std::tuple<at::Tensor, at::Tensor> rotary_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& inv_freq,
                                             const at::Tensor& position_ids, double attention_scaling, bool interleaved,
                                             bool inverse, std::optional<at::ScalarType> out_dtype) {
  const Problem p = prepare(q, k, inv_freq, position_ids, out_dtype, kAllowDouble);
  const auto options = q.options().dtype(p.out_dtype);
  at::Tensor q_out = at::empty({p.batch, p.seq, p.heads_q, p.head_dim}, options);
  at::Tensor k_out = at::empty({p.batch, p.seq, p.heads_k, p.head_dim}, options);
  if (q_out.numel() + k_out.numel() > 0) kRun(p, attention_scaling, interleaved, inverse, q_out, k_out);
  // (B, S, H, D) memory seen as (B, H, S, D): the layout the projections' outputs have.
  return {q_out.transpose(1, 2), k_out.transpose(1, 2)};
}

}  // namespace fuseforge::rotary
