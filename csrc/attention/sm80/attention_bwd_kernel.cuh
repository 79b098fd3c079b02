// Attention backward (FlashAttention-2 algorithm): scores are recomputed tile by tile from the
// forward's LSE, never stored.
//   1. row_dot kernel: D_i = sum_d dO * O (fp32), one warp a row.
//   2. dk/dv kernel: a block owns kBlockN keys of one (batch, kv head) and loops over the query tiles
//      of every query head of the group: S^T = K Q^T, P^T = exp(S^T - lse), dV += P^T dO,
//      dP^T = V dO^T, dS^T = P^T (dP^T - D), dK += dS^T Q; the GQA sum stays in registers. On the
//      atomic path it also computes dQ += dS K for the tile and adds it to an fp32 buffer.
//   3a. atomic path: a kernel converts that buffer to dq (times scale) in q's dtype and strides.
//   3b. deterministic path: a dq kernel owns kBlockM queries and loops over key tiles (no atomics).
// The dk/dv kernel has two bodies with the same work split: on sm_90a its five products are
// warpgroup wgmma's (attention_wgmma.cuh; each warpgroup owns 64 keys); elsewhere mma.sync (each
// warp owns 16 keys). docs/design/attention.md has the H100 timings of both.
#pragma once
#include <type_traits>

#include "attention/sm80/attention_fwd_kernel.cuh"

namespace fuseforge::attention {

// LSE (natural log) -> the base-2 value the kernels subtract; rows that saw no key (-inf) and rows
// past Sq become +inf, so their P is exactly 0.
__device__ __forceinline__ float lse_to_log2(float lse) { return lse == -INFINITY ? INFINITY : lse * kLog2e; }

// row_dot[row] = sum_d dO[row, d] O[row, d] over every row of q (the varlen view: one sequence of
// total rows), kD / 8 threads a row, 16 bytes of each a thread (the kernels' operands are 16-byte
// aligned with strides in multiples of 8 elements: kernel_ready, attention_cuda.cpp; head dims are
// multiples of 8). The same grid zeroes dq_accum (p.dq_accum_floats; none when deterministic or where
// the dk/dv kernel zeroes it, BwdParams::dq_zero_ahead), so the backward has no separate fill (the
// H100/H200 profile: a warp a row with 4-byte loads plus at::zeros took 0.17 ms at 32768 tokens x 16
// heads x 128, cuDNN's fused kernel 0.14).
template <typename T, int kD>
__global__ void attention_row_dot_kernel(const __grid_constant__ BwdParams p) {
  grid_dependents_may_launch();  // the zero-first or dk/dv kernel's prologue under this grid's tail
  constexpr int kThreadsPerRow = kD / 8;
  static_assert(32 % kThreadsPerRow == 0, "a row's threads within one warp");
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = tid / kThreadsPerRow;
  const int c = static_cast<int>(tid % kThreadsPerRow);
  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads_q * p.seqlen_q;
  float sum = 0.f;
  if (row < rows && c * 8 < p.head_dim) {
    const int i = static_cast<int>(row % p.seqlen_q);
    const int64_t bh = row / p.seqlen_q;
    const int h = static_cast<int>(bh % p.heads_q), b = static_cast<int>(bh / p.heads_q);
    const uint4 d = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.grad_out) + b * p.do_batch_stride +
                                                    h * p.do_head_stride + i * p.do_row_stride + c * 8);
    const uint4 o = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.out) + b * p.out_batch_stride +
                                                    h * p.out_head_stride + i * p.out_row_stride + c * 8);
    const uint32_t dw[4] = {d.x, d.y, d.z, d.w}, ow[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 df = unpack2<T>(dw[j]), of = unpack2<T>(ow[j]);
      sum = fmaf(df.x, of.x, fmaf(df.y, of.y, sum));
    }
  }
  // Every lane takes part (a row's threads share a warp; rows past the end add zeros).
#pragma unroll
  for (int o = kThreadsPerRow / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
  if (row < rows && c == 0) p.row_dot[row] = sum;
  if (p.dq_accum != nullptr) {
    const int64_t vectors = p.dq_accum_floats / 4, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t v = tid; v < vectors; v += stride)
      reinterpret_cast<float4*>(p.dq_accum)[v] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// dq_accum (atomic path): fp32, for each (batch, head) ceil(Sq / 16) x (D / 8) tiles of 16 rows x 8
// columns, each stored in mma C-fragment order (lane l's element e at 4 l + e: row l / 4 + 8 (e / 2),
// column 2 (l % 4) + e % 2). A warp's atomic add of one tile is then 512 contiguous bytes, one
// 16-byte vector a lane, instead of 8 rows x 32 bytes in two half-used passes.
// seq_tile0: the sequence's first 16-row tile (varlen, attention_params.h), else 0: sequence b starts
// at tile cu[b] / 16 + b, which leaves each sequence ceil(len / 16) tiles before the next. (The
// 80-query kernel's dQ^T uses the same 16-row units in its own order: DqBulkAdd.)
template <bool kVarlen>
__device__ __forceinline__ int64_t dq_accum_seq_tile0(const BwdParams& p, int b) {
  if constexpr (kVarlen) return p.cu_seqlens_q[b] / 16 + b;
  return 0;
}
__device__ __forceinline__ float* dq_accum_tile(const BwdParams& p, int b, int h, int64_t seq_tile0, int row_tile,
                                                int col_tile, int kD) {
  const int64_t tile = b * p.dq_accum_batch_tiles + h * p.dq_accum_head_tiles + seq_tile0 + row_tile;
  return p.dq_accum + (tile * (kD / 8) + col_tile) * 128;
}
// The two 8-byte halves (row r's pair, row r + 8's) of the 16 bytes a lane owns in a dq_accum tile
// are swapped for lanes 8-15 and 24-31 at head dims 64 and 128. Then the warp-specialized kernel's
// 8-byte stores of dQ into shared memory (DqBulkAdd) hit each bank once a half-warp instead of twice:
// without the swap ncu counts 16.8M excess shared wavefronts in its dk/dv kernel at D128/S1024/full
// (H100; 8% of all), and D128 forward+backward times 0.8-1.7% faster with it. Every writer and
// the convert kernel follow dq_swap_halves.
template <int kD>
constexpr bool dq_swap_halves() {
  return kD == 64 || kD == 128;
}

// tile[4 lane + e] += v[e], e = 0..3 (one vector reduction on sm_90); halves swapped where
// dq_swap_halves<kD> says so.
template <int kD>
__device__ __forceinline__ void dq_accum_add(float* tile, int lane, float v0, float v1, float v2, float v3) {
  if constexpr (dq_swap_halves<kD>()) {
    const bool swap = (lane & 8) != 0;
    const float a0 = swap ? v2 : v0, a1 = swap ? v3 : v1, a2 = swap ? v0 : v2, a3 = swap ? v1 : v3;
    v0 = a0, v1 = a1, v2 = a2, v3 = a3;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(tile) + lane, make_float4(v0, v1, v2, v3));
#else
  atomicAdd(tile + 4 * lane, v0);
  atomicAdd(tile + 4 * lane + 1, v1);
  atomicAdd(tile + 4 * lane + 2, v2);
  atomicAdd(tile + 4 * lane + 3, v3);
#endif
}
// dQ's rows of one warp within a wgmma block of 64 queries x 64 columns (32 floats a thread, wgmma's
// accumulator layout): the 8 consecutive 16 x 8 tiles of dq_accum from `tile` on (4 KB, contiguous),
// added with vector atomics where `valid` (the rows start inside Sq). The warp-specialized kernel passes
// a bulk-reduce sink instead (DqBulkAdd).
template <int kD>
struct DqAtomicAdd {
  template <class Target>
  __device__ __forceinline__ void flush(const Target&) const {}  // nothing deferred (DqBulkAdd defers its hand-off)
  __device__ __forceinline__ void operator()(const float (&dq)[32], float* tile, int lane, bool valid) const {
    if (!valid) return;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      dq_accum_add<kD>(tile + 128 * j, lane, dq[4 * j], dq[4 * j + 1], dq[4 * j + 2], dq[4 * j + 3]);
  }
};

// dq = scale * dq_accum in q's dtype and strides. Thread t of a (batch or sequence, head) reads the 16
// floats from t * 16 on, a quarter of one 16 x 8 tile: the float4 of lanes 4 r + j, j = 0..3, which
// hold columns 2 j, 2 j + 1 of rows r and r + 8 (r = t % 8), and writes 8 columns of each row. So a
// warp reads 2 KB in a row and the rows of its 4 tiles come out as 64-byte runs. (A thread a tile
// row with 8-byte reads moved half of each sector it touched: 0.15 ms at 32768 tokens x 16 heads x
// 128 on an H200, cuDNN's convert 0.11.)
// Grid: (16-row tiles of the longest sequence x D / 8 x 8) / 256, heads, batch (or sequences).
template <typename T, int kD, bool kVarlen>
__global__ void attention_dq_convert_kernel(const __grid_constant__ BwdParams p) {
  constexpr int kChunks = kD / 8;
  const int h = blockIdx.y, b = blockIdx.z;
  const SeqInfo<kVarlen> seq(p, b);
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int row_tiles = (seq.seqlen_q + 15) / 16;
  // dq_accum complete (launched overlapping the dk/dv kernel's tail); threads past their sequence leave.
  if (idx >= static_cast<int64_t>(row_tiles) * kChunks * 8) {
    grid_dependency_wait_on_early_exit();
    return;
  }
  grid_dependency_wait();
  const int tile = static_cast<int>(idx / 8), r = static_cast<int>(idx % 8);
  const int row_tile = tile / kChunks, c = tile % kChunks;
  if (c * 8 >= p.head_dim) return;  // the zero columns past the head dim (attention_params.h)
  const float4* src = reinterpret_cast<const float4*>(
      dq_accum_tile(p, b, h, dq_accum_seq_tile0<kVarlen>(p, b), row_tile, c, kD) + 16 * r);
  float lo[8], hi[8];  // rows r and r + 8 of the tile
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float4 v = src[j];
    lo[2 * j] = v.x * p.scale;
    lo[2 * j + 1] = v.y * p.scale;
    hi[2 * j] = v.z * p.scale;
    hi[2 * j + 1] = v.w * p.scale;
  }
  T* dst = static_cast<T*>(p.grad_q) + b * p.dq_batch_stride + h * p.dq_head_stride + c * 8;
  const int row = row_tile * 16 + r;
  auto store = [&](int i, const float (&v)[8]) {
    if (i >= seq.seqlen_q) return;
    const uint4 out = {pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]), pack2<T>(v[4], v[5]), pack2<T>(v[6], v[7])};
    *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(seq.q_row0 + i) * p.dq_row_stride) = out;
  };
  // Lanes 4 r .. 4 r + 3 have bit 3 set where r & 2: their halves are swapped (dq_swap_halves).
  const bool swapped = dq_swap_halves<kD>() && (r & 2) != 0;
  store(swapped ? row + 8 : row, lo);
  store(swapped ? row : row + 8, hi);
}

