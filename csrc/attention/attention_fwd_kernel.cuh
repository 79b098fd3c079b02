// Attention forward (FlashAttention-2 algorithm): device body, thin __global__ shell, launcher.
// A block owns kBlockM query rows of one (batch, head): Q stays in shared memory, K/V tiles of
// kBlockN keys stream through it with cp.async, S = Q K^T and O += P V run on mma.sync m16n8k16, and
// the softmax is online in fp32 (running max m and sum l per row), so no S x S matrix exists.
#pragma once
#include <cmath>

#include "attention/attention_kernel_traits.h"
#include "attention/attention_mma.cuh"
#include "attention/attention_wgmma.cuh"
#include "attention/attention_params.h"
#include "common/dispatch.h"
#include "common/launch.cuh"

namespace fuseforge::attention {

extern __shared__ __align__(128) unsigned char attention_smem[];
// The shared-space address of attention_smem rounded up to 1024 bytes, where the kernels' tiles start
// (the 128-byte swizzle repeats every 1024 bytes; the launches add 1 KB for this).
__device__ __forceinline__ uint32_t attention_smem_base() { return (smem_addr(attention_smem) + 1023) & ~1023u; }

// The sequence a block works on: its first query and key rows in the (B, H, S, D) view (0 unless
// varlen: sequence b is rows [cu[b], cu[b + 1]) of a batch of one) and its lengths. kVarlen is a
// template flag, not a test of cu_seqlens: lengths loaded from memory stay live in registers, and
// the fixed-length kernels had none to spare (the causal backward ran 40% slower at D = 64).
template <bool kVarlen>
struct SeqInfo {
  int q_row0, k_row0, seqlen_q, seqlen_k;
  __device__ __forceinline__ SeqInfo(const FwdParams& p, int b) {
    if constexpr (kVarlen) {
      q_row0 = p.cu_seqlens_q[b];
      seqlen_q = p.cu_seqlens_q[b + 1] - q_row0;
      k_row0 = p.cu_seqlens_k[b];
      seqlen_k = p.cu_seqlens_k[b + 1] - k_row0;
    } else {
      q_row0 = k_row0 = 0;
      seqlen_q = p.seqlen_q;
      seqlen_k = p.seqlen_k;
    }
  }
};

// The head dim the loads and stores cover: the kernel's kHeadDim (a constant), or the tensors' smaller
// one in the kernels built for it (Traits::kPadHeadDim).
template <class Tr>
__device__ __forceinline__ int valid_head_dim(const FwdParams& p) {
  return Tr::kPadHeadDim ? p.head_dim : Tr::kHeadDim;
}

// Whether a kBlockM x kBlockN tile (query rows from m0, keys from n0) has masked elements: keys past
// Sk or outside some row's window [i + off - left, i + off + right].
template <int kMask, int kBlockM, int kBlockN>
__device__ __forceinline__ bool tile_needs_mask(int m0, int n0, int seqlen_k, int offset, const FwdParams& p) {
  return n0 + kBlockN > seqlen_k || (kMask != kNoMask && n0 + kBlockN - 1 > m0 + offset + p.window_right) ||
         (kMask == kWindow && n0 < m0 + kBlockM - 1 + offset - p.window_left);
}

// Softcap: s' = softcap_out * tanh(softcap_in * s) on every score of the tile (FwdParams).
template <bool kSoftcap, int kN>
__device__ __forceinline__ void apply_softcap(float (&s)[kN], const FwdParams& p) {
  if constexpr (kSoftcap) {
#pragma unroll
    for (int i = 0; i < kN; ++i) s[i] = p.softcap_out * fast_tanh(p.softcap_in * s[i]);
  }
}

// S (kMTiles x 16 rows of this warp) x kBlockN = A (rows of sA, kHeadDim wide) * B^T (kBlockN rows of sB):
// used for S = Q K^T and dP = dO V^T.
template <typename T, int kD, int kMT, int kNCols>
__device__ __forceinline__ void warp_gemm_abt(float (&acc)[kMT][kNCols / 8][4], uint32_t sA, int a_row0, uint32_t sB,
                                              int lane) {
  const SwizzledBases<kD> a_addr(sA, a_row0 + (lane & 15), lane >> 4);
  const SwizzledBases<kD> b_addr(sB, (lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);
#pragma unroll
  for (int ks = 0; ks < kD / 16; ++ks) {
    uint32_t a[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) ldmatrix_x4(a[mt], a_addr.at(mt * 16, ks));
#pragma unroll
    for (int np = 0; np < kNCols / 16; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, b_addr.at(np * 16, ks));
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        mma_16816<T>(acc[mt][2 * np], a[mt], b[0], b[1]);
        mma_16816<T>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// acc (kMTiles x 16 rows) x kHeadDim += P (registers, the S accumulator layout, kNCols keys) * sB
// (kNCols rows of kHeadDim): used for O += P V and dQ += dS K.
template <typename T, int kD, int kMT, int kNCols>
__device__ __forceinline__ void warp_gemm_pb(float (&acc)[kMT][kD / 8][4], const float (&p)[kMT][kNCols / 8][4],
                                             uint32_t sB, int lane) {
  const SwizzledBases<kD> b_addr(sB, (lane & 7) + ((lane >> 3) & 1) * 8, lane >> 4);
#pragma unroll
  for (int kk = 0; kk < kNCols / 16; ++kk) {
    uint32_t a[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) c_to_a_fragment<T>(p[mt][2 * kk], p[mt][2 * kk + 1], a[mt]);
#pragma unroll
    for (int dp = 0; dp < kD / 16; ++dp) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, b_addr.at(kk * 16, dp));
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        mma_16816<T>(acc[mt][2 * dp], a[mt], b[0], b[1]);
        mma_16816<T>(acc[mt][2 * dp + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// -inf where key col is past Sk or outside the row's window.
template <int kMask, int kMT, int kNCols>
__device__ __forceinline__ void apply_mask(float (&s)[kMT][kNCols / 8][4], int row0, int n0, int seqlen_k,
                                           int offset, const FwdParams& p, int lane) {
  const int col0 = n0 + (lane & 3) * 2;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const VisibleRange keys = keys_of_row<kMask>(row0 + mt * 16 + (lane >> 2) + hh * 8, col0, seqlen_k, offset, p);
#pragma unroll
      for (int nt = 0; nt < kNCols / 8; ++nt)
#pragma unroll
        for (int e = 2 * hh; e < 2 * hh + 2; ++e)
          if (!keys.contains(nt * 8 + (e & 1))) s[mt][nt][e] = -INFINITY;
    }
}

// A warp's kMTiles x 16 rows x kHeadDim fp32 accumulator, times row_scale[mt][half], as T into its
// rows (from warp_row0) of a swizzled shared tile: Tile::offset(row, col) is the byte offset of the
// 16-byte chunk of column col (SwizzledTile, or the TMA's PanelTile).
template <typename T, int kD, int kMT, class Tile>
__device__ __forceinline__ void stage_rows(const float (&acc)[kMT][kD / 8][4], const float (&row_scale)[kMT][2],
                                           unsigned char* sStage, int warp_row0, int lane) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = warp_row0 + mt * 16 + (lane >> 2) + h * 8;
        const int col = dt * 8 + (lane & 3) * 2;
        const uint32_t v = pack2<T>(acc[mt][dt][2 * h] * row_scale[mt][h], acc[mt][dt][2 * h + 1] * row_scale[mt][h]);
        *reinterpret_cast<uint32_t*>(sStage + Tile::offset(row, col) + (col & 7) * 2) = v;
      }
}

// Writes a warp's kMTiles x 16 rows x kHeadDim fp32 accumulator, times row_scale[mt][half], as T
// rows of a strided global matrix: staged through the warp's own rows of the swizzled smem tile
// sStage (so the global stores are 16-byte and coalesced). Rows before row_begin or at or past
// rows_valid and columns at or past cols_valid (the head dim, a multiple of 8) are skipped. Tile:
// sStage's layout (stage_rows), the one other warps' stores into it use, so warps stay in their rows.
template <typename T, int kD, int kMT, class Tile = SwizzledTile<kD>>
__device__ __forceinline__ void store_rows(const float (&acc)[kMT][kD / 8][4], const float (&row_scale)[kMT][2],
                                           unsigned char* sStage, int warp_row0, T* gmem, int64_t row_stride,
                                           int rows_valid, int cols_valid, int lane, int row_begin = 0) {
  stage_rows<T, kD, kMT, Tile>(acc, row_scale, sStage, warp_row0, lane);
  __syncwarp();
  constexpr int kChunks = kD / 8;
#pragma unroll
  for (int i = 0; i < kMT * 16 * kChunks / 32; ++i) {
    const int idx = i * 32 + lane;
    const int r = idx / kChunks, c = idx % kChunks;
    const int row = warp_row0 + r;
    if (row < rows_valid && row >= row_begin && c * 8 < cols_valid) {
      const uint4 v = *reinterpret_cast<const uint4*>(sStage + Tile::offset(row, c * 8));
      *reinterpret_cast<uint4*>(gmem + row * row_stride + c * 8) = v;
    }
  }
}

// The query tile a forward (or deterministic dq) block owns: kBlockM rows of one (batch or sequence,
// head), heaviest causal blocks first (the last query rows see the most keys), and the key tiles
// [n_begin, n_end) its rows may see. rows_q <= 0: the block is past its sequence (varlen) and exits.
// kBottom: the tiles end at the sequence's last row instead of starting at its first, so a partial
// tile is the first (with a causal mask the lightest) instead of the last (the heaviest); its rows
// [0, row_lo) lie before the sequence (m0 < 0): their Q is zeros (TMA's fill before row 0) or the
// previous sequence's rows, and they are never stored.
template <typename T, int kBlockM, int kBlockN, int kMask, bool kVarlen, bool kBottom = false>
struct QueryBlock {
  int h, b, hk, m0, rows_q, seqlen_q, seqlen_k, offset, n_begin, n_end, q_row0, k_row0;
  int row_lo = 0;      // the tile's first row inside the sequence (kBottom: > 0 for a partial first tile)
  int64_t lse_row0;    // index of the sequence's row 0 in lse (and row_dot)
  const T *q, *k, *v;  // q at the tile's first row; k, v at the sequence's first key of the head
  // One block a tile: the grid is (query blocks, heads, batch).
  __device__ __forceinline__ explicit QueryBlock(const FwdParams& p)
      : QueryBlock(p, gridDim.x - 1 - blockIdx.x, blockIdx.y, blockIdx.z) {}
  // b_: the batch slot (varlen: the sequence p.seq_order[b_]).
  __device__ __forceinline__ QueryBlock(const FwdParams& p, int m_block, int h_, int b_) {
    h = h_, b = kVarlen ? p.seq_order[b_] : b_, hk = h / p.group;
    const SeqInfo<kVarlen> seq(p, b);
    seqlen_q = seq.seqlen_q;
    seqlen_k = seq.seqlen_k;
    q_row0 = seq.q_row0;
    k_row0 = seq.k_row0;
    m0 = query_tile_first_row<int>(kBottom, seqlen_q, kBlockM, m_block);
    if constexpr (kBottom) row_lo = max(0, -m0);
    rows_q = min(kBlockM, seqlen_q - m0);
    offset = seqlen_k - seqlen_q;
    query_key_tiles<int>(kMask != kNoMask, kMask == kWindow, m0 + row_lo, rows_q - row_lo, seqlen_k, offset,
                         p.window_left, p.window_right, kBlockN, n_begin, n_end);
    lse_row0 = b * p.lse_batch_stride + h * p.lse_head_stride + seq.q_row0;
    q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride +
        static_cast<int64_t>(seq.q_row0 + m0) * p.q_row_stride;
    const int kv_head = p.kv_source_head(hk);  // the backward's head split (FwdParams::kv_head_split)
    k = static_cast<const T*>(p.k) + b * p.k_batch_stride + kv_head * p.k_head_stride +
        static_cast<int64_t>(seq.k_row0) * p.k_row_stride;
    v = static_cast<const T*>(p.v) + b * p.v_batch_stride + kv_head * p.v_head_stride +
        static_cast<int64_t>(seq.k_row0) * p.v_row_stride;
  }
  // The output-like row pointer (out, dq) of the tile's first row.
  template <typename U>
  __device__ __forceinline__ U* rows(void* base, int64_t batch_stride, int64_t head_stride, int64_t row_stride,
                                     const FwdParams& p) const {
    return static_cast<U*>(base) + b * batch_stride + h * head_stride + static_cast<int64_t>(q_row0 + m0) * row_stride;
  }
};

// One key tile of the online softmax, for a warp's kMT x 16 rows: new running max, the factor
// (correction) by which O and the running sum shrink, the running sum, and P = exp2(S * scale_log2 -
// max) in place of S. O is left alone: rescale_rows applies the correction (online_softmax does both).
// kLazy: the running max moves only when a tile's max passes it by more than 2^kLazyMaxGrowth (in
// exp2 units); otherwise P = 2^(S scale - the old max) may reach 2^kLazyMaxGrowth, which float sums and
// 16-bit P hold, and correction is 1. Returns whether any of the thread's rows moved its max.
constexpr float kLazyMaxGrowth = 8.f;
// The bound on a thread's sum of a row's P (the speculative forward tiles' test): 2^kLazyMaxGrowth.
constexpr float kLazySumBound = static_cast<float>(1u << static_cast<unsigned>(kLazyMaxGrowth));
static_assert(kLazySumBound == 256.f && static_cast<float>(static_cast<unsigned>(kLazyMaxGrowth)) == kLazyMaxGrowth,
              "a whole growth, so the bound is its power of two");
template <int kMT, int kNCols, bool kLazy = false>
__device__ __forceinline__ bool softmax_rows(float (&s)[kMT][kNCols / 8][4], float (&row_max)[kMT][2],
                                             float (&row_sum)[kMT][2], float (&correction)[kMT][2], float scale_log2) {
  bool moved = false;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float mx = row_max[mt][hh];
#pragma unroll
      for (int nt = 0; nt < kNCols / 8; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hh], s[mt][nt][2 * hh + 1]));
      mx = warp_max4(mx);
      if constexpr (kLazy) {
        // -inf - -inf is NaN: a row with every key masked so far keeps -inf (the test is false).
        const bool move = (mx - row_max[mt][hh]) * scale_log2 > kLazyMaxGrowth;
        mx = move ? mx : row_max[mt][hh];
        moved |= move;
      }
      // A row with every key masked so far keeps max -inf: subtract 0 instead (no inf - inf).
      const float max_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;
      correction[mt][hh] = fast_exp2(row_max[mt][hh] * scale_log2 - max_scaled);
      row_max[mt][hh] = mx;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < kNCols / 8; ++nt)
#pragma unroll
        for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
          s[mt][nt][e] = fast_exp2(fmaf(s[mt][nt][e], scale_log2, -max_scaled));
          sum += s[mt][nt][e];
        }
      row_sum[mt][hh] = row_sum[mt][hh] * correction[mt][hh] + sum;  // per-thread partial; reduced at the end
    }
  return moved;
}

