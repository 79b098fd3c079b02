// Attention backward dk/dv kernel for sm_90a, warp-specialized like the forward
// (attention_fwd_warpspec.cuh): a producer warp issues TMA copies of the block's K and V once and of
// each query tile's Q and dO into a 2-stage ring, and copies the tile's lse and row_dot; two consumer
// warpgroups (64 keys each, registers raised) run the tile's products (dkdv_wgmma_tile, the same
// code as the cp.async kernel) and free the stage with one arrive a thread. dS^T is double-buffered,
// so the one barrier a tile left is the named barrier between the consumers before dQ = dS K reads
// both warpgroups' keys. dQ goes to dq_accum as FlashAttention-3 does it: each consumer warp stores
// its 16 x 64 block to its own 4 KB of shared memory and one lane hands it to the TMA unit as a bulk
// float32 reduction, instead of 8 vector atomics a thread. The row_dot, dq-convert and deterministic
// dq kernels are the cp.async path's.
#pragma once
#include "attention/sm80/attention_bwd_kernel.cuh"
#include "attention/sm90/attention_fwd_warpspec.cuh"

namespace fuseforge::attention {

// Head dim 128 (64-query tiles, or 80 with dQ transposed: BwdConfig::FullTraits, bwd_query_rows_d128)
// and 64 (128-query tiles) run this kernel, 256 the cp.async one
// (head dim 64 here: forward+backward 7-12% faster on the H100 than the cp.async kernel, see
// use_bwd_warpspec).
template <int kD>
constexpr bool bwd_warpspec_head_dim() {
  return kD == 128 || kD == 64;
}

struct BwdTmaParams {
  CUtensorMap q, k, v, dout;
};

template <class Tr>
struct WarpSpecBwdLayout {
  static constexpr int kStages = 2;
  static constexpr int kThreads = 384, kConsumerThreads = 256;
  static constexpr int kHeadDim = Tr::kHeadDim;
  static constexpr int kPanels = Tr::kHeadDim / 64;
  // From the 1024-byte-aligned base: K, V; kStages x (Q, dO); kStages x (lse, row_dot); 2 x dS^T;
  // 8 consumer warps x 4 KB of dQ (the bulk reductions' source); the mbarriers (full_kv, full[s],
  // empty[s]).
  static constexpr int kStagesOffset = 2 * Tr::kTileKVBytes;
  static constexpr int kStageBytes = 2 * Tr::kTileQBytes;
  static constexpr int kFloatsOffset = kStagesOffset + kStages * kStageBytes;
  static constexpr int kFloatsBytes = 2 * Tr::kBlockM * 4;
  // 80-query tiles (kTransposedDq) take 227 KB to the byte with the mbarriers in the gap before dS^T.
  static constexpr int kBarriersAfterFloats = Tr::kTransposedDq;
  static constexpr int kFloatsEnd = kFloatsOffset + kStages * kFloatsBytes;
  static constexpr int kBarriersBytes = 8 * (1 + 2 * kStages);
  static constexpr int kDsOffset =
      (kFloatsEnd + (kBarriersAfterFloats ? kBarriersBytes : 0) + 1023) / 1024 * 1024;
  static constexpr int kDqOffset = kDsOffset + 2 * Tr::kTileDsBytes;
  // A consumer warp's dQ: 16 rows x 64 columns, or (kTransposedDq) 16 columns x kBlockM rows, in
  // kDqUnits 1 KB units of 16 rows (attention_dq_convert_transposed_kernel).
  static constexpr bool kTransposedDq = Tr::kTransposedDq;
  static constexpr int kDqWarpBytes = (Tr::kTransposedDq ? Tr::kBlockM : 64) * 16 * 4;
  static constexpr int kDqUnits = Tr::kBlockM / 16;
  static constexpr int kDqEnd = kDqOffset + 8 * kDqWarpBytes;
  static constexpr int kBarriersOffset = kBarriersAfterFloats ? kFloatsEnd : kDqEnd;
  static constexpr int kSmemBytes = 1024 + (kBarriersAfterFloats ? kDqEnd : kBarriersOffset + kBarriersBytes);
  static_assert(kSmemBytes <= 227 * 1024, "fits an H100 SM's shared memory");
  // Registers a thread (setmaxnreg): the block starts with 384 x 168; the consumers' increase must
  // come out of what the producer gives back, or setmaxnreg.inc waits forever.
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static_assert(128 * kProducerRegs + kConsumerThreads * kConsumerRegs <= kThreads * 168, "register pool");
};

#if FUSEFORGE_ATTENTION_WGMMA
// The consumer warp's dQ rows (see DqAtomicAdd) through its 4 KB of shared memory (same layout as the
// 4 KB of dq_accum from `tile`) into dq_accum by one bulk reduction, issued and tracked by lane 0; the
// next tile's stores first wait until the TMA unit has read the buffer (long done by then).
// The hand-off (the proxy fence that makes the stores visible to the TMA unit, then the reduction)
// waits until the stores have left the thread: at the end of the tile it stalled the warp (~6% of
// the kernel's stall samples, ncu at D128/S4096), so flush() issues it under the next tile's dV
// product (dkdv_wgmma_tile) and once after the last tile.
// Each step keeps ptxas from serializing the consumers' wgmmas (C7512; they run at 240 registers):
// the buffer address is recomputed, not held across the loop; the stores are 8 bytes (16-byte ones
// need 4-aligned register quads); nothing branches on the lane or on `valid` (predicated instead).
template <class L>
struct DqBulkAdd {
  __device__ __forceinline__ static uint32_t buffer() {
    // attention_smem_base() spelled out: through the helper ptxas schedules these kernels differently
    // (same results, SASS not identical), and that schedule has not been timed.
    return ((smem_addr(attention_smem) + 1023) & ~1023u) + L::kDqOffset +
           (threadIdx.x / 32 - 4) * L::kDqWarpBytes;  // consumer warps are 4..11
  }
  // The hand-off of the rows stored for `target` (dq_target of the tile that stored them). 80-query
  // tiles (kTransposedDq): the tile's 16-row units that start within Sq, contiguous in the warp's
  // panel (dq_accum_panel_unit; the tile may start at any multiple of 16 rows: KeyBlock).
  __device__ __forceinline__ void flush(const DqTarget& target) const {
    fence_proxy_async_shared();  // the stores, visible to the TMA unit's reads
    __syncwarp();
    const uint32_t bytes = L::kTransposedDq ? min(target.units, L::kDqUnits) * 1024 : L::kDqWarpBytes;
    bulk_reduce_add_f32(target.valid && (threadIdx.x & 31) == 0, target.tile, buffer(), bytes);
  }
  // Stores the rows; their tile and `valid` come back to flush() one tile later.
  // kTransposedDq (40 floats, dQ^T): float4 j of lane l at 16 (32 j + l), so 16-row unit j / 2 is the
  // 1 KB at j / 2 KB, the layout of the warp's panel (dq_accum_panel_unit).
  __device__ __forceinline__ void operator()(const float (&dq)[40], float*, int lane, bool) const {
    const uint32_t buf = buffer();
    bulk_wait_group_read_all();
    __syncwarp();
#pragma unroll
    for (int j = 0; j < 10; ++j)
      asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(buf + 16 * (32 * j + lane)), "f"(dq[4 * j]),
                   "f"(dq[4 * j + 1]), "f"(dq[4 * j + 2]), "f"(dq[4 * j + 3])
                   : "memory");
  }
  __device__ __forceinline__ void operator()(const float (&dq)[32], float*, int lane, bool) const {
    const uint32_t buf = buffer();
    // Where dq_swap_halves: lanes with bit 3 set store row r + 8's pair first, so a half-warp's 8-byte
    // stores cover all 32 banks once.
    const uint32_t half = dq_swap_halves<L::kHeadDim>() ? (lane & 8) : 0;
    bulk_wait_group_read_all();
    __syncwarp();
#pragma unroll
    for (int j = 0; j < 16; ++j)
      asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(buf + 16 * (32 * (j / 2) + lane) + ((8 * (j % 2)) ^ half)),
                   "f"(dq[2 * j]), "f"(dq[2 * j + 1])
                   : "memory");
  }
};