// The 80-query dk/dv kernel's dQ^T (BwdTraits::kTransposedDq, head dim 128) in dq_accum: per (batch
// or sequence, head) 8 panels of 16 columns (one a consumer warp), each the head's rows in 16-row
// units of 1 KB in the wgmma accumulator's order (float4 j' (0, 1) of lane l, element e: row
// 8 j' + 2 (l % 4) + e % 2 of the unit, column 16 w + l / 4 + 8 (e / 2)). A query tile starting at any
// multiple of 16 rows is then one contiguous run of units a warp, one bulk reduction (DqBulkAdd).
// The float address of unit `unit` (from the sequence's first, seq_tile0) of panel `panel`.
__device__ __forceinline__ float* dq_accum_panel_unit(const BwdParams& p, int b, int h, int64_t seq_tile0, int unit,
                                                      int panel) {
  return p.dq_accum + (b * p.dq_accum_batch_tiles + h * p.dq_accum_head_tiles) * 2048 +
         (panel * p.dq_accum_head_tiles + seq_tile0 + unit) * 256;
}

// dq_accum zeroed by the dk/dv kernel (BwdParams::dq_zero_ahead) instead of by the row_dot kernel: the
// 268 MB of zeros at 32768 tokens x 16 heads x 128 stored under the dk/dv kernel's compute rather
// than in a kernel of their own (a wave ahead they still go out to memory and come back for the
// first reduction, by ncu's DRAM bytes). The grid in its default order (key block x, kv head,
// batch or sequence slot z); its real blocks (at fixed length all, varlen those within their
// sequence) numbered in grid order: row (hk, z) holds `blocks` of them from `first`. Real block u
// zeroes the unit of real block u + dq_zero_ahead: slice x of its row's dq_accum, i.e. of each head
// of the GQA group and each panel (8 in the 80-query kernel's transposed layout, dq_accum_panel_unit;
// else 1) the 16-row units [x per, (x + 1) per) of the sequence's ceil(Sq / 16), per = ceil(units /
// blocks). Units and grid rows fit an int (the launcher checks).
struct DqZeroRow {
  int first, blocks;
};
template <bool kVarlen>
__device__ __forceinline__ DqZeroRow dq_zero_row(const BwdParams& p, int hk, int z, int kv_blocks) {
  if constexpr (kVarlen) {
    const int before = p.key_block_prefix[z], blocks = p.key_block_prefix[z + 1] - before;
    return {p.heads_kv * before + hk * blocks, blocks};
  }
  return {(z * p.heads_kv + hk) * kv_blocks, kv_blocks};
}
template <bool kVarlen>
__device__ __forceinline__ int dq_zero_units(const BwdParams& p, int kv_blocks) {
  if constexpr (kVarlen) return p.heads_kv * p.key_block_prefix[p.batch];
  return kv_blocks * p.heads_kv * p.batch;
}
struct DqZeroUnit {
  int hk, b, x, slices, seqlen_q, row;  // b: the batch (0 for varlen); row: the grid row's index, for its count
  int64_t seq_tile0;
};
// Varlen: slice x of `slices` of kv head hk's rows of the sequence in slot z.
__device__ __forceinline__ DqZeroUnit dq_zero_varlen_unit(const BwdParams& p, int z, int hk, int x, int slices) {
  const int b = p.seq_order[z];
  return {hk, 0, x, slices, SeqInfo<true>(p, b).seqlen_q, z * p.heads_kv + hk, dq_accum_seq_tile0<true>(p, b)};
}
// Real block u (< dq_zero_units) as a unit. Varlen: the sequence slot z by a binary search of the key
// block prefix sums (the last slot whose first real block is at most u: never an empty sequence's).
template <bool kVarlen>
__device__ __forceinline__ DqZeroUnit dq_zero_unit(const BwdParams& p, int u, int kv_blocks) {
  if constexpr (kVarlen) {
    int lo = 0, hi = p.batch - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.heads_kv * p.key_block_prefix[mid] <= u) lo = mid;
      else hi = mid - 1;
    }
    const int before = p.key_block_prefix[lo], blocks = p.key_block_prefix[lo + 1] - before;
    const int within = u - p.heads_kv * before;
    return dq_zero_varlen_unit(p, lo, within / blocks, within % blocks, blocks);
  }
  const int row = u / kv_blocks;
  return {row % p.heads_kv, row / p.heads_kv, u % kv_blocks, kv_blocks, p.seqlen_q, row, 0};
}
template <int kD, bool kTransposedDq>
__device__ __forceinline__ void zero_dq_accum_unit(const BwdParams& p, const DqZeroUnit& z, int thread, int threads) {
  constexpr int kPanels = kTransposedDq ? 8 : 1, kUnitVectors = 16 * kD / kPanels / 4;
  const int units = (z.seqlen_q + 15) / 16, per = (units + z.slices - 1) / z.slices;
  const int first = z.x * per, count = min(per, units - first);
  if (count <= 0) return;
  const int vectors = count * kUnitVectors;
  for (int r = 0; r < p.group * kPanels; ++r) {
    const int h = z.hk * p.group + r / kPanels, panel = r % kPanels;
    float4* dst = reinterpret_cast<float4*>(p.dq_accum) +
                  ((z.b * p.dq_accum_batch_tiles + h * p.dq_accum_head_tiles) * kPanels +
                   panel * p.dq_accum_head_tiles + z.seq_tile0 + first) *
                      kUnitVectors;
    for (int i = thread; i < vectors; i += threads) dst[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// Units [0, gridDim.x) of zero_dq_accum_unit, the ones no dk/dv block zeroes ahead, and the dk/dv grid
// rows' counts (`rows` ints), before the dk/dv kernel. Varlen: also the dQ rows of sequences without
// keys (no key block zeroes them; their dQ is 0).
template <int kD, bool kTransposedDq, bool kVarlen>
__global__ void attention_dq_zero_first_kernel(const __grid_constant__ BwdParams p, int kv_blocks, int rows) {
  // Launched overlapping the row_dot kernel, which touches nothing written here: the zeroing runs under
  // its tail, and the wait at the end makes this grid's completion imply the row_dot kernel's too.
  grid_dependents_may_launch();
  if (static_cast<int>(blockIdx.x) < dq_zero_units<kVarlen>(p, kv_blocks))
    zero_dq_accum_unit<kD, kTransposedDq>(p, dq_zero_unit<kVarlen>(p, blockIdx.x, kv_blocks), threadIdx.x, blockDim.x);
  if constexpr (kVarlen) {
    for (int z = blockIdx.x; z < p.batch; z += gridDim.x) {
      if (p.key_block_prefix[z + 1] != p.key_block_prefix[z]) continue;
      for (int hk = 0; hk < p.heads_kv; ++hk)
        zero_dq_accum_unit<kD, kTransposedDq>(p, dq_zero_varlen_unit(p, z, hk, 0, 1), threadIdx.x, blockDim.x);
    }
  }
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < rows; i += gridDim.x * blockDim.x) p.dq_zero_counts[i] = 0;
  grid_dependency_wait();
}

// dq = scale * dq_accum for the 80-query dk/dv kernel (dq_accum_panel_unit's layout). A block
// kBlockM rows: the floats through shared memory (rows of 132: a warp's stores hit 32 banks), then
// 16-byte rows of q's dtype. Grid: kBlockM-row blocks of the longest sequence, heads, batch (or
// sequences: blocks past a sequence leave, units past it are not read).
template <typename T, int kBlockM, bool kVarlen>
__global__ void attention_dq_convert_transposed_kernel(const __grid_constant__ BwdParams p) {
  constexpr int kD = 128, kPitch = kD + 4;
  static_assert(kBlockM % 16 == 0, "whole 16-row units");
  __shared__ float tile[kBlockM * kPitch];
  const int m0 = blockIdx.x * kBlockM, h = blockIdx.y, b = blockIdx.z;
  const SeqInfo<kVarlen> seq(p, b);
  // dq_accum complete (launched overlapping the dk/dv kernel's tail); blocks past their sequence leave.
  if (m0 >= seq.seqlen_q) {
    grid_dependency_wait_on_early_exit();
    return;
  }
  grid_dependency_wait();
  const int64_t seq_tile0 = dq_accum_seq_tile0<kVarlen>(p, b);
  constexpr int kUnits = kBlockM / 16;
  const int units = min(kUnits, (seq.seqlen_q - m0 + 15) / 16);  // within the sequence
  for (int v = threadIdx.x; v < 8 * kUnits * 64; v += blockDim.x) {
    const int w = v / (kUnits * 64), u = v / 64 % kUnits, j = 2 * u + (v / 32) % 2, l = v % 32;
    if (u >= units) continue;
    const float4 x = reinterpret_cast<const float4*>(dq_accum_panel_unit(p, b, h, seq_tile0, m0 / 16 + u, w))[v % 64];
    float* dst = tile + (8 * j + 2 * (l & 3)) * kPitch + 16 * w + (l >> 2);
    dst[0] = x.x * p.scale;
    dst[kPitch] = x.y * p.scale;
    dst[8] = x.z * p.scale;
    dst[kPitch + 8] = x.w * p.scale;
  }
  __syncthreads();
  T* out = static_cast<T*>(p.grad_q) + b * p.dq_batch_stride + h * p.dq_head_stride;
  for (int c = threadIdx.x; c < kBlockM * kD / 8; c += blockDim.x) {
    const int r = c / (kD / 8), col = c % (kD / 8) * 8;
    if (m0 + r >= seq.seqlen_q) break;  // c grows with r
    const float* v = tile + r * kPitch + col;
    const uint4 o = {pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]), pack2<T>(v[4], v[5]), pack2<T>(v[6], v[7])};
    *reinterpret_cast<uint4*>(out + static_cast<int64_t>(seq.q_row0 + m0 + r) * p.dq_row_stride + col) = o;
  }
}

