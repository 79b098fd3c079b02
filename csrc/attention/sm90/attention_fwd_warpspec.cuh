// Attention forward for sm_90a, warp-specialized (FlashAttention-3's structure, our code): a
// producer warpgroup issues TMA copies of Q and a 2-stage ring of K/V tiles, tracked by mbarriers,
// and gives its registers to the consumer warpgroups (setmaxnreg; two, three at head dim 64) that run
// wgmma and the online softmax on 64 query rows each. No block-wide barrier per key tile: a consumer waits only for the
// stage it reads, and frees it with one arrive a warp. Optionally the consumers ping-pong (named
// barriers): one warpgroup issues its products while another runs its softmax.
//
// A consumer warpgroup over key tiles 0..n-1: S(0), softmax(0); for each i >= 1 the products S(i)
// and O += P(i-1) V(i-1) issued together, then softmax(i); last, O += P(n-1) V(n-1). K and V of a
// stage are freed separately: K(i) once S(i) has run, so the producer loads K(i + 2) a whole
// iteration before it is needed (with one barrier a stage, K(i + 1) waits for P(i-1) V(i-1) and
// the consumers wait for it: ~9% of their stall samples in ncu at D128/S4096).
// The epilogue stages each warp's 16 rows of O in the panels' 128-byte-swizzle layout and lane 0
// stores them as TMA boxes, so the warp goes on to the next tile instead of issuing the stores
// itself (H100: forward D128/S1024 -2.4%, D64/S1024 -1.5%, level at S16384). Varlen
// calls, and outs whose strides a tensor map cannot describe, keep the stores (a box would write rows
// of the next sequence).
// The mma.sync/cp.async forward (attention_fwd_kernel.cuh) remains for shapes TMA cannot describe
// (strides or addresses not multiples of 16 bytes) and for FUSEFORGE_ATTENTION_TMA=0.
#pragma once
#include <type_traits>

#include "attention/sm80/attention_fwd_kernel.cuh"
#include "attention/attention_heuristics.h"
#include "common/env.h"
#include "common/tma.cuh"