// The warp-specialized dk/dv kernel's shared memory (WarpSpecBwdLayout): the tiles, the stages and
// the mbarriers.
template <class Tr>
struct WarpSpecBwdSmem {
  using L = WarpSpecBwdLayout<Tr>;
  uint32_t sK, sV, bars;
  unsigned char* smem;  // generic pointer to sK
  __device__ __forceinline__ WarpSpecBwdSmem() : sK(attention_smem_base()) {
    smem = attention_smem + (sK - smem_addr(attention_smem));
    sV = sK + Tr::kTileKVBytes;
    bars = sK + L::kBarriersOffset;
  }
  __device__ __forceinline__ uint32_t sQ(int s) const { return sK + L::kStagesOffset + s * L::kStageBytes; }
  __device__ __forceinline__ float* floats(int s) const {
    return reinterpret_cast<float*>(smem + L::kFloatsOffset + s * L::kFloatsBytes);
  }
  __device__ __forceinline__ uint32_t full_kv() const { return bars; }
  __device__ __forceinline__ uint32_t full(int s) const { return bars + 8 * (1 + s); }
  __device__ __forceinline__ uint32_t empty(int s) const { return bars + 8 * (1 + L::kStages + s); }
  // Thread 0 initializes the mbarriers, then the block syncs. full_kv: the K / V copies' arrive, and
  // with dq_accum zeroed in the kernel the zeroing warp's (dq_zero_wait).
  __device__ __forceinline__ void init_barriers(int tid, bool zero_dq) const {
    if (tid == 0) {
      mbarrier_init(full_kv(), zero_dq ? 2 : 1);
      for (int s = 0; s < L::kStages; ++s) {
        mbarrier_init(full(s), 32);  // the producer warp's lanes, after their lse / row_dot stores
        // Every consumer thread arrives after its last read of the stage (its lse / row_dot reads are
        // generic loads of what the producer wrote with generic stores).
        mbarrier_init(empty(s), L::kConsumerThreads);
      }
      fence_mbarrier_init();
    }
    __syncthreads();
  }
};