// The key tile a dk/dv block owns (kBlockN keys of one (batch or sequence, kv head)) and the query
// tiles it visits: iteration it is query tile row0(it) of query head head(it), over every head of the
// GQA group, only the tiles with a query that sees one of the keys. rows_k <= 0: the block is past
// its sequence (varlen) and exits. Block order: see launch_attention_bwd (key blocks slowest when
// the launcher set kv_block_slowest).
template <int kBlockM, int kBlockN, int kMask, bool kVarlen>
struct KeyBlock {
  int hk, b, n0, rows_k, seqlen_q, seqlen_k, offset, row_first, m_count, iterations, q_row0, k_row0;
  int64_t seq_tile0;
  __device__ __forceinline__ explicit KeyBlock(const BwdParams& p) {
    int n_block = blockIdx.x;
    hk = blockIdx.y, b = blockIdx.z;
    if constexpr (kMask != kNoMask) {
      if (p.kv_block_slowest) n_block = blockIdx.z, hk = blockIdx.x, b = blockIdx.y;
    }
    if constexpr (kVarlen) b = p.seq_order[b];  // longest sequences first
    const SeqInfo<kVarlen> seq(p, b);
    seqlen_q = seq.seqlen_q;
    seqlen_k = seq.seqlen_k;
    q_row0 = seq.q_row0;
    k_row0 = seq.k_row0;
    n0 = n_block * kBlockN;
    rows_k = min(kBlockN, seqlen_k - n0);
    offset = seqlen_k - seqlen_q;
    // Query i sees key j when j - off - right <= i <= j - off + left: the query rows any key of the
    // block sees are [first_row, last_row].
    int first_row = 0, last_row = seqlen_q - 1;
    if constexpr (kMask != kNoMask) first_row = max(0, n0 - offset - p.window_right);
    if constexpr (kMask == kWindow) last_row = min(seqlen_q - 1, n0 + rows_k - 1 - offset + p.window_left);
    // The query tiles start at multiples of kBlockM, except 80-row tiles (no divisor of the 128-key
    // block; dq_accum_panel_unit): from first_row rounded down to 16 rows (p.bwd_row_align; 80 for A/B timings), so a
    // block's first tile holds at most 15 rows that see none of its keys instead of 79 (H100: a 4096
    // window's tiles -1.0%, its masked tiles -17%).
    const int align = kBlockN % kBlockM != 0 ? p.bwd_row_align : kBlockM;
    row_first = first_row / align * align;
    m_count = last_row < first_row ? 0 : (last_row - row_first) / kBlockM + 1;
    iterations = p.group * m_count;
    seq_tile0 = dq_accum_seq_tile0<kVarlen>(p, b);
  }
  __device__ __forceinline__ int head(int it, const BwdParams& p) const { return hk * p.group + it / m_count; }
  __device__ __forceinline__ int row0(int it) const { return row_first + it % m_count * kBlockM; }
};

// The block's K and V rows [n0, n0 + kBlockN) into sK / sV (Tile layout), zero rows past Sk.
// n0: the row in the (B, H, S, D) view (the sequence's first row added for varlen).
template <typename T, int kBlockN, int kD, int kThreads, class Tile>
__device__ __forceinline__ void load_key_tiles(const BwdParams& p, int b, int hk, int64_t n0, int rows_k, uint32_t sK,
                                               uint32_t sV, int head_dim, int tid) {
  const int kv_head = p.kv_source_head(hk);  // the head split reads K / V in place
  const T* k = static_cast<const T*>(p.k) + b * p.k_batch_stride + kv_head * p.k_head_stride + n0 * p.k_row_stride;
  const T* v = static_cast<const T*>(p.v) + b * p.v_batch_stride + kv_head * p.v_head_stride + n0 * p.v_row_stride;
  load_tile_async<kBlockN, kD, kThreads, T, Tile>(sK, k, p.k_row_stride, rows_k, head_dim, tid);
  load_tile_async<kBlockN, kD, kThreads, T, Tile>(sV, v, p.v_row_stride, rows_k, head_dim, tid);
}

