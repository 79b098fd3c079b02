// Attention forward (FlashAttention-2 algorithm): device body, thin __global__ shell, launcher.
// A block owns kBlockM query rows of one (batch, head): Q stays in shared memory, K/V tiles of
// kBlockN keys stream through it with cp.async, S = Q K^T and O += P V run on mma.sync m16n8k16, and
// the softmax is online in fp32 (running max m and sum l per row), so no S x S matrix exists.
#pragma once
#include <cmath>

#include "attention/attention_tile.cuh"
#include "attention/sm90/attention_wgmma.cuh"
#include "common/dispatch.h"
#include "common/launch.cuh"

namespace fuseforge::attention {

// mma.sync body (GPUs other than sm_90a): each warp owns kRowsPerWarp query rows.
template <class Tr, int kMask, bool kSoftcap, bool kVarlen>
__device__ __forceinline__ void attention_fwd_mma_body(const FwdParams& p) {
  using T = typename Tr::T;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kMT = Tr::kMTiles, kD = Tr::kHeadDim;
  const int head_dim = valid_head_dim<Tr>(p);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const QueryBlock<T, kBlockM, kBlockN, kMask, kVarlen> blk(p);
  if (blk.rows_q <= 0) return;  // past its sequence (varlen)
  const int m0 = blk.m0, rows_q = blk.rows_q, offset = blk.offset, seqlen_k = blk.seqlen_k, n_begin = blk.n_begin,
            n_end = blk.n_end;
  const T *q = blk.q, *k = blk.k, *v = blk.v;

  unsigned char* smem = attention_smem;
  const uint32_t sQ = smem_addr(smem);
  const uint32_t sK = sQ + Tr::kTileQBytes;
  const uint32_t sV = sK + Tr::kTileKVBytes;

  load_tile_async<kBlockM, kD, Tr::kThreads>(sQ, q, p.q_row_stride, rows_q, head_dim, tid);
  if (n_begin < n_end) {
    const int n0 = n_begin * kBlockN;
    load_tile_async<kBlockN, kD, Tr::kThreads>(sK, k + n0 * p.k_row_stride, p.k_row_stride, seqlen_k - n0, head_dim, tid);
  }
  cp_async_commit();

  float o[kMT][kD / 8][4];
  float row_max[kMT][2], row_sum[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][dt][e] = 0.f;
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }
  const int warp_row0 = warp * Tr::kRowsPerWarp;
  const float scale_log2 = p.scale_log2;