// Lane 0 of the producer: K and V of key block `blk` (of K / V head kv_head) on full_kv.
template <class Tr, class L, class Blk>
__device__ __forceinline__ void load_key_block(const BwdTmaParams& tma, const Blk& blk, int kv_head, int batch,
                                               uint32_t sK, uint32_t sV, uint32_t full_kv) {
  using KVTile = PanelTile<Tr::kBlockN>;
  mbarrier_arrive_expect_tx(full_kv, 2 * Tr::kTileKVBytes);
  const int key_row = blk.k_row0 + blk.n0;
#pragma unroll
  for (int c = 0; c < L::kPanels; ++c) {
    tma_load_4d(sK + c * KVTile::kPanelBytes, &tma.k, full_kv, c * 64, key_row, kv_head, batch);
    tma_load_4d(sV + c * KVTile::kPanelBytes, &tma.v, full_kv, c * 64, key_row, kv_head, batch);
  }
}

// The producer warp: query tile `it` of `blk` into a stage (Q and dO by TMA from lane 0; lse and
// row_dot copied by every lane), then its arrive on the stage's full barrier.
template <class Tr, class L, class Blk>
__device__ __forceinline__ void load_query_tile(const BwdParams& p, const BwdTmaParams& tma, const Blk& blk, int it,
                                                int batch, uint32_t sQ, float* f, uint32_t full, int lane) {
  using QTile = PanelTile<Tr::kBlockM>;
  constexpr int kBlockM = Tr::kBlockM;
  const int h = blk.head(it, p), m0 = blk.row0(it);
  if (lane == 0) {
    mbarrier_expect_tx(full, 2 * Tr::kTileQBytes);
    const int row = blk.q_row0 + m0;
#pragma unroll
    for (int c = 0; c < L::kPanels; ++c) {
      tma_load_4d(sQ + c * QTile::kPanelBytes, &tma.q, full, c * 64, row, h, batch);
      tma_load_4d(sQ + Tr::kTileQBytes + c * QTile::kPanelBytes, &tma.dout, full, c * 64, row, h, batch);
    }
  }
  // lse in base 2 (+inf past Sq, so P = 0 there: TMA rows past a varlen sequence hold the next
  // one's queries) and row_dot.
  const int64_t row_base = blk.b * p.lse_batch_stride + h * p.lse_head_stride + blk.q_row0 + m0;
  for (int r = lane; r < kBlockM; r += 32) {
    const bool valid = m0 + r < blk.seqlen_q;
    f[r] = valid ? lse_to_log2(p.lse[row_base + r]) : INFINITY;
    f[kBlockM + r] = valid ? p.row_dot[row_base + r] : 0.f;
  }
  mbarrier_arrive(full);
}