// Q and dO rows [m0, m0 + kBlockM) of query head h of the sequence (its first row q_row0 in the view,
// seqlen_q rows) into sQ / sdO (Tile layout, zero rows past Sq), and their lse (base 2; +inf past Sq,
// so P = 0) and D into floats[0, kBlockM) and floats[kBlockM, 2 kBlockM).
template <typename T, int kBlockM, int kD, int kThreads, class Tile>
__device__ __forceinline__ void load_query_tiles(const BwdParams& p, int b, int h, int q_row0, int seqlen_q, int m0,
                                                 uint32_t sQ, uint32_t sdO, float* floats, int head_dim, int tid) {
  const int64_t row = q_row0 + m0;
  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride + row * p.q_row_stride;
  const T* dout = static_cast<const T*>(p.grad_out) + b * p.do_batch_stride + h * p.do_head_stride + row * p.do_row_stride;
  load_tile_async<kBlockM, kD, kThreads, T, Tile>(sQ, q, p.q_row_stride, seqlen_q - m0, head_dim, tid);
  load_tile_async<kBlockM, kD, kThreads, T, Tile>(sdO, dout, p.do_row_stride, seqlen_q - m0, head_dim, tid);
  const int64_t row_base = b * p.lse_batch_stride + h * p.lse_head_stride + q_row0;
  for (int r = tid; r < kBlockM; r += kThreads) {
    const bool valid = m0 + r < seqlen_q;
    floats[r] = valid ? lse_to_log2(p.lse[row_base + m0 + r]) : INFINITY;
    floats[kBlockM + r] = valid ? p.row_dot[row_base + m0 + r] : 0.f;
  }
}

// mma.sync body (GPUs other than sm_90a): each of the 8 warps owns 16 keys.
template <class Tr, int kMask, bool kSoftcap, bool kVarlen, bool kAtomicDq>
__device__ __forceinline__ void attention_bwd_dkdv_mma_body(const BwdParams& p) {
  using T = typename Tr::T;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kNT = Tr::kNTiles, kD = Tr::kHeadDim;
  const int head_dim = valid_head_dim<Tr>(p);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const KeyBlock<kBlockM, kBlockN, kMask, kVarlen> blk(p);
  if (blk.rows_k <= 0) return;  // past its sequence (varlen)
  const int hk = blk.hk, b = blk.b, n0 = blk.n0, rows_k = blk.rows_k, offset = blk.offset, seqlen_k = blk.seqlen_k,
            iterations = blk.iterations;

  unsigned char* smem = attention_smem;
  const uint32_t sK = smem_addr(smem);
  const uint32_t sV = sK + Tr::kTileKVBytes;
  const uint32_t sStage0 = sV + Tr::kTileKVBytes;
  constexpr int kStageBytes = 2 * Tr::kTileQBytes + 2 * kBlockM * 4;
  const uint32_t sDs = sStage0 + Tr::kStages * kStageBytes;
  float* stage_floats0 = reinterpret_cast<float*>(smem + 2 * Tr::kTileKVBytes + 2 * Tr::kTileQBytes);

  using Tile = SwizzledTile<kD>;
  load_key_tiles<T, kBlockN, kD, Tr::kThreads, Tile>(p, b, hk, blk.k_row0 + n0, rows_k, sK, sV, head_dim, tid);
  // Q, dO, lse and D of iteration `it` into stage `it % 2`.
  auto prefetch = [&](int it) {
    const uint32_t stage = sStage0 + (it & 1) * kStageBytes;
    load_query_tiles<T, kBlockM, kD, Tr::kThreads, Tile>(p, b, blk.head(it, p), blk.q_row0, blk.seqlen_q,
                                                         blk.row0(it), stage, stage + Tr::kTileQBytes,
                                                         stage_floats0 + (it & 1) * (kStageBytes / 4), head_dim, tid);
  };

  float dk[kNT][kD / 8][4], dv[kNT][kD / 8][4];
#pragma unroll
  for (int mt = 0; mt < kNT; ++mt)
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[mt][dt][e] = dv[mt][dt][e] = 0.f;

  if (iterations > 0) prefetch(0);
  cp_async_commit();
  const int warp_row0 = warp * kNT * 16;  // this warp's keys within the block
  const float scale_log2 = p.scale_log2;

  for (int it = 0; it < iterations; ++it) {
    cp_async_wait<0>();
    __syncthreads();  // stage it % 2 landed; every warp is done with iteration it - 1
    if (it + 1 < iterations) prefetch(it + 1);
    cp_async_commit();
    const int h = blk.head(it, p), m0 = blk.row0(it);
    const uint32_t sQ = sStage0 + (it & 1) * kStageBytes;
    const uint32_t sdO = sQ + Tr::kTileQBytes;
    const float* s_lse = stage_floats0 + (it & 1) * (kStageBytes / 4);
    const float* s_row_dot = s_lse + kBlockM;

    // P^T = exp2(S^T * scale_log2 - lse_log2[query]) for this warp's keys x kBlockM queries.
    float pt[kNT][kBlockM / 8][4];
#pragma unroll
    for (int mt = 0; mt < kNT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kBlockM / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) pt[mt][nt][e] = 0.f;
    warp_gemm_abt<T, kD, kNT, kBlockM>(pt, sK, warp_row0, sQ, lane);
    // Softcap: s' = out tanh(in s), and its derivative 1 - tanh^2 for dS.
    float dtanh[kSoftcap ? kNT : 1][kSoftcap ? kBlockM / 8 : 1][4];
    if constexpr (kSoftcap) {
#pragma unroll
      for (int mt = 0; mt < kNT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kBlockM / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float t = fast_tanh(p.softcap_in * pt[mt][nt][e]);
            pt[mt][nt][e] = p.softcap_out * t;
            dtanh[mt][nt][e] = fmaf(-t, t, 1.f);
          }
    }
    const bool needs_mask = tile_needs_mask<kMask, kBlockM, kBlockN>(m0, n0, seqlen_k, offset, p);
#pragma unroll
    for (int mt = 0; mt < kNT; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const VisibleRange rows = rows_of_key<kMask>(n0 + warp_row0 + mt * 16 + (lane >> 2) + hh * 8,
                                                     m0 + (lane & 3) * 2, seqlen_k, offset, p);
#pragma unroll
        for (int nt = 0; nt < kBlockM / 8; ++nt)
#pragma unroll
          for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
            const int col = nt * 8 + (lane & 3) * 2 + (e & 1);  // query, block-relative
            float val = fast_exp2(fmaf(pt[mt][nt][e], scale_log2, -s_lse[col]));
            if (needs_mask && !rows.contains(nt * 8 + (e & 1))) val = 0.f;
            pt[mt][nt][e] = val;
          }
      }
    warp_gemm_pb<T, kD, kNT, kBlockM>(dv, pt, sdO, lane);

    // dS^T = P^T (dP^T - D[query]), dP^T = V dO^T.
    float ds[kNT][kBlockM / 8][4];
#pragma unroll
    for (int mt = 0; mt < kNT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kBlockM / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[mt][nt][e] = 0.f;
    warp_gemm_abt<T, kD, kNT, kBlockM>(ds, sV, warp_row0, sdO, lane);
#pragma unroll
    for (int mt = 0; mt < kNT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kBlockM / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = nt * 8 + (lane & 3) * 2 + (e & 1);
          ds[mt][nt][e] = pt[mt][nt][e] * (ds[mt][nt][e] - s_row_dot[col]);
          if constexpr (kSoftcap) ds[mt][nt][e] *= dtanh[mt][nt][e];
        }
    warp_gemm_pb<T, kD, kNT, kBlockM>(dk, ds, sQ, lane);

    if constexpr (kAtomicDq) {
      // dS^T to shared memory as [key][query], then dQ (kBlockM x kD) += dS K split over the warps.
      using DsTile = SwizzledTile<kBlockM>;
      unsigned char* ds_bytes = smem + (sDs - sK);
#pragma unroll
      for (int mt = 0; mt < kNT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kBlockM / 8; ++nt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int row = warp_row0 + mt * 16 + (lane >> 2) + hh * 8;
            const int col = nt * 8 + (lane & 3) * 2;
            *reinterpret_cast<uint32_t*>(ds_bytes + DsTile::offset(row, col) + (col & 7) * 2) =
                pack2<T>(ds[mt][nt][2 * hh], ds[mt][nt][2 * hh + 1]);
          }
      __syncthreads();
      constexpr int kRT = Tr::kDqRowTiles, kCols = Tr::kDqCols;
      const int wm = warp % Tr::kDqWarpsM, wn = warp / Tr::kDqWarpsM;
      const int q_row0 = wm * kRT * 16, d_col0 = wn * kCols;
      float dq[kRT][kCols / 8][4];
#pragma unroll
      for (int rt = 0; rt < kRT; ++rt)
#pragma unroll
        for (int dt = 0; dt < kCols / 8; ++dt)
#pragma unroll
          for (int e = 0; e < 4; ++e) dq[rt][dt][e] = 0.f;
      using KTile = SwizzledTile<kD>;
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        uint32_t a[kRT][4];
#pragma unroll
        for (int rt = 0; rt < kRT; ++rt)
          ldmatrix_x4_trans(a[rt], sDs + DsTile::offset(kk * 16 + (lane >> 4) * 8 + (lane & 7),
                                                        q_row0 + rt * 16 + ((lane >> 3) & 1) * 8));
#pragma unroll
        for (int dp = 0; dp < kCols / 16; ++dp) {
          uint32_t bb[4];
          ldmatrix_x4_trans(bb, sK + KTile::offset(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                   d_col0 + dp * 16 + (lane >> 4) * 8));
#pragma unroll
          for (int rt = 0; rt < kRT; ++rt) {
            mma_16816<T>(dq[rt][2 * dp], a[rt], bb[0], bb[1]);
            mma_16816<T>(dq[rt][2 * dp + 1], a[rt], bb[2], bb[3]);
          }
        }
      }
#pragma unroll
      for (int rt = 0; rt < kRT; ++rt) {
        const int row_tile = (m0 + q_row0) / 16 + rt;
        if (row_tile * 16 < blk.seqlen_q) {
#pragma unroll
          for (int dt = 0; dt < kCols / 8; ++dt)
            dq_accum_add<kD>(dq_accum_tile(p, b, h, blk.seq_tile0, row_tile, (d_col0 >> 3) + dt, kD), lane, dq[rt][dt][0],
                         dq[rt][dt][1], dq[rt][dt][2], dq[rt][dt][3]);
        }
      }
    }
  }

  // dK = scale * sum dS^T Q, dV = sum P^T dO: staged through this warp's own rows of sK / sV.
  cp_async_wait<0>();
  __syncthreads();  // every warp is done reading sK / sV (the dq product reads all of sK)
  float ones[kNT][2], scales[kNT][2];
