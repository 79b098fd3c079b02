// rotary CUDA implementation, host side: device guard, the vector-path decision, the kernel and its
// launch plan.
// No host sync. Compiled by the C++ compiler, not nvcc (CONTRIBUTING.md, Layout).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>
#include <string>
#include <type_traits>

#include "common/dispatch.h"
#include "common/env.h"
#include "common/vec.cuh"
#include "rotary/rotary.h"
#include "rotary/rotary_launch.h"

namespace fuseforge::rotary {
namespace {

// Every row offset the kernel forms from t's strides (all dims but the dense last one) is a
// multiple of `elements` (dims of size 1 contribute nothing).
bool strides_multiple_of(const at::Tensor& t, int64_t elements) {
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    if (t.size(d) > 1 && t.stride(d) % elements != 0) return false;
  return true;
}

// t (B, H, S, D) holds each token's heads as one dense row, tokens in order (the projections'
// (B, S, H, D) transposed): token b * S + s starts at (b * S + s) * H * D.
bool dense_token_rows(const at::Tensor& t, int64_t heads, int64_t head_dim, int64_t seq) {
  const int64_t row = heads * head_dim;
  return (heads == 1 || t.stride(1) == head_dim) && (seq == 1 || t.stride(2) == row) &&
         (t.size(0) == 1 || t.stride(0) == seq * row);
}

template <typename Tin, typename Tout>
void rotary_cuda_typed(const Problem& pr, double scaling, bool interleaved, bool inverse, at::Tensor& q_out,
                       at::Tensor& k_out) {
  RotaryParams<Tin, Tout> p{};
  p.q = pr.q.const_data_ptr<Tin>();
  p.k = pr.k.const_data_ptr<Tin>();
  p.q_out = q_out.mutable_data_ptr<Tout>();
  p.k_out = k_out.mutable_data_ptr<Tout>();
  p.inv_freq = pr.inv_freq.const_data_ptr<float>();
  p.position_ids = pr.position_ids.const_data_ptr();
  p.positions_int64 = pr.position_ids.scalar_type() == at::kLong;
  p.pos_stride_b = pr.position_stride_b();
  p.pos_stride_s = pr.position_ids.stride(1);
  p.q_stride_b = pr.q.stride(0);
  p.q_stride_h = pr.q.stride(1);
  p.q_stride_s = pr.q.stride(2);
  p.k_stride_b = pr.k.stride(0);
  p.k_stride_h = pr.k.stride(1);
  p.k_stride_s = pr.k.stride(2);
  p.tokens = pr.batch * pr.seq;
  p.seq = pr.seq;
  p.heads_q = static_cast<int>(pr.heads_q);
  p.heads_k = static_cast<int>(pr.heads_k);
  p.head_dim = static_cast<int>(pr.head_dim);
  p.rot_half = static_cast<int>(pr.rot_half);
  // Half-split chunks cover the first R / 2 dims (each with its partner); interleaved ones all R.
  constexpr int64_t kChunk = chunk_elems<Tin>();
  const int64_t rot_span = interleaved ? pr.rot_dims() : pr.rot_half;
  p.rot_chunks = static_cast<int>(ceil_div(rot_span, kChunk));
  p.chunks_per_head = p.rot_chunks + static_cast<int>(ceil_div(pr.head_dim - pr.rot_dims(), kChunk));
  p.cos_scaling = static_cast<float>(scaling);
  p.sin_scaling = inverse ? -p.cos_scaling : p.cos_scaling;
  p.dense_token_rows = dense_token_rows(pr.q, pr.heads_q, pr.head_dim, pr.seq) &&
                       dense_token_rows(pr.k, pr.heads_k, pr.head_dim, pr.seq);
  const bool vectorized = pr.head_dim % kChunk == 0 && rot_span % kChunk == 0 && is_aligned(p.q, 16) &&
                          is_aligned(p.k, 16) && is_aligned(p.q_out, 16) && is_aligned(p.k_out, 16) &&
                          strides_multiple_of(pr.q, kChunk) && strides_multiple_of(pr.k, kChunk);
  const int64_t heads = pr.heads_q + pr.heads_k;
  // Development knob (FUSEFORGE_DEV builds): FUSEFORGE_ROTARY_KERNEL=gqa|token|staged|register forces
  // a kernel where the shape allows it.
  static const std::string forced = dev_choice("FUSEFORGE_ROTARY_KERNEL", {"gqa", "token", "staged", "register"});
  LaunchPlan plan;
  if (vectorized && sizeof(Tin) == 2 && std::is_same_v<Tin, Tout> && !interleaved &&
      pr.rot_dims() == pr.head_dim && (forced.empty() || forced == "gqa"))
    plan = plan_token_gqa(pr.batch, pr.seq, pr.heads_q, pr.heads_k, p.chunks_per_head, pr.rot_half);
  if (vectorized && plan.kernel == KernelKind::kRegister && (forced.empty() || forced == "token"))
    plan = plan_token(pr.batch, pr.seq, heads, p.chunks_per_head, pr.rot_half);
  if (vectorized && plan.kernel == KernelKind::kRegister && (forced.empty() || forced == "staged"))
    plan = plan_staged(p.tokens, heads, pr.head_dim, kChunk, p.chunks_per_head, pr.rot_half, sizeof(Tin));
  if (plan.kernel == KernelKind::kRegister) {
    plan = plan_launch(p.tokens, heads, p.chunks_per_head, pr.rot_half);
    TORCH_CHECK(ceil_div(p.tokens, plan.block.z) <= INT_MAX, "q and k have too many tokens (", p.tokens,
                ") for the rotary kernel's grid");
  }
  launch_rotary<Tin, Tout>(p, plan, interleaved, vectorized);
}

void rotary_cuda(const Problem& p, double scaling, bool interleaved, bool inverse, at::Tensor& q_out,
                 at::Tensor& k_out) {
  TORCH_CHECK(p.rot_dims() <= kMaxRotaryDims, "inv_freq has ", p.rot_half, " elements: R = ", p.rot_dims(),
              " rotary dims exceed the CUDA kernel's limit of ", kMaxRotaryDims);
  TORCH_CHECK(p.heads_q + p.heads_k <= INT_MAX && p.head_dim <= INT_MAX / 2,
              "q and k are too large for the rotary kernel: sizes ", p.q.sizes(), " and ", p.k.sizes());
  const c10::cuda::CUDAGuard guard(p.q.device());
  FUSEFORGE_DISPATCH_HALF_FLOAT(p.q.scalar_type(), "rotary_cuda", [&] {
    using in_t = scalar_t;
    FUSEFORGE_DISPATCH_HALF_FLOAT(p.out_dtype, "rotary_cuda_out", [&] {
      rotary_cuda_typed<in_t, scalar_t>(p, scaling, interleaved, inverse, q_out, k_out);
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fuseforge, CUDA, m) {
  // No float64 kernels on the GPU (the error says it is CPU-only).
  m.impl("rotary", &rotary_op<rotary_cuda, false>);
}

}  // namespace fuseforge::rotary