namespace fuseforge::attention {

// The kernel's second parameter: tensor maps of q, k, v as (head dim, rows, heads, batch), the
// schedule knob and the tile count. Tile t is query block m_blocks - 1 - t % m_blocks (heaviest
// causal blocks first) of head (t / m_blocks) % heads_q, batch t / (m_blocks heads_q): the order of
// the one-block-a-tile grid, so the tiles running at once share a head's K and V in L2.
struct FwdTmaParams {
  CUtensorMap q, k, v;
  CUtensorMap o;        // out as (head dim, rows, heads, batch), 16-row boxes
  int store_o_tma = 0;  // the epilogue stores O by TMA (o encoded; fixed-length only)
  int pingpong = 1;  // consumers take turns issuing their products
  int early_k_release = 1;  // 0: K(i) freed with V(i), after P(i) V(i) (the schedule before; A/B timings)
  int m_blocks = 0, num_tiles = 0;
  int64_t max_blocks = 0;  // host only: FUSEFORGE_ATTENTION_FWD_BLOCKS (0: one an SM)
};

// The traits of the warp-specialized forward for a launch shape Tr (the cp.async kernel's). Head
// dim 64 runs three consumer warpgroups on 192-row query tiles (FlashAttention-3's shape there): two
// warpgroups' products cover one's softmax, which at head dim 64 is as long as its products (H100,
// against two warpgroups: forward 9.97 -> 8.38 ms at S16384, 2.60 -> 2.29 at S4096).
// The cp.async kernel keeps 128 rows, and so does this one where fwd_query_rows_d64 (attention_heuristics.h)
// says 192-row tiles would waste more than they gain.
template <class Tr>
struct WarpSpecFwdTraits {
  using type = std::conditional_t<Tr::kHeadDim == 64,
                                  FwdTraits<typename Tr::T, 64, 192, Tr::kBlockN, 12, Tr::kPadHeadDim>, Tr>;
};

template <class Tr>
struct WarpSpecFwdLayout {
  static constexpr int kStages = 2;
  static constexpr int kConsumers = Tr::kBlockM / 64;  // warpgroups of 64 query rows
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kConsumerThreads = 128 * kConsumers;
  static constexpr int kPanels = Tr::kHeadDim / 64;
  // The output is staged in its own tile where it fits (the next tile's Q then loads under this
  // tile's last P V product and its stores), else in Q's (head dim 256).
  static constexpr int kBarrierBytes = 8 * (2 + 4 * kStages) + 8;  // the mbarriers, the tile slot
  static constexpr bool kOwnOutputTile =
      1024 + 2 * Tr::kTileQBytes + kStages * 2 * Tr::kTileKVBytes + kBarrierBytes <= 227 * 1024;
  // Q, kStages x (K, V), O if kOwnOutputTile, the mbarriers (full_q, empty_q, full_k[s], full_v[s],
  // empty_k[s], empty_v[s]) and the tile slot; 1 KB to align the tiles on 1024 bytes (the 128-byte swizzle's period).
  static constexpr int kKVOffset = Tr::kTileQBytes;
  static constexpr int kOutOffset = kOwnOutputTile ? kKVOffset + kStages * 2 * Tr::kTileKVBytes : 0;
  // Head dim 128 (and the dims padded to it): each consumer warp holds its 16 rows of Q in registers
  // (32 a thread, loaded once a tile), S = Q K^T reads only K from shared memory, and Q's tile is
  // free for the next tile's Q as soon as it is loaded, not after the tile's last S (H100,
  // forward at ncu's locked clock -3.6% at S1024/causal, -0.4% at S4096/full, -0.25% at
  // S16384/full). Head dim 64's three warpgroups have no registers to spare (160 a thread). Only
  // with kOwnOutputTile: otherwise O is staged in Q's tile, which must stay until the epilogue.
  static constexpr bool kQInRegisters = Tr::kHeadDim == 128 && kConsumers == 2 && Tr::kBlockN == 128 && kOwnOutputTile;
  static constexpr int kBarriersOffset = kKVOffset + kStages * 2 * Tr::kTileKVBytes + (kOwnOutputTile ? Tr::kTileQBytes : 0);
  static constexpr int kSmemBytes = 1024 + kBarriersOffset + kBarrierBytes;
  static_assert(kSmemBytes <= 227 * 1024, "fits an H100 SM's shared memory");
  // The block starts with 65536 / kThreads registers a thread (168 for 384 threads, 128 for 512); the
  // consumers' increase comes out of what the producer gives back.
  static constexpr int kProducerRegs = kConsumers == 2 ? 24 : 32, kConsumerRegs = kConsumers == 2 ? 240 : 160;
  static_assert(kConsumers == 2 || kConsumers == 3, "register split written for two or three consumer warpgroups");
  static_assert(128 * kProducerRegs + kConsumerThreads * kConsumerRegs <= kThreads * (65536 / kThreads / 8 * 8),
                "register pool");
};

#if FUSEFORGE_ATTENTION_WGMMA
// Persistent: one block an SM takes tiles from p.tile_counter until none is left. The producer
// thread picks each tile (skipping varlen tiles past their sequence), writes its index to a shared
// slot and loads its Q (full_q tracks both); the consumers read the slot when Q lands (-1: no tile
// left) and release slot and Q (empty_q, every consumer thread) once their last S = Q K^T has run
// (kQInRegisters: once Q is in their registers), so the next tile's Q and first K/V load under this
// tile's last P V product and output stores. The K/V ring runs on across tiles.
template <class Tr, int kMask, bool kSoftcap, bool kVarlen>
__device__ __forceinline__ void attention_fwd_warpspec_body(const FwdParams& p, const FwdTmaParams& tma) {
  using T = typename Tr::T;
  using L = WarpSpecFwdLayout<Tr>;
  // Query tiles end at the sequence's last row: a partial tile is the first, under a causal mask the
  // lightest (H100: D64/S1024/causal's forward -7% cycles).
  using Block = QueryBlock<T, Tr::kBlockM, Tr::kBlockN, kMask, kVarlen, /*kBottom=*/true>;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kD = Tr::kHeadDim, kStages = L::kStages;
  static_assert(kBlockM == 128 || kBlockM == 192, "two or three consumer warpgroups of 64 rows");
  static_assert(wgmma_fwd_tile_supported<Tr>(), "a key-tile / head-dim pair the wgmma forward bodies take");
  using QTile = PanelTile<kBlockM>;
  using KVTile = PanelTile<kBlockN>;
  const int tid = threadIdx.x, lane = tid & 31, warp = uniform_warp_index(), wg = warp >> 2;
  auto block_of = [&](int tile) {
    const int m = tile % tma.m_blocks, bh = tile / tma.m_blocks;
    return Block(p, tma.m_blocks - 1 - m, bh % p.heads_q, bh / p.heads_q);
  };

  const uint32_t sQ = attention_smem_base();
  unsigned char* smem = attention_smem + (sQ - smem_addr(attention_smem));
  auto sK = [&](int s) { return sQ + L::kKVOffset + s * 2 * Tr::kTileKVBytes; };
  const uint32_t bars = sQ + L::kBarriersOffset;
  const uint32_t full_q = bars, empty_q = bars + 8;
  auto full_k = [&](int s) { return bars + 8 * (2 + s); };
  auto full_v = [&](int s) { return bars + 8 * (2 + kStages + s); };
  auto empty_k = [&](int s) { return bars + 8 * (2 + 2 * kStages + s); };
  auto empty_v = [&](int s) { return bars + 8 * (2 + 3 * kStages + s); };
  volatile int* tile_slot = reinterpret_cast<volatile int*>(smem + L::kBarriersOffset + 8 * (2 + 4 * kStages));
  if (tid == 0) {
    mbarrier_init(full_q, 1);
    // Every consumer thread arrives after its last read of Q and the slot (the slot: a generic load of
    // the producer's generic store; an arrive a thread is the order compute-sanitizer's racecheck sees).
    mbarrier_init(empty_q, L::kConsumerThreads);
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(full_k(s), 1);
      mbarrier_init(full_v(s), 1);
      mbarrier_init(empty_k(s), L::kConsumers * 4);  // one arrive a consumer warp (K/V: wgmma reads only)
      mbarrier_init(empty_v(s), L::kConsumers * 4);
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  if (wg == 0) {  // producer: one thread picks the tiles and issues every copy
    setmaxnreg_dec<L::kProducerRegs>();
    if (tid == 0) {
      prefetch_tma_map(&tma.q);
      prefetch_tma_map(&tma.k);
      prefetch_tma_map(&tma.v);
      // Each block's first tile is its own index; the counter hands out the rest.
      auto next_tile = [&] { return atomicAdd(p.tile_counter, 1) + static_cast<int>(gridDim.x); };
      int tile = blockIdx.x, kv = 0;  // kv: K/V tiles issued so far (the ring position)
      for (int j = 0;; ++j) {
        // varlen: tiles past their sequence have no rows; skip them here, the consumers never see them
        // (an atomicMax past a sequence's run of empty tiles instead of an atomicAdd each times level)
        if constexpr (kVarlen)
          while (tile < tma.num_tiles && block_of(tile).rows_q <= 0) tile = next_tile();
        mbarrier_wait(empty_q, (j & 1) ^ 1);  // the consumers are done with the previous tile's Q
        if (tile >= tma.num_tiles) {
          *tile_slot = -1;
          mbarrier_arrive(full_q);
          break;
        }
        *tile_slot = tile;
        const Block blk = block_of(tile);
        const int batch = kVarlen ? 0 : blk.b;
        mbarrier_arrive_expect_tx(full_q, Tr::kTileQBytes);
#pragma unroll
        for (int c = 0; c < L::kPanels; ++c)
          tma_load_4d(sQ + c * QTile::kPanelBytes, &tma.q, full_q, c * 64, blk.q_row0 + blk.m0, blk.h, batch);
        const int next = next_tile();  // its latency hides under the loads
        for (int nb = blk.n_begin; nb < blk.n_end; ++nb, ++kv) {
          const int s = kv % kStages, parity = ((kv / kStages) & 1) ^ 1;
          const int row = blk.k_row0 + nb * kBlockN;
          mbarrier_wait(empty_k(s), parity);
          mbarrier_arrive_expect_tx(full_k(s), Tr::kTileKVBytes);
#pragma unroll
          for (int c = 0; c < L::kPanels; ++c)
            tma_load_4d(sK(s) + c * KVTile::kPanelBytes, &tma.k, full_k(s), c * 64, row, blk.hk, batch);
          mbarrier_wait(empty_v(s), parity);
          mbarrier_arrive_expect_tx(full_v(s), Tr::kTileKVBytes);
#pragma unroll
          for (int c = 0; c < L::kPanels; ++c)
            tma_load_4d(sK(s) + Tr::kTileKVBytes + c * KVTile::kPanelBytes, &tma.v, full_v(s), c * 64, row, blk.hk,
                        batch);
        }
        tile = next;
      }
    }
    return;
  }

  setmaxnreg_inc<L::kConsumerRegs>();
  const int cwarp = warp - 4, cwg = cwarp >> 2;  // consumer warp and warpgroup (0..kConsumers - 1)
  const int warp_row0 = cwarp * 16;
  const uint32_t wg_rows = cwg * 64 * 128;  // byte offset of the warpgroup's first row in a Q panel
  const float scale_log2 = p.scale_log2;
  const bool pingpong = tma.pingpong != 0;
  // Named barriers 2.. (one a consumer warpgroup, "warpgroup g may issue", 256 threads: g and the one
  // before it) and 1 (all consumers).
  constexpr int kMyTurn = 2, kThreads2 = L::kConsumerThreads, kTurnThreads = 256;
  // Ping-pong (round robin with three): warpgroup g issues its products between a sync on barrier
  // kMyTurn + g and an arrive on the next one's. The last warpgroup lets 0 go first, and 0 takes the
  // last one's last arrive before leaving, so the counts match over any number of tiles; a
  // warpgroup cannot arrive twice on a barrier before its owner has synced on it (its next turn needs
  // the owner's turn first).
  auto turn_begin = [&] {
    if (pingpong) named_barrier_sync(kMyTurn + cwg, kTurnThreads);
  };
  auto turn_end = [&] {
    const int next = L::kConsumers == 2 ? cwg ^ 1 : (cwg + 1 == L::kConsumers ? 0 : cwg + 1);
    if (pingpong) named_barrier_arrive(kMyTurn + next, kTurnThreads);
  };
  auto release = [&](uint32_t empty_barrier) {  // this warp is done with a stage's K or V
    __syncwarp();
    if (lane == 0) mbarrier_arrive(empty_barrier);
  };
  const bool early_k = tma.early_k_release != 0;
  auto sV = [&](int s) { return sK(s) + Tr::kTileKVBytes; };
  if (pingpong && cwg == L::kConsumers - 1) named_barrier_arrive(kMyTurn + 0, kTurnThreads);

  for (int j = 0, kv = 0;; ++j) {
    mbarrier_wait(full_q, j & 1);
    const int tile = *tile_slot;
    if (tile < 0) break;
    const Block blk = block_of(tile);
    const int m0 = blk.m0, offset = blk.offset, seqlen_k = blk.seqlen_k, n_begin = blk.n_begin;
    const int n_tiles = blk.n_end - n_begin;
    // kQInRegisters: this warp's 16 rows of Q as wgmma A fragments, a k-step each; then Q's tile and
    // the slot are free for the next tile.
    uint32_t qa[L::kQInRegisters ? kD / 16 : 1][4];
    if constexpr (L::kQInRegisters) {
#pragma unroll
      for (int ks = 0; ks < kD / 16; ++ks)
        ldmatrix_x4(qa[ks], sQ + QTile::offset(warp_row0 + (lane & 15), ks * 16 + (lane >> 4) * 8));
      mbarrier_arrive(empty_q);
    }

    float o[kD / 2];
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) o[i] = 0.f;
    float row_max[1][2] = {{-INFINITY, -INFINITY}}, row_sum[1][2] = {{0.f, 0.f}};
    auto& o3 = reinterpret_cast<float(&)[1][kD / 8][4]>(o);
    uint32_t pa[kBlockN / 16][4];  // P of the previous tile as wgmma A fragments

    // Tile i's scores, softcapped and masked, as the warp's rows (in place of sacc).
    auto scores_of_tile = [&](int i, float (&sacc)[kBlockN / 2]) -> float(&)[1][kBlockN / 8][4] {
      const int n0 = (n_begin + i) * kBlockN;
      apply_softcap<kSoftcap>(sacc, p);
      auto& s3 = reinterpret_cast<float(&)[1][kBlockN / 8][4]>(sacc);
      if (tile_needs_mask<kMask, kBlockM, kBlockN>(m0, n0, seqlen_k, offset, p))
        apply_mask<kMask, 1, kBlockN>(s3, m0 + warp_row0, n0, seqlen_k, offset, p, lane);
      return s3;
    };
    // Tile i's softmax after O's product landed: softcap, mask, online update of max / sum / O, P
    // into pa. The running max moves only past a 2^8 growth (softmax_rows' kLazy), and O is rescaled
    // only when a row of the warp moved it (FlashAttention-4's conditional rescale): after the first
    // tiles a row's max rarely moves that far, and the 64 rescale multiplies were the softmax's tail.
    auto softmax_tile = [&](int i, float (&sacc)[kBlockN / 2]) {
      auto& s3 = scores_of_tile(i, sacc);
      // P converted before the rescale's branch: ptxas schedules within a basic block, so the
      // conversions stay among the exponentials.
      float correction[1][2];
      const bool moved = softmax_rows<1, kBlockN, true>(s3, row_max, row_sum, correction, scale_log2);
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) c_to_a_fragment<T>(s3[0][2 * kk], s3[0][2 * kk + 1], pa[kk]);
      if (__any_sync(0xffffffffu, moved)) rescale_rows<1, kD>(o3, correction);
    };
    // Tiles after the first: the exponentials against the running max, and no tile max at all. A
    // thread's sum of a row's exponentials bounds each of them, so a sum within 2^kLazyMaxGrowth
    // keeps P within the lazy rule's bound; a larger sum (or a row with no key seen yet) makes the
    // warp redo the tile from S, which is kept for that, with the exact max. Otherwise P stands.
    // Without the row max (64 FMNMX, two shuffles) the step is 344 SASS instructions instead of 429
    // (bf16, no mask), and the softmax is the path the other warpgroup's products wait on (H100,
    // forward at ncu's locked clock: D128 -8.8% at S1024/full, -11.4% at S16384/full, -8.5% at
    // S4096/causal; D64's three warpgroups -8.8% to -14.9%). Every
    // warp-specialized forward takes it: without the max, S's copy fits in the three-warpgroup and
    // varlen kernels' registers too (no spills).
    auto softmax_tile_spec = [&](int i, float (&sacc)[kBlockN / 2]) {
      auto& s3 = scores_of_tile(i, sacc);
      float pf[1][kBlockN / 8][4];
      float sum[2];
      bool move = false;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float ref = row_max[0][hh];
        // A row with every key masked so far: exponentials against 0 (no inf - inf), then the redo.
        const float ref_scaled = ref == -INFINITY ? 0.f : ref * scale_log2;
        float sm = 0.f;
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; ++nt)
#pragma unroll
          for (int e = 2 * hh; e < 2 * hh + 2; ++e) {
            pf[0][nt][e] = fast_exp2(fmaf(s3[0][nt][e], scale_log2, -ref_scaled));
            sm += pf[0][nt][e];
          }
        move |= ref == -INFINITY || sm > kLazySumBound;  // a NaN sum compares false: NaN reaches O
        sum[hh] = sm;
      }
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) c_to_a_fragment<T>(pf[0][2 * kk], pf[0][2 * kk + 1], pa[kk]);
      if (__any_sync(0xffffffffu, move)) {  // rare: the exact step from S
        // keep is 0, but ptxas cannot know it: the speculative P and sums stay live on this path
        // too, so ptxas cannot sink their computation below the branch (behind the sums' vote).
        const uint32_t keep = static_cast<uint32_t>(n_tiles) >> 31;
        float correction[1][2];
        // The exact max, not the lazy one: a tile whose sums passed the bound may not have moved the
        // max past 2^8, and from a lazy max the next tiles would redo too.
        softmax_rows<1, kBlockN, false>(s3, row_max, row_sum, correction, scale_log2);
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
          uint32_t exact[4];
          c_to_a_fragment<T>(s3[0][2 * kk], s3[0][2 * kk + 1], exact);
#pragma unroll
          for (int j = 0; j < 4; ++j) pa[kk][j] = exact[j] | (pa[kk][j] & keep);
        }
        row_sum[0][0] += keep ? sum[0] : 0.f;
        row_sum[0][1] += keep ? sum[1] : 0.f;
        rescale_rows<1, kD>(o3, correction);
      } else {
        row_sum[0][0] += sum[0];
        row_sum[0][1] += sum[1];
      }
    };
    auto s_product = [&](float (&sacc)[kBlockN / 2], int st) {
      if constexpr (L::kQInRegisters)
        wgmma_rs_k_major<T, kBlockN, kD / 16>(sacc, qa, sK(st), KVTile::kPanelBytes);
      else
        wgmma_ss_k_major<T, kBlockN, kD / 16>(sacc, sQ + wg_rows, QTile::kPanelBytes, sK(st), KVTile::kPanelBytes);
    };
    auto stage = [&](int i) { return (kv + i) % kStages; };
    auto phase = [&](int i) { return ((kv + i) / kStages) & 1; };

    // A warpgroup whose 64 rows all lie before the sequence's first row (the first query tile's, when
    // the length is no multiple of the tile: D64's 192-row tiles at S = 1024, 4096, 16384) issues no
    // products and no softmax, and a warpgroup stops at its own last visible key tile (with a causal
    // mask or a window a tile's later warpgroups see more keys than its first). Each key tile
    // it skips keeps its barrier protocol (the full stages' waits, a turn, the releases of K and V),
    // so the producer and the other warpgroups count the same arrives; an idle warpgroup's O stays
    // zero and its rows are never stored. A loop of its own: the products stay outside any condition
    // inside a loop (below). Three warpgroups and packed sequences only: head dim 128's fixed-length
    // causal kernel spilled 8 bytes with it (and its benchmark lengths are multiples of 128).
    constexpr bool kSkipIdle = L::kConsumers == 3 || kVarlen;
    auto skip_key_tiles = [&](int first) {
      for (int i = first; i < n_tiles; ++i) {
        const int s = stage(i);
        mbarrier_wait(full_k(s), phase(i));
        mbarrier_wait(full_v(s), phase(i));
        turn_begin();
        turn_end();
        release(empty_k(s));
        release(empty_v(s));
      }
    };
    int my_tiles = n_tiles;  // the key tiles this warpgroup computes, [0, my_tiles)
    if constexpr (kSkipIdle) {
      // The warpgroup's rows inside the sequence: [wg_first, wg_first + wg_rows).
      const int wg_m0 = m0 + cwg * 64, wg_first = max(wg_m0, 0);
      const int wg_rows = min(wg_m0 + 64, blk.seqlen_q) - wg_first;
      if (wg_rows <= 0) {
        my_tiles = 0;
      } else if constexpr (kMask != kNoMask) {
        int wg_begin, wg_end;
        query_key_tiles<int>(true, kMask == kWindow, wg_first, wg_rows, seqlen_k, offset, p.window_left,
                             p.window_right, kBlockN, wg_begin, wg_end);
        my_tiles = min(n_tiles, wg_end - n_begin);
      }
    }

    // The first and the last key tile are peeled: a product under a condition inside the loop makes
    // ptxas serialize every wgmma of the kernel.
    if (my_tiles > 0) {
      {
        float sacc[kBlockN / 2];
#pragma unroll
        for (int jj = 0; jj < kBlockN / 2; ++jj) sacc[jj] = 0.f;
        mbarrier_wait(full_k(stage(0)), phase(0));
        turn_begin();
        wgmma_fence();
        s_product(sacc, stage(0));
        turn_end();
        wgmma_wait<0>();
        wgmma_fence_operands(sacc);
        if (early_k) release(empty_k(stage(0)));
        softmax_tile(0, sacc);
      }
      for (int i = 1; i < my_tiles; ++i) {
        const int s = stage(i), s_prev = stage(i - 1);
        float sacc[kBlockN / 2];
#pragma unroll
        for (int jj = 0; jj < kBlockN / 2; ++jj) sacc[jj] = 0.f;
        mbarrier_wait(full_k(s), phase(i));
        mbarrier_wait(full_v(s_prev), phase(i - 1));
        turn_begin();
        wgmma_fence();
        s_product(sacc, s);
        wgmma_rs_mn_major<T, kD, kBlockN / 16>(o, pa, sV(s_prev), KVTile::kPanelBytes);
        turn_end();
        wgmma_wait<0>();
        wgmma_fence_operands(sacc);
        wgmma_fence_operands(o);
        release(empty_k(early_k ? s : s_prev));
        release(empty_v(s_prev));
        softmax_tile_spec(i, sacc);
      }
      if constexpr (L::kOwnOutputTile && !L::kQInRegisters) mbarrier_arrive(empty_q);  // every S of the tile has run
      const int s_last = stage(my_tiles - 1);
      mbarrier_wait(full_v(s_last), phase(my_tiles - 1));
      turn_begin();
      wgmma_rs_mn_major<T, kD, kBlockN / 16>(o, pa, sV(s_last), KVTile::kPanelBytes);
      turn_end();
      wgmma_wait<0>();
      wgmma_fence_operands(o);
      if (!early_k) release(empty_k(s_last));
      release(empty_v(s_last));
    } else if (kSkipIdle && n_tiles > 0) {  // this warpgroup computes none of the tile's key tiles
      if constexpr (L::kOwnOutputTile && !L::kQInRegisters) mbarrier_arrive(empty_q);
      turn_begin();  // the turn of the last tile's P V product
      turn_end();
    } else if constexpr (L::kOwnOutputTile && !L::kQInRegisters) {
      mbarrier_arrive(empty_q);
    }
    if constexpr (kSkipIdle) skip_key_tiles(my_tiles);
    kv += n_tiles;

    // Epilogue: O / l, and lse = max * scale + ln(l) (-inf and a zero row where no key was seen).
    // Each warp stages its own rows; staged in Q's tile, both warpgroups must be done reading Q.
    float inv_sum[1][2];
    finish_rows<1>(row_max, row_sum, inv_sum, p.lse + blk.lse_row0, m0 + warp_row0, blk.seqlen_q, p, lane);
    if constexpr (!L::kOwnOutputTile) named_barrier_sync(1, kThreads2);
    // O by TMA boxes where a tensor map describes out; a partial first tile stores its rows itself: an
    // O box at a negative row traps (illegal instruction on the H100), where a Q box there loads zeros.
    const bool o_boxes = !kVarlen && tma.store_o_tma;
    if (o_boxes && blk.row_lo == 0) {
      // O / l as T into this warp's rows of a PanelTile (the TMA's 128-byte swizzle), then one box a
      // 64-column panel. The previous tile's boxes were read long ago; the wait is for the ordering.
      if (lane == 0) bulk_wait_group_read_all();
      __syncwarp();
      const uint32_t sOut = sQ + L::kOutOffset;
      stage_rows<T, kD, 1, QTile>(o3, inv_sum, smem + L::kOutOffset, warp_row0, lane);
      fence_proxy_async_shared();  // the stores, visible to the TMA unit's reads
      __syncwarp();
      if (lane == 0) {
#pragma unroll
        for (int c = 0; c < L::kPanels; ++c)
          tma_store_4d(&tma.o, sOut + c * QTile::kPanelBytes + warp_row0 * 128, c * 64, m0 + warp_row0, blk.h, blk.b);
        bulk_commit_group();
        if constexpr (!L::kOwnOutputTile) bulk_wait_group_read_all();  // Q's tile: the next Q lands there
      }
      __syncwarp();
    } else {
      // the previous tile's reads of this warp's staging rows are done (its O boxes too). Staged in
      // the boxes' layout (QTile), so each warp keeps to its own rows whichever way a tile is stored
      // (in SwizzledTile's rows of 2 x kD bytes a warp's rows cover other warps' panel rows: racecheck).
      if (o_boxes && lane == 0) bulk_wait_group_read_all();
      __syncwarp();
      T* out = blk.template rows<T>(p.out, p.out_batch_stride, p.out_head_stride, p.out_row_stride, p);
      store_rows<T, kD, 1, QTile>(o3, inv_sum, smem + L::kOutOffset, warp_row0, out, p.out_row_stride, blk.rows_q,
                                  valid_head_dim<Tr>(p), lane, blk.row_lo);
    }
    if constexpr (!L::kOwnOutputTile) mbarrier_arrive(empty_q);  // the staging rows are read
  }
  if (pingpong && cwg == 0) named_barrier_sync(kMyTurn + 0, kTurnThreads);  // the last warpgroup's last arrive
  if (lane == 0) bulk_wait_group_all();  // the boxes read shared memory: done before the block leaves
}
#endif  // FUSEFORGE_ATTENTION_WGMMA