#pragma unroll
  for (int mt = 0; mt < kNT; ++mt) ones[mt][0] = ones[mt][1] = 1.f, scales[mt][0] = scales[mt][1] = p.scale;
  const int64_t key_row = blk.k_row0 + n0;
  T* gk = static_cast<T*>(p.grad_k) + b * p.dk_batch_stride + hk * p.dk_head_stride + key_row * p.dk_row_stride;
  T* gv = static_cast<T*>(p.grad_v) + b * p.dv_batch_stride + hk * p.dv_head_stride + key_row * p.dv_row_stride;
  store_rows<T, kD, kNT>(dk, scales, smem, warp_row0, gk, p.dk_row_stride, rows_k, head_dim, lane);
  store_rows<T, kD, kNT>(dv, ones, smem + Tr::kTileKVBytes, warp_row0, gv, p.dv_row_stride, rows_k, head_dim, lane);
}

#if FUSEFORGE_ATTENTION_WGMMA
// Where warp `warp`'s 16 x 64 block of dQ for query tile `it` goes (the wgmma body's split without
// Tr::kSplitCols: warpgroup g computes dQ's columns [64 g, +64) at head dim 128, its rows [64 g, +64)
// at 64), and whether those rows lie within Sq.
// kTransposedDq: the warp's panel at the tile's first 16-row unit, and in `units` how many of the
// tile's units start within Sq (dq_accum_panel_unit).
struct DqTarget {
  float* tile;
  bool valid;
  int units;
};
template <class Tr, class Blk>
__device__ __forceinline__ DqTarget dq_target(const BwdParams& p, const Blk& blk, int it, int warp) {
  if constexpr (Tr::kTransposedDq) {
    const int m0 = blk.row0(it);
    return {dq_accum_panel_unit(p, blk.b, blk.head(it, p), blk.seq_tile0, m0 / 16, warp), true,
            (blk.seqlen_q - m0 + 15) / 16};
  }
  const int wg = warp >> 2;
  const int q0 = Tr::kBlockM == 128 ? wg * 64 : 0, col0 = Tr::kHeadDim == 128 ? wg * 64 : 0;
  const int row_tile = (blk.row0(it) + q0) / 16 + (warp & 3);
  return {dq_accum_tile(p, blk.b, blk.head(it, p), blk.seq_tile0, row_tile, col0 >> 3, Tr::kHeadDim),
          row_tile * 16 < blk.seqlen_q, 1};
}