// A consumer warp: dK = scale * sum dS^T Q and dV = sum P^T dO of its 16 keys, staged through its
// own rows of the tiles at stage_k / stage_v.
template <class Tr, class Blk>
__device__ __forceinline__ void store_dk_dv(const BwdParams& p, const Blk& blk, const float (&dk)[Tr::kHeadDim / 2],
                                            const float (&dv)[Tr::kHeadDim / 2], unsigned char* stage_k,
                                            unsigned char* stage_v, int cwarp, int lane) {
  using T = typename Tr::T;
  constexpr int kD = Tr::kHeadDim;
  const int head_dim = valid_head_dim<Tr>(p);
  float ones[1][2] = {{1.f, 1.f}}, scales[1][2] = {{p.scale, p.scale}};
  const int64_t key_row = blk.k_row0 + blk.n0;
  T* gk = static_cast<T*>(p.grad_k) + blk.b * p.dk_batch_stride + blk.hk * p.dk_head_stride + key_row * p.dk_row_stride;
  T* gv = static_cast<T*>(p.grad_v) + blk.b * p.dv_batch_stride + blk.hk * p.dv_head_stride + key_row * p.dv_row_stride;
  store_rows<T, kD, 1>(reinterpret_cast<const float(&)[1][kD / 8][4]>(dk), scales, stage_k, cwarp * 16, gk,
                       p.dk_row_stride, blk.rows_k, head_dim, lane);
  store_rows<T, kD, 1>(reinterpret_cast<const float(&)[1][kD / 8][4]>(dv), ones, stage_v, cwarp * 16, gv,
                       p.dv_row_stride, blk.rows_k, head_dim, lane);
}

// A consumer thread: query tile `it` of `blk` from stage s, once it has landed (`parity`), then the
// stage's release.
template <class Tr, int kMask, bool kSoftcap, bool kAtomicDq, class Blk>
__device__ __forceinline__ void consume_query_tile(const BwdParams& p, const WarpSpecBwdSmem<Tr>& sm, const Blk& blk,
                                                   int it, int s, int parity, int cwarp, int lane,
                                                   float (&dk)[Tr::kHeadDim / 2], float (&dv)[Tr::kHeadDim / 2],
                                                   const DqBulkAdd<WarpSpecBwdLayout<Tr>>& dq_add) {
  using L = WarpSpecBwdLayout<Tr>;
  mbarrier_wait(sm.full(s), parity);
  const uint32_t sDs = sm.sK + L::kDsOffset + (it & 1) * Tr::kTileDsBytes;
  dkdv_wgmma_tile<Tr, kMask, kSoftcap, kAtomicDq, /*kPinZeros=*/true>(
      p, blk, it, sm.sK, sm.sV, sm.sQ(s), sm.sQ(s) + Tr::kTileQBytes, sm.floats(s), sm.floats(s) + Tr::kBlockM, sDs,
      sm.smem + (sDs - sm.sK), cwarp, lane, dk, dv, [] { named_barrier_sync(1, L::kConsumerThreads); }, dq_add);
  mbarrier_arrive(sm.empty(s));  // this thread is done with stage s
}

// A consumer thread after a key block's last tile: that tile's dQ hand-off, and the wait until the
// TMA unit has read every reduction's shared memory.
template <class Tr, bool kAtomicDq, class Blk>
__device__ __forceinline__ void finish_dq(const BwdParams& p, const Blk& blk, int cwarp,
                                          const DqBulkAdd<WarpSpecBwdLayout<Tr>>& dq_add) {
  if (kAtomicDq) {
    if (blk.iterations > 0) dq_add.flush(dq_target<Tr>(p, blk, blk.iterations - 1, cwarp));
    bulk_wait_group_all();
  }
}

// dq_accum's zeroing in the kernel (BwdParams::dq_zero_ahead, the grid in its default order), by one
// warp of the producer warpgroup, idle otherwise. Every real block (DqZeroRow: varlen, those within
// their sequence) zeroes the unit of real block u + dq_zero_ahead and counts it in that block's grid
// row; dq_zero_ahead >= a row's blocks, so a block waits only on blocks of lower index, which have
// started (blocks start in index order) and whose zeroing waits on lower ones still: no cycle. The
// units of the first dq_zero_ahead real blocks are the zero-first kernel's (counted as done).
// docs/design/attention.md has its timings.
template <class Tr, bool kVarlen>
__device__ __forceinline__ void dq_zero_ahead(const BwdParams& p, int lane) {
  const DqZeroRow row = dq_zero_row<kVarlen>(p, blockIdx.y, blockIdx.z, gridDim.x);
  const int u = row.first + blockIdx.x + static_cast<int>(p.dq_zero_ahead);
  // (A block past its sequence, varlen, is no real block and owes nothing.)
  if (static_cast<int>(blockIdx.x) >= row.blocks || u >= dq_zero_units<kVarlen>(p, gridDim.x)) return;
  const DqZeroUnit unit = dq_zero_unit<kVarlen>(p, u, gridDim.x);
  zero_dq_accum_unit<Tr::kHeadDim, Tr::kTransposedDq>(p, unit, lane, 32);
  fence_proxy_async_global();  // the zeros, ordered before the bulk reductions (async proxy) into them
  __syncwarp();
  if (lane == 0) {
    __threadfence();
    atomicAdd(p.dq_zero_counts + unit.row, 1);
  }
}
// Lane 0: until this block's grid row has its units zeroed (those of real blocks past dq_zero_ahead
// counted), then an arrive on full_kv, which the consumers wait on before their first reduction.
template <bool kVarlen>
__device__ __forceinline__ void dq_zero_wait(const BwdParams& p, uint32_t full_kv, int lane) {
  if (lane != 0) return;
  const DqZeroRow row = dq_zero_row<kVarlen>(p, blockIdx.y, blockIdx.z, gridDim.x);
  // Units of real blocks below dq_zero_ahead are the zero-first kernel's.
  const int64_t first_counted = p.dq_zero_ahead - row.first;
  const int expected = first_counted <= 0 ? row.blocks : first_counted >= row.blocks ? 0 : row.blocks - first_counted;
  if (expected > 0) {
    while (load_acquire_gpu(p.dq_zero_counts + blockIdx.y + gridDim.y * blockIdx.z) < expected) __nanosleep(100);
    fence_proxy_async_global();
  }
  mbarrier_arrive(full_kv);
}