template <class Tr, int kMask, bool kSoftcap, bool kVarlen>
__global__ void __launch_bounds__(WarpSpecFwdLayout<Tr>::kThreads, 1)
    attention_fwd_warpspec_kernel(const __grid_constant__ FwdParams params, const __grid_constant__ FwdTmaParams tma) {
#if FUSEFORGE_ATTENTION_WGMMA
  attention_fwd_warpspec_body<Tr, kMask, kSoftcap, kVarlen>(params, tma);
#else
  __trap();  // no sm_90a code: the launcher does not pick this kernel (sm90a_kernels_runnable)
#endif
}

// A tensor map over one operand's (head dim, rows, heads, batch) view (element strides as in the
// params; varlen: a batch of one), boxes of 64 columns x box_rows rows; false when TMA cannot describe
// it (then the cp.async kernels run).
template <typename T>
bool encode_rows_map(CUtensorMap* map, const FwdParams& p, const void* base, int64_t rows, int heads,
                     int64_t row_stride, int64_t head_stride, int64_t batch_stride, uint32_t box_rows) {
  const bool varlen = p.cu_seqlens_q != nullptr;
  const uint64_t dims[4] = {static_cast<uint64_t>(p.head_dim), static_cast<uint64_t>(rows),
                            static_cast<uint64_t>(heads), static_cast<uint64_t>(varlen ? 1 : p.batch)};
  const uint64_t strides[3] = {static_cast<uint64_t>(row_stride) * 2, static_cast<uint64_t>(head_stride) * 2,
                               static_cast<uint64_t>(batch_stride) * 2};
  return row_stride > 0 && head_stride >= 0 && batch_stride >= 0 &&
         encode_tma_tile_map(map, MmaType<T>::kIsBf16, base, dims, strides, 64, box_rows);
}