  for (int nb = n_begin; nb < n_end; ++nb) {
    const int n0 = nb * kBlockN;
    cp_async_wait<0>();
    __syncthreads();  // K[nb] (and Q) landed; every warp is done with V[nb - 1]
    load_tile_async<kBlockN, kD, Tr::kThreads>(sV, v + n0 * p.v_row_stride, p.v_row_stride, seqlen_k - n0, head_dim, tid);
    cp_async_commit();

    float s[kMT][kBlockN / 8][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kBlockN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
    warp_gemm_abt<T, kD, kMT, kBlockN>(s, sQ, warp_row0, sK, lane);
    apply_softcap<kSoftcap>(reinterpret_cast<float(&)[kMT * kBlockN / 2]>(s), p);

    if (tile_needs_mask<kMask, kBlockM, kBlockN>(m0, n0, seqlen_k, offset, p))
      apply_mask<kMask, kMT, kBlockN>(s, m0 + warp_row0, n0, seqlen_k, offset, p, lane);

    online_softmax<kMT, kBlockN, kD>(s, o, row_max, row_sum, scale_log2);

    cp_async_wait<0>();
    __syncthreads();  // V[nb] landed; every warp is done with K[nb]
    if (nb + 1 < n_end) {
      load_tile_async<kBlockN, kD, Tr::kThreads>(sK, k + (n0 + kBlockN) * p.k_row_stride, p.k_row_stride,
                                                 seqlen_k - n0 - kBlockN, head_dim, tid);
    }
    cp_async_commit();
    warp_gemm_pb<T, kD, kMT, kBlockN>(o, s, sV, lane);
  }

  // Epilogue: O / l, and lse = max * scale + ln(l) (-inf and a zero row where no key was seen).
  float inv_sum[kMT][2];
  finish_rows<kMT>(row_max, row_sum, inv_sum, p.lse + blk.lse_row0, m0 + warp_row0, blk.seqlen_q, p, lane);
  cp_async_wait<0>();
  __syncthreads();  // every thread's Q copies landed (when no key tile ran, nothing else waited for them)
  // Each warp reads only its own rows of sQ, so it may reuse them to stage its output.
  T* out = blk.template rows<T>(p.out, p.out_batch_stride, p.out_head_stride, p.out_row_stride, p);
  store_rows<T, kD, kMT>(o, inv_sum, smem, warp_row0, out, p.out_row_stride, rows_q, head_dim, lane);
}

#if FUSEFORGE_ATTENTION_WGMMA
// Key-tile / head-dim pairs of the wgmma forward bodies (cp.async and warp-specialized): wgmma N = the
// head dim (256: two n128 products), 128-key tiles, 64 at head dim 256 (shared memory).
template <class Tr>
constexpr bool wgmma_fwd_tile_supported() {
  return ((Tr::kHeadDim == 64 || Tr::kHeadDim == 128) && Tr::kBlockN == 128) ||
         (Tr::kHeadDim == 256 && Tr::kBlockN == 64);
}

// wgmma body (sm_90a): warpgroup g owns query rows [64 g, 64 g + 64) of the block, so each warp holds
// the same 16 rows as in the mma.sync body with kMTiles = 1. S = Q K^T (both K-major in shared
// memory), then O += P V with P from registers and V MN-major. K/V tiles are double-buffered: the next
// tile's cp.async runs under this tile's products and softmax.
template <class Tr, int kMask, bool kSoftcap, bool kVarlen>
__device__ __forceinline__ void attention_fwd_wgmma_body(const FwdParams& p) {
  using T = typename Tr::T;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kD = Tr::kHeadDim;
  const int head_dim = valid_head_dim<Tr>(p);
  static_assert(kBlockM == 128 && Tr::kNWarps == 8, "2 warpgroups of 64 rows");
  static_assert(wgmma_fwd_tile_supported<Tr>(), "a key-tile / head-dim pair the wgmma forward bodies take");
  using QTile = PanelTile<kBlockM>;
  using KVTile = PanelTile<kBlockN>;
  const int tid = threadIdx.x, lane = tid & 31, warp = uniform_warp_index(), wg = warp >> 2;
  const QueryBlock<T, kBlockM, kBlockN, kMask, kVarlen> blk(p);
  if (blk.rows_q <= 0) return;  // past its sequence (varlen)
  const int m0 = blk.m0, rows_q = blk.rows_q, offset = blk.offset, seqlen_k = blk.seqlen_k, n_begin = blk.n_begin,
            n_end = blk.n_end;
  const T *q = blk.q, *k = blk.k, *v = blk.v;

  const uint32_t sQ = attention_smem_base();
  unsigned char* smem = attention_smem + (sQ - smem_addr(attention_smem));
  const uint32_t sKV0 = sQ + Tr::kTileQBytes;  // stage s: K at sKV0 + 2 s tileKV, V after it
  auto load_kv = [&](int nb) {
    const int n0 = nb * kBlockN;
    const uint32_t sK = sKV0 + (nb & 1) * 2 * Tr::kTileKVBytes;
    load_tile_async<kBlockN, kD, Tr::kThreads, T, KVTile>(sK, k + n0 * p.k_row_stride, p.k_row_stride,
                                                          seqlen_k - n0, head_dim, tid);
    load_tile_async<kBlockN, kD, Tr::kThreads, T, KVTile>(sK + Tr::kTileKVBytes, v + n0 * p.v_row_stride,
                                                          p.v_row_stride, seqlen_k - n0, head_dim, tid);
  };
  load_tile_async<kBlockM, kD, Tr::kThreads, T, QTile>(sQ, q, p.q_row_stride, rows_q, head_dim, tid);
  if (n_begin < n_end) load_kv(n_begin);
  cp_async_commit();

  float o[kD / 2];
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) o[i] = 0.f;
  float row_max[1][2] = {{-INFINITY, -INFINITY}}, row_sum[1][2] = {{0.f, 0.f}};
  const int warp_row0 = warp * 16;
  const uint32_t wg_rows = wg * 64 * 128;  // byte offset of the warpgroup's first row in a Q panel
  const float scale_log2 = p.scale_log2;
  auto& o3 = reinterpret_cast<float(&)[1][kD / 8][4]>(o);