template <class Tr, int kMask, bool kSoftcap, bool kVarlen, bool kAtomicDq>
__device__ __forceinline__ void attention_bwd_dkdv_warpspec_body(const BwdParams& p, const BwdTmaParams& tma) {
  using L = WarpSpecBwdLayout<Tr>;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kD = Tr::kHeadDim, kStages = L::kStages;
  static_assert(kBlockN == 128 && Tr::kNWarps == 8, "2 consumer warpgroups of 64 keys");
  static_assert((kD == 128 && (kBlockM == 64 || kBlockM == 80)) || (kD == 64 && kBlockM == 128),
                "dQ splits one dimension in two");
  const int tid = threadIdx.x, lane = tid & 31, warp = uniform_warp_index();
  // Launched overlapping the kernel before it (launch_attention_bwd's `overlap`: the row_dot or
  // zero-first kernel): every thread waits for it before touching memory it writes (row_dot, dq_accum, the
  // zeroing counts), the K / V copies go out before. The dq convert kernel may start as SMs free up.
  grid_dependents_may_launch();
  const KeyBlock<kBlockM, kBlockN, kMask, kVarlen> blk(p);
  const bool zero_dq = kAtomicDq && p.dq_zero_ahead > 0;
  if (blk.rows_k <= 0) {  // past its sequence (varlen): the whole block leaves before any barrier
    // (With every such block waiting, the packed documents' backward, 65% of its blocks past their
    // document, timed 2.2% slower with the overlap: notes.)
    grid_dependency_wait_on_early_exit();
    // (The zeroing call returns at once here: no real block. But with it on this path ptxas keeps the
    // 80-query kernel's loop bound in a register: without it, one spill.)
    if (zero_dq && warp == 1) dq_zero_ahead<Tr, kVarlen>(p, lane);
    return;
  }
  const int iterations = blk.iterations;
  const WarpSpecBwdSmem<Tr> sm;
  sm.init_barriers(tid, zero_dq);

  if (warp < 4) {  // producer warpgroup: warp 0 loads, warp 1 zeroes dq_accum (if so), the others leave
    setmaxnreg_dec<L::kProducerRegs>();
    if (warp == 1 && zero_dq) {  // returns: nothing of warp 0's stays live across the zeroing (24 registers)
      grid_dependency_wait();
      dq_zero_wait<kVarlen>(p, sm.full_kv(), lane);
      dq_zero_ahead<Tr, kVarlen>(p, lane);
      return;
    }
    if (warp != 0) return;
    const int batch = kVarlen ? 0 : blk.b;
    if (lane == 0) {
      prefetch_tma_map(&tma.q);
      prefetch_tma_map(&tma.dout);
      load_key_block<Tr, L>(tma, blk, p.kv_source_head(blk.hk), batch, sm.sK, sm.sV, sm.full_kv());
    }
    grid_dependency_wait();  // row_dot (load_query_tile)
    for (int it = 0; it < iterations; ++it) {
      const int s = it % kStages;
      mbarrier_wait(sm.empty(s), ((it / kStages) & 1) ^ 1);
      load_query_tile<Tr, L>(p, tma, blk, it, batch, sm.sQ(s), sm.floats(s), sm.full(s), lane);
    }
    return;
  }

  setmaxnreg_inc<L::kConsumerRegs>();
  grid_dependency_wait();  // dq_accum zeroed (by the row_dot kernel, or the zero-first kernel's units)
  const int cwarp = warp - 4;  // consumer warp 0..7: keys [16 cwarp, +16) of the block
  float dk[kD / 2], dv[kD / 2];
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) dk[i] = dv[i] = 0.f;
  mbarrier_wait(sm.full_kv(), 0);  // also when no tile runs: the copies must land before the stores below
  const DqBulkAdd<L> dq_add;
  for (int it = 0; it < iterations; ++it)
    consume_query_tile<Tr, kMask, kSoftcap, kAtomicDq>(p, sm, blk, it, it % kStages, (it / kStages) & 1, cwarp, lane,
                                                       dk, dv, dq_add);
  finish_dq<Tr, kAtomicDq>(p, blk, cwarp, dq_add);  // before leaving

  // dK = scale * sum dS^T Q, dV = sum P^T dO: staged through this warp's own rows of sK / sV, once both
  // consumer warpgroups are done reading them (dQ = dS K reads all of sK).
  named_barrier_sync(1, L::kConsumerThreads);
  store_dk_dv<Tr>(p, blk, dk, dv, sm.smem, sm.smem + Tr::kTileKVBytes, cwarp, lane);
}