// Whether the kernels written for sm_90a only (wgmma: the warp-specialized ones, head dim 256's
// backward) have their code on this device: a compute capability 9.0 GPU, and a build whose only
// sm_90 target is sm_90a (setup.py defines FUSEFORGE_SM90A_BUILD then). A build with plain sm_90
// code (TORCH_CUDA_ARCH_LIST=9.0) compiles those kernels to a trap, and its other kernels to mma.sync.
inline bool sm90a_kernels_runnable() {
#if defined(FUSEFORGE_SM90A_BUILD)
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  return prop->major == 9 && prop->minor == 0;
#else
  return false;
#endif
}

// Whether the TMA kernels may run: sm90a_kernels_runnable() and FUSEFORGE_ATTENTION_TMA not 0.
// =1 makes them a requirement: require_tma raises where they cannot run (so a benchmark knows which
// kernel it timed); unset takes them where they can.
inline std::string tma_mode() { return dev_choice("FUSEFORGE_ATTENTION_TMA", {"0", "1"}); }
inline bool tma_kernels_allowed() { return tma_mode() != "0" && sm90a_kernels_runnable(); }
inline bool require_tma(bool maps_ok) {
  if (tma_mode() == "1") {
    TORCH_CHECK(sm90a_kernels_runnable(),
                "FUSEFORGE_ATTENTION_TMA=1: the TMA kernels cannot run here (they need a compute capability 9.0 "
                "GPU and a build for TORCH_CUDA_ARCH_LIST=9.0a)");
    TORCH_CHECK(maps_ok, "FUSEFORGE_ATTENTION_TMA=1: the TMA kernels cannot run here (an operand's strides or "
                "address are not multiples of 16 bytes)");
  }
  return maps_ok;
}