  for (int nb = n_begin; nb < n_end; ++nb) {
    const int n0 = nb * kBlockN;
    cp_async_wait<0>();
    fence_proxy_async_shared();  // this thread's cp.async writes, visible to wgmma's reads
    __syncthreads();             // K/V[nb] (and Q) landed; both warpgroups are done with K/V[nb - 1]
    if (nb + 1 < n_end) load_kv(nb + 1);
    cp_async_commit();
    const uint32_t sK = sKV0 + (nb & 1) * 2 * Tr::kTileKVBytes;
    const uint32_t sV = sK + Tr::kTileKVBytes;

    float s[kBlockN / 2];
#pragma unroll
    for (int i = 0; i < kBlockN / 2; ++i) s[i] = 0.f;
    wgmma_fence();
    wgmma_ss_k_major<T, kBlockN, kD / 16>(s, sQ + wg_rows, QTile::kPanelBytes, sK, KVTile::kPanelBytes);
    wgmma_wait<0>();
    wgmma_fence_operands(s);
    apply_softcap<kSoftcap>(s, p);
    auto& s3 = reinterpret_cast<float(&)[1][kBlockN / 8][4]>(s);

    if (tile_needs_mask<kMask, kBlockM, kBlockN>(m0, n0, seqlen_k, offset, p))
      apply_mask<kMask, 1, kBlockN>(s3, m0 + warp_row0, n0, seqlen_k, offset, p, lane);

    online_softmax<1, kBlockN, kD>(s3, o3, row_max, row_sum, scale_log2);

    // O += P V: P as A fragments (k = 16 keys a step), V MN-major (rows = keys).
    uint32_t pa[kBlockN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) c_to_a_fragment<T>(s3[0][2 * kk], s3[0][2 * kk + 1], pa[kk]);
    wgmma_rs_mn_major<T, kD, kBlockN / 16>(o, pa, sV, KVTile::kPanelBytes);
    wgmma_wait<0>();
    wgmma_fence_operands(o);
  }

  // Epilogue: O / l, and lse = max * scale + ln(l) (-inf and a zero row where no key was seen).
  float inv_sum[1][2];
  finish_rows<1>(row_max, row_sum, inv_sum, p.lse + blk.lse_row0, m0 + warp_row0, blk.seqlen_q, p, lane);
  cp_async_wait<0>();
  __syncthreads();  // both warpgroups are done reading sQ; staging rows overlap the other warpgroup's
  T* out = blk.template rows<T>(p.out, p.out_batch_stride, p.out_head_stride, p.out_row_stride, p);
  store_rows<T, kD, 1>(o3, inv_sum, smem, warp_row0, out, p.out_row_stride, rows_q, head_dim, lane);
}
#endif  // FUSEFORGE_ATTENTION_WGMMA

template <class Tr, int kMask, bool kSoftcap, bool kVarlen>
__global__ void __launch_bounds__(Tr::kThreads) attention_fwd_kernel(const __grid_constant__ FwdParams params) {
#if FUSEFORGE_ATTENTION_WGMMA
  attention_fwd_wgmma_body<Tr, kMask, kSoftcap, kVarlen>(params);
#else
  attention_fwd_mma_body<Tr, kMask, kSoftcap, kVarlen>(params);
#endif
}

// Calls f.template operator()<kMask, kVarlen>() for the params' mask mode (a local mask whose left
// bound reaches past every key is kRightBound) and layout.
template <typename F>
void dispatch_mask_varlen(const FwdParams& params, bool local, F&& f) {
  auto by_varlen = [&]<int kMask>() {
    FUSEFORGE_BOOL_SWITCH(params.cu_seqlens_q != nullptr, kVarlen, [&] { f.template operator()<kMask, kVarlen>(); });
  };
  if (!local) {
    by_varlen.template operator()<kNoMask>();
  } else if (params.window_left >= params.seqlen_k) {
    by_varlen.template operator()<kRightBound>();
  } else {
    by_varlen.template operator()<kWindow>();
  }
}

}  // namespace fuseforge::attention