// One query tile of the wgmma dk/dv body, for warp `warp` (0..7: warpgroup warp / 4 owns keys
// [64 (warp / 4), +64) of the block): S^T, dP^T, dV += P^T dO, dK += dS^T Q, and on the atomic path
// dS^T into sDs (generic pointer ds), sync_ds() (every warp of both warpgroups has written its keys),
// dQ = dS K handed to add_dq(dq, dq_accum tile, lane, tile within Sq) a warp (DqAtomicAdd, or the warp-specialized
// kernel's bulk reduction, which stores the rows and hands them on in the next tile's add_dq.flush).
// Returns with every product of the tile complete.
// 80-query tiles (Tr::kTransposedDq, warp-specialized kernel only): dS is stored [query][key] and each
// warpgroup computes dQ^T = K^T dS^T for its 64 head-dim columns (80 rows are no multiple of 64).
// Head dim 256 (Tr::kSplitCols, 64-key blocks): both warpgroups own the block's 64 keys and compute
// the same S^T and dP^T over all 256 columns; warpgroup g accumulates columns [128 g, +128) of dK and
// dV, writes its own copy of dS^T (sDs + g tileDs) and adds dQ's columns [128 g, +128), so every dQ
// element is added once.
template <class Tr, int kMask, bool kSoftcap, bool kAtomicDq, bool kPinZeros, class Blk, class SyncDs, class AddDq>
__device__ __forceinline__ void dkdv_wgmma_tile(const BwdParams& p, const Blk& blk, int it, uint32_t sK, uint32_t sV,
                                                uint32_t sQ, uint32_t sdO, const float* s_lse,
                                                const float* s_row_dot, uint32_t sDs, unsigned char* ds, int warp,
                                                int lane, float (&dk)[Tr::kDOut / 2], float (&dv)[Tr::kDOut / 2],
                                                SyncDs&& sync_ds, AddDq&& add_dq) {
  using T = typename Tr::T;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kD = Tr::kHeadDim, kDOut = Tr::kDOut;
  constexpr bool kSplit = Tr::kSplitCols;
  constexpr int kSN = kBlockM / 2;  // S^T accumulator floats a thread (64 keys x kBlockM queries)
  using KVTile = PanelTile<kBlockN>;
  using QTile = PanelTile<kBlockM>;
  using DsTile = PanelTile<kBlockN>;  // dS^T: kBlockN keys x kBlockM queries
  const int wg = warp >> 2, warp_row0 = (kSplit ? warp & 3 : warp) * 16;
  const uint32_t wg_rows = (kSplit ? 0 : wg) * 64 * 128;  // the warpgroup's first key row in a K/V panel
  // kSplit: this warpgroup's output columns [kDOut wg, +kDOut): its first panel of Q / dO, and its dS^T.
  const int col_half = kSplit ? wg : 0;
  const uint32_t out_panels = col_half * (kDOut / 64) * QTile::kPanelBytes;
  const uint32_t ds_off = kSplit ? wg * Tr::kTileDsBytes : 0;
  const int h = blk.head(it, p), m0 = blk.row0(it), n0 = blk.n0, b = blk.b, offset = blk.offset,
            seqlen_k = blk.seqlen_k;
  const float scale_log2 = p.scale_log2;

  // S^T = K Q^T and dP^T = V dO^T: 64 keys x kBlockM queries each, both operands K-major.
  float st[kSN], dpt[kSN];
#pragma unroll
  for (int i = 0; i < kSN; ++i) st[i] = dpt[i] = 0.f;
  // kPinZeros pins the zeros before the fence: else the compiler sinks dpt's zeroing past S^T's issue
  // and ptxas serializes both groups (injected warpgroup.arrive / wait, C7519 / C7517; at head dim 128
  // on the atomic path, every product of the tile; on the warp-specialized kernel at head dim 64,
  // C7512 and spills). The warp-specialized kernel always pins; the cp.async one from head dim 128
  // up: at 64 (its calls there: TMA off, or operands a tensor map cannot describe) it does not pin,
  // since with the pin its causal forward+backward measures 10-15% slower on the H100 (full 1-2%
  // faster).
  if constexpr (kPinZeros) {
    wgmma_fence_operands(st);
    wgmma_fence_operands(dpt);
  }
  wgmma_fence();
  wgmma_ss_k_major<T, kBlockM, kD / 16>(st, sK + wg_rows, KVTile::kPanelBytes, sQ, QTile::kPanelBytes);
  wgmma_ss_k_major<T, kBlockM, kD / 16>(dpt, sV + wg_rows, KVTile::kPanelBytes, sdO, QTile::kPanelBytes);
  // lse and row_dot of this thread's query columns (element i: 2 (i / 4) + i % 2), read while the
  // products run: read after a wgmma wait (its memory clobber pins them there), P^T's and dS^T's
  // arithmetic stalls on the loads (~5% of the dk/dv kernel's stall samples, ncu at D128/S4096).
  // With the deferred dQ hand-off (DqBulkAdd) 2-4% off head dim 128's forward+backward (H100).
  // Head dim 128 only: 64's and 256's register budgets are not checked for the 32 more live
  // registers.
  constexpr bool kEarlyLds = kD == 128 && !kSplit && !Tr::kTransposedDq;  // 80-query tiles: no registers left
  float lse_r[kEarlyLds ? kSN / 2 : 1] = {}, row_dot_r[kEarlyLds ? kSN / 2 : 1] = {};
  auto load_pairs = [&](float* dst, const float* src) {
#pragma unroll
    for (int j = 0; j < kSN / 4; ++j) {
      const float2 v = *reinterpret_cast<const float2*>(src + j * 8 + (lane & 3) * 2);
      dst[2 * j] = v.x;
      dst[2 * j + 1] = v.y;
    }
  };
  if constexpr (kEarlyLds) load_pairs(lse_r, s_lse);
  auto lse_of = [&](int i, int col) {
    if constexpr (kEarlyLds) return lse_r[2 * (i >> 2) + (i & 1)];
    else return s_lse[col];
  };
  auto row_dot_of = [&](int i, int col) {
    if constexpr (kEarlyLds) return row_dot_r[2 * (i >> 2) + (i & 1)];
    else return s_row_dot[col];
  };
  wgmma_wait<1>();
  wgmma_fence_operands(st);

  // Softcap: s' = out tanh(in s), and its derivative 1 - tanh^2 for dS.
  float dtanh[kSoftcap ? kSN : 1];
  if constexpr (kSoftcap) {
#pragma unroll
    for (int i = 0; i < kSN; ++i) {
      const float t = fast_tanh(p.softcap_in * st[i]);
      st[i] = p.softcap_out * t;
      dtanh[i] = fmaf(-t, t, 1.f);
    }
  }
  // P^T = exp2(S^T * scale_log2 - lse_log2[query]); element i: query column 8 (i / 4) + 2 t + i % 2,
  // key row warp_row0 + g + 8 ((i % 4) / 2).
  // Two copies of the loop behind one uniform branch: with the mask test inside the loop, ptxas
  // predicates it and every tile pays for it (~100 instructions a thread at kBlockM = 64). With
  // the two copies and the mask test as a bitwise & (VisibleRange::contains; H100, A B B A): causal fwd+bwd 1-3% faster at head dim 128
  // (S16384 14.23 -> 13.75 ms), the sliding window 7.5% (7.04 -> 6.55), D256 softcap 3%.
  auto scores_to_p = [&](auto masked) {
    // The query rows that see this thread's two keys (element i: key row + 8 ((i / 2) % 2)).
    VisibleRange rows[2];
    if constexpr (decltype(masked)::value) {
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        rows[hh] = rows_of_key<kMask>(n0 + warp_row0 + (lane >> 2) + hh * 8, m0 + (lane & 3) * 2, seqlen_k, offset, p);
    }
#pragma unroll
    for (int i = 0; i < kSN; ++i) {
      const int col = (i >> 2) * 8 + (lane & 3) * 2 + (i & 1);
      float val = fast_exp2(fmaf(st[i], scale_log2, -lse_of(i, col)));
      if constexpr (decltype(masked)::value) {
        if (!rows[(i >> 1) & 1].contains((i >> 2) * 8 + (i & 1))) val = 0.f;
      }
      st[i] = val;
    }
  };
  if (tile_needs_mask<kMask, kBlockM, kBlockN>(m0, n0, seqlen_k, offset, p))
    scores_to_p(std::true_type{});
  else
    scores_to_p(std::false_type{});
  // dV += P^T dO: P^T as A fragments (k = 16 queries a step), dO MN-major (rows = queries).
  auto& st4 = reinterpret_cast<const float(&)[kSN / 4][4]>(st);
  uint32_t pa[kBlockM / 16][4];
#pragma unroll
  for (int kk = 0; kk < kBlockM / 16; ++kk) c_to_a_fragment<T>(st4[2 * kk], st4[2 * kk + 1], pa[kk]);
  if constexpr (kEarlyLds) load_pairs(row_dot_r, s_row_dot);
  wgmma_rs_mn_major<T, kDOut, kBlockM / 16>(dv, pa, sdO + out_panels, QTile::kPanelBytes);
  // The previous tile's dQ hand-off, under this tile's products (DqBulkAdd; its target recomputed,
  // not held across the loop).
  if constexpr (kAtomicDq && !kSplit)
    if (it > 0) add_dq.flush(dq_target<Tr>(p, blk, it - 1, warp));
  wgmma_wait<1>();  // dP^T done (dV may still run: pa stays untouched)
  wgmma_fence_operands(dpt);

  // dS^T = P^T (dP^T - D[query]); dK += dS^T Q (Q MN-major).
  uint32_t dsa[kBlockM / 16][4];
#pragma unroll
  for (int i = 0; i < kSN; ++i) {
    const int col = (i >> 2) * 8 + (lane & 3) * 2 + (i & 1);
    dpt[i] = st[i] * (dpt[i] - row_dot_of(i, col));
    if constexpr (kSoftcap) dpt[i] *= dtanh[i];
  }
  auto& dpt4 = reinterpret_cast<const float(&)[kSN / 4][4]>(dpt);
#pragma unroll
  for (int kk = 0; kk < kBlockM / 16; ++kk) c_to_a_fragment<T>(dpt4[2 * kk], dpt4[2 * kk + 1], dsa[kk]);
  wgmma_rs_mn_major<T, kDOut, kBlockM / 16>(dk, dsa, sQ + out_panels, QTile::kPanelBytes);

  if constexpr (kAtomicDq && Tr::kTransposedDq) {
    // dS to shared memory as [query][key] (a K-major operand of dQ^T = K^T dS^T; kBlockN / 64 panels of
    // kBlockM rows): dsa[kk] is the 16 keys x 16 queries of this warp as four 8 x 8 matrices, stored
    // transposed (matrix i: keys + 8 (i % 2), queries + 8 (i / 2); lane 8 i + r gives query row r's
    // 16 bytes).
    const int i = lane >> 3, key0 = warp_row0 + 8 * (i & 1);
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk)
      stmatrix_x4_trans(sDs + PanelTile<kBlockM>::offset(16 * kk + 8 * (i >> 1) + (lane & 7), key0), dsa[kk]);
    fence_proxy_async_shared();
    sync_ds();  // all kBlockN keys of dS written
  } else if constexpr (kAtomicDq) {
    // dS^T to shared memory ([key][query]); element pair (2t, 2t + 1) of query block j, key row
    // g + 8 hh is register dsa[j / 2][2 (j % 2) + hh].
#pragma unroll
    for (int j = 0; j < kBlockM / 8; ++j)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = warp_row0 + (lane >> 2) + hh * 8;
        const int col = j * 8 + (lane & 3) * 2;
        *reinterpret_cast<uint32_t*>(ds + ds_off + DsTile::offset(row, col) + (col & 7) * 2) =
            dsa[j >> 1][2 * (j & 1) + hh];
      }
    fence_proxy_async_shared();
    sync_ds();  // all kBlockN keys of dS^T written
  }
  if constexpr (kAtomicDq && kSplit) {
    // dQ's columns [kDOut wg, +kDOut) = dS K over the block's 64 keys, in 64-column pieces of 32 floats
    // a thread (one piece at a time: dK and dV hold 128 registers): dS from this warpgroup's copy
    // MN-major (rows = keys, queries along the row), K MN-major (rows = keys).
    static_assert(kBlockM == 64, "one 64-query block of dQ a warpgroup");
    const int row_tile = m0 / 16 + (warp & 3);
#pragma unroll
    for (int piece = 0; piece < kDOut / 64; ++piece) {
      const int col0 = col_half * kDOut + piece * 64;
      float dq[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) dq[i] = 0.f;
      wgmma_fence();
      const uint32_t ds_base = sDs + ds_off, k_base = sK + (col0 >> 6) * KVTile::kPanelBytes;
      const uint64_t ds_desc = wgmma_desc(ds_base, DsTile::kPanelBytes), k_desc = wgmma_desc(k_base, KVTile::kPanelBytes);
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        const uint32_t row_off = kk * 16 * 128;
        wgmma_m64n64k16_ss<T, 1, 1>(dq, wgmma_desc_add(ds_desc, row_off),
                                    wgmma_desc_add(k_desc, row_off));
      }
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operands(dq);
      add_dq(dq, dq_accum_tile(p, b, h, blk.seq_tile0, row_tile, col0 >> 3, kD), lane, row_tile * 16 < blk.seqlen_q);
    }
  } else if constexpr (kAtomicDq && Tr::kTransposedDq) {
    // dQ^T = K^T dS^T, this warpgroup's 64 head-dim columns x kBlockM queries over all 128 keys: K^T
    // MN-major from panel wg of sK (rows = keys), dS K-major from sDs ([query][key]).
    using DsRows = PanelTile<kBlockM>;
    float dq[kSN];
#pragma unroll
    for (int i = 0; i < kSN; ++i) dq[i] = 0.f;
    wgmma_fence();
    const uint64_t k_desc = wgmma_desc(sK + wg * KVTile::kPanelBytes, KVTile::kPanelBytes),
                   ds_desc = wgmma_desc_k_major(sDs);
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks)
      wgmma_m64n80k16_ss<T, 1, 0>(dq, wgmma_desc_add(k_desc, ks * 16 * 128),
                                  wgmma_desc_add(ds_desc, (ks >> 2) * DsRows::kPanelBytes + (ks & 3) * 32));
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(dq);
    const DqTarget target = dq_target<Tr>(p, blk, it, warp);
    add_dq(dq, target.tile, lane, target.valid);
  } else if constexpr (kAtomicDq) {
    // dQ = dS K, a 64 x 64 block a warpgroup (queries q0.., columns col0..) over all 128 keys: dS
    // from sDs MN-major (rows = keys, queries along the row), K MN-major (rows = keys).
    const int q0 = kBlockM == 128 ? wg * 64 : 0;
    const int col0 = kD == 128 ? wg * 64 : 0;
    float dq[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) dq[i] = 0.f;
    wgmma_fence();
    const uint32_t ds_base = sDs + (q0 >> 6) * DsTile::kPanelBytes, k_base = sK + (col0 >> 6) * KVTile::kPanelBytes;
    const uint64_t ds_desc = wgmma_desc(ds_base, DsTile::kPanelBytes), k_desc = wgmma_desc(k_base, KVTile::kPanelBytes);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint32_t row_off = kk * 16 * 128;
      wgmma_m64n64k16_ss<T, 1, 1>(dq, wgmma_desc_add(ds_desc, row_off),
                                  wgmma_desc_add(k_desc, row_off));
    }
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(dq);
    const DqTarget target = dq_target<Tr>(p, blk, it, warp);
    add_dq(dq, target.tile, lane, target.valid);
  } else {
    wgmma_wait<0>();
  }
  wgmma_fence_operands(dv);
  wgmma_fence_operands(dk);
}