// Whether the warp-specialized forward serves this call (tma filled in then).
template <class Tr>
bool use_fwd_warpspec(const FwdParams& p, FwdTmaParams* tma) {
  using T = typename Tr::T;
  if (!tma_kernels_allowed()) return require_tma(false);
  tma->pingpong = dev_flag("FUSEFORGE_ATTENTION_PINGPONG", true) ? 1 : 0;
  tma->early_k_release = dev_flag("FUSEFORGE_ATTENTION_EARLY_K_RELEASE", true) ? 1 : 0;
  tma->max_blocks = dev_positive_int("FUSEFORGE_ATTENTION_FWD_BLOCKS", 0);
  // Not a requirement: where out's strides do not fit a tensor map, the kernel stores O itself.
  tma->store_o_tma = p.cu_seqlens_q == nullptr &&
                     encode_rows_map<T>(&tma->o, p, p.out, p.rows_q, p.heads_q, p.out_row_stride, p.out_head_stride,
                                        p.out_batch_stride, 16);
  return require_tma(
      encode_rows_map<T>(&tma->q, p, p.q, p.rows_q, p.heads_q, p.q_row_stride, p.q_head_stride, p.q_batch_stride,
                         Tr::kBlockM) &&
      encode_rows_map<T>(&tma->k, p, p.k, p.rows_k, p.heads_kv, p.k_row_stride, p.k_head_stride, p.k_batch_stride,
                         Tr::kBlockN) &&
      encode_rows_map<T>(&tma->v, p, p.v, p.rows_k, p.heads_kv, p.v_row_stride, p.v_head_stride, p.v_batch_stride,
                         Tr::kBlockN));
}

