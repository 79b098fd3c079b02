// Device pieces every attention kernel shares, forward and backward, mma.sync and warp-specialized:
// the shared-memory base, a block's sequence bounds, the masks and the softcap, the mma.sync tile
// products, the online softmax, and the epilogue that stages and stores rows of O (or dQ, dK, dV).
#pragma once
#include <cmath>

#include "attention/attention_kernel_traits.h"
#include "attention/attention_params.h"
#include "attention/sm80/attention_mma.cuh"
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

}  // namespace fuseforge::attention