template <int kMT, int kD>
__device__ __forceinline__ void rescale_rows(float (&o)[kMT][kD / 8][4], const float (&correction)[kMT][2]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
      for (int dt = 0; dt < kD / 8; ++dt) {
        o[mt][dt][2 * hh] *= correction[mt][hh];
        o[mt][dt][2 * hh + 1] *= correction[mt][hh];
      }
}

// Both, for a tile whose O product has finished.
template <int kMT, int kNCols, int kD>
__device__ __forceinline__ void online_softmax(float (&s)[kMT][kNCols / 8][4], float (&o)[kMT][kD / 8][4],
                                               float (&row_max)[kMT][2], float (&row_sum)[kMT][2], float scale_log2) {
  float correction[kMT][2];
  softmax_rows<kMT, kNCols>(s, row_max, row_sum, correction, scale_log2);
  rescale_rows<kMT, kD>(o, correction);
}

// Epilogue of the online softmax: inv_sum = 1 / l per row (0 where no key was seen) and, for rows
// below Sq, lse = max * scale + ln(l) (-inf where no key was seen). row0: the warp's first row in the
// sequence; lse at the sequence's row 0.
template <int kMT>
__device__ __forceinline__ void finish_rows(const float (&row_max)[kMT][2], const float (&row_sum)[kMT][2],
                                            float (&inv_sum)[kMT][2], float* lse, int row0, int seqlen_q,
                                            const FwdParams& p, int lane) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float l = warp_sum4(row_sum[mt][hh]);
      inv_sum[mt][hh] = l > 0.f ? 1.f / l : 0.f;
      const int row = row0 + mt * 16 + (lane >> 2) + hh * 8;
      if ((lane & 3) == 0 && row < seqlen_q && row >= 0) {
        lse[row] = l > 0.f ? row_max[mt][hh] * p.scale + logf(l) : -INFINITY;
      }
    }
}

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