#endif  // FUSEFORGE_ATTENTION_WGMMA

template <class Tr, int kMask, bool kSoftcap, bool kVarlen, bool kAtomicDq>
__global__ void __launch_bounds__(WarpSpecBwdLayout<Tr>::kThreads, 1)
    attention_bwd_dkdv_warpspec_kernel(const __grid_constant__ BwdParams params,
                                       const __grid_constant__ BwdTmaParams tma) {
#if FUSEFORGE_ATTENTION_WGMMA
  attention_bwd_dkdv_warpspec_body<Tr, kMask, kSoftcap, kVarlen, kAtomicDq>(params, tma);
#else
  __trap();  // no sm_90a code: the launcher does not pick this kernel (sm90a_kernels_runnable)
#endif
}

// Whether the warp-specialized dk/dv kernel serves this call (tma filled in then).
// Head dim 64, against the cp.async kernel (H100, A B B A): forward+backward D64/S1024 full 2.82 ->
// 2.58 ms, causal 1.93 -> 1.80, S16384 full 38.97 -> 34.89, causal 18.36 -> 16.15. It needs the
// accumulators' zeros pinned before the fence (dkdv_wgmma_tile's kPinZeros): without them ptxas
// serializes the atomic kernels' wgmmas (C7512) and they spill (384 bytes; 3.5% slower than the
// cp.async kernel at S16384/full).
// Q's and dO's maps, boxes of Tr::kBlockM rows (the 80-query kernel takes the K / V maps of the
// 64-query one: the same 128-row boxes).
template <class Tr>
bool encode_bwd_query_maps(const BwdParams& p, BwdTmaParams* tma) {
  using T = typename Tr::T;
  return encode_rows_map<T>(&tma->q, p, p.q, p.rows_q, p.heads_q, p.q_row_stride, p.q_head_stride, p.q_batch_stride,
                            Tr::kBlockM) &&
         encode_rows_map<T>(&tma->dout, p, p.grad_out, p.rows_q, p.heads_q, p.do_row_stride, p.do_head_stride,
                            p.do_batch_stride, Tr::kBlockM);
}
template <class Tr>
bool use_bwd_warpspec(const BwdParams& p, BwdTmaParams* tma) {
  using T = typename Tr::T;
  if (!bwd_warpspec_head_dim<Tr::kHeadDim>()) return false;
  if (!tma_kernels_allowed()) return require_tma(false);
  return require_tma(
      encode_bwd_query_maps<Tr>(p, tma) &&
      encode_rows_map<T>(&tma->k, p, p.k, p.rows_k, p.kv_source_heads(), p.k_row_stride, p.k_head_stride,
                         p.k_batch_stride, Tr::kBlockN) &&
      encode_rows_map<T>(&tma->v, p, p.v, p.rows_k, p.kv_source_heads(), p.v_row_stride, p.v_head_stride,
                         p.v_batch_stride, Tr::kBlockN));
}

