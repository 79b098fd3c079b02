// The backward's tile shapes for each (element type, head dim) and the launcher template that the
// generated files in instantiations/ instantiate (attention_fwd_launch.cuh says how).
#pragma once
#include <type_traits>

#include "attention/attention_fwd_launch.cuh"
#include "attention/sm90/attention_bwd_warpspec.cuh"

namespace fuseforge::attention {

// Backward dk/dv: 128 keys a block, 8 warps of 16 keys (two warpgroups of 64 on sm_90a), query tiles
// of 64 for D = 128 and 128 for D = 64 (twice the products a tile for the same softmax, barrier and
// atomic overhead; dQ's 64 x 64 blocks then split the rows instead of the keys). Deterministic dq:
// 64 query rows a block, 4 warps of 16 rows, key tiles of 64.
// Head dim 256: 64-key blocks, 64-query tiles, the two warpgroups on the same keys with 128 output
// columns each (BwdTraits::kSplitCols); K, V, 2 stages of Q and dO and 2 dS^T tiles take 210 KB.
template <typename T, int kHeadDim, bool kPadHeadDim>
struct BwdConfig {
  using DkdvTraits = BwdTraits<T, kHeadDim, kHeadDim == 64 ? 128 : 64, bwd_key_block_rows(kHeadDim), 8, kPadHeadDim>;
  // Deterministic dq at head dim 256: 32-key tiles (dQ is 128 floats a thread; S, dP of 64 keys spilled
  // 320 bytes).
  using DqTraits = FwdTraits<T, kHeadDim, 64, kHeadDim == 256 ? 32 : 64, 4, kPadHeadDim>;
  // Head dim 128 without a softcap (atomic path, fixed length or packed): 80-query tiles with dQ^T
  // (BwdTraits::kTransposedDq) where bwd_query_rows_d128 picks them.
  template <bool kSoftcap>
  using FullTraits = std::conditional_t<kHeadDim == 128 && !kPadHeadDim && !kSoftcap,
                                        BwdTraits<T, 128, 80, 128, 8, false>, DkdvTraits>;
};

template <typename T, int kHeadDim, bool kSoftcap, bool kPadHeadDim>
void run_attention_bwd(const BwdParams& params, const BwdParams& row_dot_params, bool local, bool deterministic) {
  using C = BwdConfig<typename CudaElement<T>::type, kHeadDim, kPadHeadDim>;
  launch_attention_bwd<typename C::DkdvTraits, typename C::DqTraits, typename C::template FullTraits<kSoftcap>,
                       kSoftcap>(params, row_dot_params, local, deterministic);
}

}  // namespace fuseforge::attention