// wgmma body (sm_90a): warpgroup g (warps 4g..4g+3) owns keys [64 g, 64 g + 64) of the block, so each
// warp's accumulator rows are the same 16 keys as in the mma.sync body and the softmax code matches.
// Per query tile: S^T = K Q^T and dP^T = V dO^T (operands in shared memory), then dV += P^T dO and
// dK += dS^T Q with P^T / dS^T from registers, and on the atomic path dQ = dS K from dS^T written to
// shared memory: each warpgroup computes a 64 x 64 block of it over all 128 keys, the columns split
// for D = 128 (64-query tiles), the query rows for D = 64 (128-query tiles). D = 256 (Tr::kSplitCols):
// 64-key blocks, both warpgroups on the same keys, each with half the output columns (dkdv_wgmma_tile).
template <class Tr, int kMask, bool kSoftcap, bool kVarlen, bool kAtomicDq>
__device__ __forceinline__ void attention_bwd_dkdv_wgmma_body(const BwdParams& p) {
  using T = typename Tr::T;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kD = Tr::kHeadDim, kDOut = Tr::kDOut;
  const int head_dim = valid_head_dim<Tr>(p);
  static_assert(Tr::kNWarps == 8 && kBlockN == 128 / Tr::kColGroups,
                "2 warpgroups of 64 keys, or of the same 64 keys and half the columns each (D = 256)");
  static_assert((kD == 128 && kBlockM == 64) || (kD == 64 && kBlockM == 128) || (kD == 256 && kBlockM == 64),
                "dQ splits one dimension in two");
  using KVTile = PanelTile<kBlockN>;
  using QTile = PanelTile<kBlockM>;
  // uniform_warp_index: at head dim 64 0-120 fewer SASS instructions a kernel, two injected
  // warpgroup arrives and most spills gone; not at 256, where it added spills.
  const int tid = threadIdx.x, lane = tid & 31;
  const int warp = Tr::kSplitCols ? tid >> 5 : uniform_warp_index();
  const KeyBlock<kBlockM, kBlockN, kMask, kVarlen> blk(p);
  if (blk.rows_k <= 0) return;  // past its sequence (varlen)
  const int hk = blk.hk, b = blk.b, n0 = blk.n0, rows_k = blk.rows_k, iterations = blk.iterations;

  const uint32_t sK = attention_smem_base();
  unsigned char* smem = attention_smem + (sK - smem_addr(attention_smem));
  const uint32_t sV = sK + Tr::kTileKVBytes;
  const uint32_t sStage0 = sV + Tr::kTileKVBytes;  // stage s: Q at sStage0 + 2 s tileQ, dO after it
  const uint32_t sDs = sStage0 + 4 * Tr::kTileQBytes;  // one dS^T a column group
  float* stage_floats0 =
      reinterpret_cast<float*>(smem + (sDs - sK) + Tr::kColGroups * Tr::kTileDsBytes);  // stage s: lse, D

  load_key_tiles<T, kBlockN, kD, Tr::kThreads, KVTile>(p, b, hk, blk.k_row0 + n0, rows_k, sK, sV, head_dim, tid);
  auto prefetch = [&](int it) {
    const uint32_t sQ = sStage0 + (it & 1) * 2 * Tr::kTileQBytes;
    load_query_tiles<T, kBlockM, kD, Tr::kThreads, QTile>(p, b, blk.head(it, p), blk.q_row0, blk.seqlen_q,
                                                          blk.row0(it), sQ, sQ + Tr::kTileQBytes,
                                                          stage_floats0 + (it & 1) * 2 * kBlockM, head_dim, tid);
  };

  float dk[kDOut / 2], dv[kDOut / 2];
#pragma unroll
  for (int i = 0; i < kDOut / 2; ++i) dk[i] = dv[i] = 0.f;

  if (iterations > 0) prefetch(0);
  cp_async_commit();
  // This warp's keys within the block; its column group's first output column.
  const int warp_row0 = (Tr::kSplitCols ? warp & 3 : warp) * 16;
  const int col0 = Tr::kSplitCols ? (warp >> 2) * kDOut : 0;

  for (int it = 0; it < iterations; ++it) {
    cp_async_wait<0>();
    fence_proxy_async_shared();  // this thread's cp.async writes, visible to wgmma's reads
    __syncthreads();             // stage it % 2 landed; every warpgroup is done with iteration it - 1
    if (it + 1 < iterations) prefetch(it + 1);
    cp_async_commit();
    const uint32_t sQ = sStage0 + (it & 1) * 2 * Tr::kTileQBytes;
    const uint32_t sdO = sQ + Tr::kTileQBytes;
    const float* s_lse = stage_floats0 + (it & 1) * 2 * kBlockM;
    const float* s_row_dot = s_lse + kBlockM;

    dkdv_wgmma_tile<Tr, kMask, kSoftcap, kAtomicDq, /*kPinZeros=*/(Tr::kHeadDim >= 128)>(p, blk, it, sK, sV, sQ, sdO, s_lse, s_row_dot, sDs,
                                                     smem + (sDs - sK), warp, lane, dk, dv, [] { __syncthreads(); },
                                                     DqAtomicAdd<Tr::kHeadDim>{});
  }

  // dK = scale * sum dS^T Q, dV = sum P^T dO: staged through this warp's own rows of the first tile.
  cp_async_wait<0>();
  __syncthreads();  // every warpgroup is done reading sK / sV
  float ones[1][2] = {{1.f, 1.f}}, scales[1][2] = {{p.scale, p.scale}};
  const int64_t key_row = blk.k_row0 + n0;
  T* gk = static_cast<T*>(p.grad_k) + b * p.dk_batch_stride + hk * p.dk_head_stride + key_row * p.dk_row_stride +
          col0;
  T* gv = static_cast<T*>(p.grad_v) + b * p.dv_batch_stride + hk * p.dv_head_stride + key_row * p.dv_row_stride +
          col0;
  // kSplitCols: column group g stages its 64 rows x kDOut in bytes [g, g + 1) x 64 kDOut 2 of sK / sV.
  const int stage = (col0 / kDOut) * 64 * kDOut * 2;
  store_rows<T, kDOut, 1>(reinterpret_cast<const float(&)[1][kDOut / 8][4]>(dk), scales, smem + stage, warp_row0, gk,
                          p.dk_row_stride, rows_k, head_dim - col0, lane);
  store_rows<T, kDOut, 1>(reinterpret_cast<const float(&)[1][kDOut / 8][4]>(dv), ones,
                          smem + Tr::kTileKVBytes + stage, warp_row0, gv, p.dv_row_stride, rows_k, head_dim - col0,
                          lane);
}
#endif  // FUSEFORGE_ATTENTION_WGMMA