// row_dot_params: the problem as the row_dot kernel sees it (varlen: one sequence of total_q rows,
// whose row index is the lse layout's). The dk/dv kernel is the warp-specialized one where
// use_bwd_warpspec says so, else the cp.async one. FullTr: the warp-specialized kernel's tiles on the
// atomic path (80 queries at head dim 128 without a softcap, BwdConfig; else DkdvTr's), where
// bwd_query_rows_d128 picks 80 (dq_accum's 16-row units take any 80-query tile: dq_accum_panel_unit).
template <class DkdvTr, class DqTr, class FullTr, bool kSoftcap>
void launch_attention_bwd(const BwdParams& params, const BwdParams& row_dot_params, bool local, bool deterministic) {
  using T = typename DkdvTr::T;
  constexpr int kD = DkdvTr::kHeadDim;
  static_assert(dq_smem_bytes<DqTr>() <= 227 * 1024, "fits an H100 SM's shared memory");
  if constexpr (DkdvTr::kSplitCols) {
    TORCH_CHECK(sm90a_kernels_runnable(),
                "attention backward with head dim 256 needs a compute capability 9.0 GPU (H100, H200) and a "
                "build for TORCH_CUDA_ARCH_LIST=9.0a (its kernel is sm_90a code only)");
  }
  // Causal: key block 0 of a head sees every query, the last one few. When the grid is a few waves
  // (GQA: each block loops over the group's heads, so the grid is small and its blocks long), the
  // launch order decides the tail: key blocks slowest (grid z) starts every head's heaviest block
  // first and leaves the short ones for the last wave. Measured on the H100:
  // the 1.2B Llama's step (2.9 waves) 29.5 -> 24.0 ms in this kernel; on the benchmark's 31-wave
  // grids the default order (a head's key blocks side by side, sharing its Q/dO tiles in L2) is 3-5%
  // faster; at 7.75 waves (GQA softcap, S4096) the default order is 8% faster on the
  // warp-specialized kernel (3.31 -> 3.06 ms fwd+bwd) and 5.5% slower on head dim 256's cp.async one
  // (3.67 -> 3.89). So key blocks slowest up to 4 waves on the warp-specialized kernel (between the
  // measured 2.9 and 7.75), up to 8 on the others. Packed documents (varlen, ~90 waves of blocks,
  // most past their document) measured 1.55x slower with key blocks slowest. (Applied to every local
  // mask; a sliding window's key blocks weigh about the same, so the order matters little.)
  const int64_t kv_blocks = ceil_div(params.seqlen_k, DkdvTr::kBlockN);
  const int64_t blocks = kv_blocks * params.heads_kv * params.batch;
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  BwdParams p = params;
  p.bwd_row_align = bwd_row_align();
  BwdTmaParams tma;
  const bool warpspec = use_bwd_warpspec<DkdvTr>(p, &tma);
  BwdTmaParams full_tma = tma;
  bool full_tiles = false;
  if constexpr (FullTr::kTransposedDq) {
    static_assert(FullTr::kBlockN == DkdvTr::kBlockN, "the K / V maps are DkdvTr's");
    full_tiles = warpspec && !deterministic && bwd_query_rows_d128(params, local) == FullTr::kBlockM &&
                 require_tma(encode_bwd_query_maps<FullTr>(p, &full_tma));
  }
  int64_t smem_bytes = DkdvTr::kSmemBytes;
  if constexpr (bwd_warpspec_head_dim<kD>())
    if (warpspec) smem_bytes = WarpSpecBwdLayout<DkdvTr>::kSmemBytes;
  const int64_t resident = static_cast<int64_t>(prop->multiProcessorCount) *
                           std::max<int64_t>(1, prop->sharedMemPerMultiprocessor /
                                                    (smem_bytes + prop->reservedSharedMemPerBlock));
  p.kv_block_slowest = bwd_kv_block_slowest(local, blocks, resident, kv_blocks, warpspec ? 4 : 8);
  const dim3 grid_kv = p.kv_block_slowest
                           ? dim3(static_cast<unsigned>(params.heads_kv), static_cast<unsigned>(params.batch),
                                  static_cast<unsigned>(kv_blocks))
                           : dim3(static_cast<unsigned>(kv_blocks), static_cast<unsigned>(params.heads_kv),
                                  static_cast<unsigned>(params.batch));
  // dq_accum zeroed by the warp-specialized dk/dv kernel (BwdParams::dq_zero_ahead) in its default
  // order; else by the row_dot kernel. (Varlen: `blocks` counts grid slots, the real blocks' bound.)
  static_assert(DkdvTr::kBlockN == kBwdZeroKeyBlockRows || !bwd_warpspec_head_dim<kD>(),
                "key_block_prefix counts the warp-specialized kernel's key blocks");
  const bool zero_in_dkdv = !deterministic && warpspec && !p.kv_block_slowest &&
                            (params.cu_seqlens_q == nullptr || params.key_block_prefix != nullptr);
  p.dq_zero_ahead = zero_in_dkdv ? bwd_dq_zero_ahead(blocks, resident, kv_blocks) : 0;
  // Programmatic dependent launches (launch_kernel_ex): the zero-first, warp-specialized dk/dv and dq
  // convert kernels start under the tail of the kernel before them, which lets them launch early.
  const bool overlap = bwd_overlap_launches();
  BwdParams row_dot_p = row_dot_params;
  if (p.dq_zero_ahead > 0) row_dot_p.dq_accum = nullptr;
  const int64_t rows = static_cast<int64_t>(row_dot_p.batch) * row_dot_p.heads_q * row_dot_p.seqlen_q;
  launch_kernel(attention_row_dot_kernel<T, kD>, dim3(static_cast<unsigned>(ceil_div(rows * (kD / 8), 256))),
                dim3(256), 0, row_dot_p);
  // The units no dk/dv block zeroes ahead, and the grid rows' counts.
  auto zero_first = [&]<class Tr, bool kVarlen>() {
    if (p.dq_zero_ahead == 0) return;
    launch_kernel_ex(overlap, attention_dq_zero_first_kernel<kD, Tr::kTransposedDq, kVarlen>,
                  dim3(static_cast<unsigned>(p.dq_zero_ahead)), dim3(256), 0, p, static_cast<int>(kv_blocks),
                  static_cast<int>(params.heads_kv * params.batch));
  };
  auto launch_dkdv = [&]<int kMask, bool kVarlen, bool kAtomicDq>() {
    // Nested: a condition on FullTr alone discards the branch when the launcher is instantiated (the
    // kernel and its layout exist for 80-query tiles only).
    if constexpr (FullTr::kTransposedDq) {
      if constexpr (kAtomicDq) {
        if (full_tiles) {
          zero_first.template operator()<FullTr, kVarlen>();
          launch_kernel_ex(overlap, attention_bwd_dkdv_warpspec_kernel<FullTr, kMask, kSoftcap, kVarlen, kAtomicDq>,
                           grid_kv, dim3(WarpSpecBwdLayout<FullTr>::kThreads), WarpSpecBwdLayout<FullTr>::kSmemBytes, p,
                           full_tma);
          return;
        }
      }
    }
    if constexpr (bwd_warpspec_head_dim<kD>()) {
      if (warpspec) {
        using L = WarpSpecBwdLayout<DkdvTr>;
        if constexpr (kAtomicDq) zero_first.template operator()<DkdvTr, kVarlen>();
        launch_kernel_ex(overlap, attention_bwd_dkdv_warpspec_kernel<DkdvTr, kMask, kSoftcap, kVarlen, kAtomicDq>,
                         grid_kv, dim3(L::kThreads), L::kSmemBytes, p, tma);
        return;
      }
    }
    launch_kernel(attention_bwd_dkdv_kernel<DkdvTr, kMask, kSoftcap, kVarlen, kAtomicDq>, grid_kv,
                  dim3(DkdvTr::kThreads), DkdvTr::kSmemBytes, p);
  };
  dispatch_mask_varlen(params, local, [&]<int kMask, bool kVarlen>() {
    if (deterministic) {
      launch_dkdv.template operator()<kMask, kVarlen, false>();
      const dim3 grid_q(static_cast<unsigned>(ceil_div(params.seqlen_q, DqTr::kBlockM)),
                        static_cast<unsigned>(params.heads_q), static_cast<unsigned>(params.batch));
      launch_kernel(attention_bwd_dq_kernel<DqTr, kMask, kSoftcap, kVarlen>, grid_q, dim3(DqTr::kThreads),
                    dq_smem_bytes<DqTr>(), params);
    } else {
      launch_dkdv.template operator()<kMask, kVarlen, true>();
      if constexpr (FullTr::kTransposedDq) {
        if (full_tiles) {
          const dim3 grid_tiles(static_cast<unsigned>(ceil_div(params.seqlen_q, FullTr::kBlockM)),
                                static_cast<unsigned>(params.heads_q), static_cast<unsigned>(params.batch));
          launch_kernel_ex(overlap, attention_dq_convert_transposed_kernel<T, FullTr::kBlockM, kVarlen>, grid_tiles,
                           dim3(256), 0, params);
          return;
        }
      }
      const dim3 grid_convert(static_cast<unsigned>(ceil_div(ceil_div(params.seqlen_q, 16) * kD, 256)),
                              static_cast<unsigned>(params.heads_q), static_cast<unsigned>(params.batch));
      launch_kernel_ex(overlap, attention_dq_convert_kernel<T, kD, kVarlen>, grid_convert, dim3(256), 0, params);
    }
  });
}

}  // namespace fuseforge::attention