// Tiles: query blocks (of the longest sequence) x heads x batch (or sequences). The warp-specialized
// kernel where use_fwd_warpspec says so (persistent: a block an SM, p.tile_counter zeroed by the
// caller), else the cp.async one (a block a tile).
template <class Tr, class WsTr, bool kSoftcap>
void launch_attention_fwd_tiles(const FwdParams& params, bool local) {
  const dim3 grid(static_cast<unsigned>((params.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM),
                  static_cast<unsigned>(params.heads_q), static_cast<unsigned>(params.batch));
  FwdTmaParams tma;
  const bool warpspec = use_fwd_warpspec<WsTr>(params, &tma);
  const int64_t m_blocks = (params.seqlen_q + WsTr::kBlockM - 1) / WsTr::kBlockM;
  const int64_t tiles = m_blocks * grid.y * grid.z;
  TORCH_CHECK(!warpspec || tiles < (int64_t{1} << 31) - 1024, "attention: ", tiles, " query tiles of ",
              WsTr::kBlockM, " rows; at most 2^31 - 1024 (batch * heads * query blocks)");
  tma.m_blocks = static_cast<int>(m_blocks);
  tma.num_tiles = static_cast<int>(tiles);
  dispatch_mask_varlen(params, local, [&]<int kMask, bool kVarlen>() {
    if (warpspec) {
      using L = WarpSpecFwdLayout<WsTr>;
      // One block an SM. FUSEFORGE_ATTENTION_FWD_BLOCKS=n: at most n (tests give a few blocks many
      // tiles; n >= the tiles is one block a tile, each finding none left after its own: A/B timings).
      const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
      const dim3 blocks(static_cast<unsigned>(std::min(tiles, tma.max_blocks > 0 ? tma.max_blocks : sms)));
      launch_kernel(attention_fwd_warpspec_kernel<WsTr, kMask, kSoftcap, kVarlen>, blocks, dim3(L::kThreads),
                    L::kSmemBytes, params, tma);
    } else {
      launch_kernel(attention_fwd_kernel<Tr, kMask, kSoftcap, kVarlen>, grid, dim3(Tr::kThreads), Tr::kSmemBytes,
                    params);
    }
  });
}

// Head dim 64: the warp-specialized kernel's tiles of 128 or 192 rows (fwd_query_rows_d64).
template <class Tr, bool kSoftcap>
void launch_attention_fwd(const FwdParams& params, bool local) {
  if constexpr (Tr::kHeadDim == 64) {
    static_assert(Tr::kBlockM == 128, "the cp.async kernel's tiles are the 128-row warp-specialized ones");
    if (fwd_query_rows_d64(params, local) == 128) return launch_attention_fwd_tiles<Tr, Tr, kSoftcap>(params, local);
  }
  launch_attention_fwd_tiles<Tr, typename WarpSpecFwdTraits<Tr>::type, kSoftcap>(params, local);
}

}  // namespace fuseforge::attention