// Deterministic dq: a block owns kBlockM queries of one (batch, head) and loops over key tiles;
// K/V tiles are double-buffered (K is read twice per tile: S = Q K^T and dQ += dS K).
template <class Tr, int kMask, bool kSoftcap, bool kVarlen>
__device__ __forceinline__ void attention_bwd_dq_body(const BwdParams& p) {
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
  const uint32_t sdO = sQ + Tr::kTileQBytes;
  const uint32_t sKV0 = sdO + Tr::kTileQBytes;  // stage s: K at sKV0 + s * 2 * tile, V after it

  const T* dout = blk.template rows<const T>(const_cast<void*>(p.grad_out), p.do_batch_stride, p.do_head_stride,
                                             p.do_row_stride, p);
  load_tile_async<kBlockM, kD, Tr::kThreads>(sQ, q, p.q_row_stride, rows_q, head_dim, tid);
  load_tile_async<kBlockM, kD, Tr::kThreads>(sdO, dout, p.do_row_stride, rows_q, head_dim, tid);
  auto prefetch = [&](int nb) {
    const int n0 = nb * kBlockN;
    const uint32_t sK = sKV0 + (nb & 1) * 2 * Tr::kTileKVBytes;
    load_tile_async<kBlockN, kD, Tr::kThreads>(sK, k + n0 * p.k_row_stride, p.k_row_stride, seqlen_k - n0, head_dim, tid);
    load_tile_async<kBlockN, kD, Tr::kThreads>(sK + Tr::kTileKVBytes, v + n0 * p.v_row_stride, p.v_row_stride,
                                               seqlen_k - n0, head_dim, tid);
  };
  if (n_begin < n_end) prefetch(n_begin);
  cp_async_commit();

  const int warp_row0 = warp * Tr::kRowsPerWarp;
  float lse_log2[kMT][2], row_dot[kMT][2];
  const int64_t row_base = blk.lse_row0;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = m0 + warp_row0 + mt * 16 + (lane >> 2) + hh * 8;
      lse_log2[mt][hh] = row < blk.seqlen_q ? lse_to_log2(p.lse[row_base + row]) : INFINITY;
      row_dot[mt][hh] = row < blk.seqlen_q ? p.row_dot[row_base + row] : 0.f;
    }
  float dq[kMT][kD / 8][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int dt = 0; dt < kD / 8; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) dq[mt][dt][e] = 0.f;
  const float scale_log2 = p.scale_log2;

  for (int nb = n_begin; nb < n_end; ++nb) {
    const int n0 = nb * kBlockN;
    cp_async_wait<0>();
    __syncthreads();  // K/V[nb] landed; every warp is done with stage (nb + 1) % 2
    if (nb + 1 < n_end) prefetch(nb + 1);
    cp_async_commit();
    const uint32_t sK = sKV0 + (nb & 1) * 2 * Tr::kTileKVBytes;
    const uint32_t sV = sK + Tr::kTileKVBytes;

    float s[kMT][kBlockN / 8][4], dp[kMT][kBlockN / 8][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kBlockN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = dp[mt][nt][e] = 0.f;
    warp_gemm_abt<T, kD, kMT, kBlockN>(s, sQ, warp_row0, sK, lane);
    // Softcap: s' = out tanh(in s), and its derivative 1 - tanh^2 for dS.
    float dtanh[kSoftcap ? kMT : 1][kSoftcap ? kBlockN / 8 : 1][4];
    if constexpr (kSoftcap) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float t = fast_tanh(p.softcap_in * s[mt][nt][e]);
            s[mt][nt][e] = p.softcap_out * t;
            dtanh[mt][nt][e] = fmaf(-t, t, 1.f);
          }
    }
    if (tile_needs_mask<kMask, kBlockM, kBlockN>(m0, n0, seqlen_k, offset, p))
      apply_mask<kMask, kMT, kBlockN>(s, m0 + warp_row0, n0, seqlen_k, offset, p, lane);
    warp_gemm_abt<T, kD, kMT, kBlockN>(dp, sdO, warp_row0, sV, lane);
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < kBlockN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hh = e >> 1;
          const float pr = fast_exp2(fmaf(s[mt][nt][e], scale_log2, -lse_log2[mt][hh]));
          s[mt][nt][e] = pr * (dp[mt][nt][e] - row_dot[mt][hh]);
          if constexpr (kSoftcap) s[mt][nt][e] *= dtanh[mt][nt][e];
        }
    warp_gemm_pb<T, kD, kMT, kBlockN>(dq, s, sK, lane);
  }

  cp_async_wait<0>();
  __syncthreads();
  float scales[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) scales[mt][0] = scales[mt][1] = p.scale;
  T* gq = blk.template rows<T>(p.grad_q, p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride, p);
  store_rows<T, kD, kMT>(dq, scales, smem, warp_row0, gq, p.dq_row_stride, rows_q, head_dim, lane);
}

template <class Tr, int kMask, bool kSoftcap, bool kVarlen, bool kAtomicDq>
__global__ void __launch_bounds__(Tr::kThreads) attention_bwd_dkdv_kernel(const __grid_constant__ BwdParams params) {
#if FUSEFORGE_ATTENTION_WGMMA
  attention_bwd_dkdv_wgmma_body<Tr, kMask, kSoftcap, kVarlen, kAtomicDq>(params);
#else
  // Head dim 256 has the wgmma body only; the launcher refuses it without sm_90a code.
  if constexpr (Tr::kSplitCols) {
    __trap();
  } else {
    attention_bwd_dkdv_mma_body<Tr, kMask, kSoftcap, kVarlen, kAtomicDq>(params);
  }
#endif
}

template <class Tr, int kMask, bool kSoftcap, bool kVarlen>
__global__ void __launch_bounds__(Tr::kThreads) attention_bwd_dq_kernel(const __grid_constant__ BwdParams params) {
  attention_bwd_dq_body<Tr, kMask, kSoftcap, kVarlen>(params);
}

// The dq kernel's tiles: Q and dO resident, two stages of K and V.
template <class Tr>
constexpr int dq_smem_bytes() {
  return 2 * Tr::kTileQBytes + 4 * Tr::kTileKVBytes;
}

}  // namespace fuseforge::attention
