// Tile shapes of the attention kernels: one traits struct per shape, deriving thread count and
// shared-memory size, with the constraints the kernels rely on as static_asserts.
#pragma once
#include <cstdint>

namespace fuseforge::attention {

// Forward (and the deterministic dq kernel, same shape of work): a block owns kBlockM query rows of
// one (batch, head); each of kNWarps warps owns kBlockM / kNWarps rows (kMTiles m16 tiles, so each
// K/V fragment read from shared memory feeds kMTiles mma's) and loops over kBlockN-key tiles.
//
// kPadHeadDim: the tensors' head dim (FwdParams::head_dim) is smaller than kHeadDim; loads zero-fill
// the shared-memory columns past it and stores skip them. Without it the head dim is kHeadDim and
// the column tests compile away (the exact-dim kernels are the same code as before the flag).
template <typename T_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, bool kPadHeadDim_ = false>
struct FwdTraits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kPadHeadDim = kPadHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kRowsPerWarp = kBlockM / kNWarps;
  static constexpr int kMTiles = kRowsPerWarp / 16;
  static_assert(kBlockM % (16 * kNWarps) == 0, "each warp owns whole m16 tiles");
  static_assert(kBlockN % 16 == 0, "key tiles are whole k16 steps of the P V product");
  static_assert(kHeadDim % 64 == 0, "rows of at least 8 16-byte chunks (the smem swizzle)");
  static constexpr int kTileQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kTileKVBytes = kBlockN * kHeadDim * 2;
  // mma.sync body: Q, one K and one V tile (the K load of the next tile overlaps P V, the V load
  // overlaps Q K^T). wgmma body: Q, two stages of K and V, 1 KB to align the tiles on 1024 bytes.
  static constexpr int kSmemBytes = kTileQBytes + 4 * kTileKVBytes + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "fits an H100 SM's shared memory");
};

// Backward dk/dv: a block owns kBlockN keys of one (batch, kv head); each warp owns kBlockN / kNWarps
// keys and loops over the kBlockM-query tiles of every query head of the group (the GQA reduction
// happens in registers). Q and dO tiles are double-buffered; dS goes through shared memory for the
// dq = dS K product (atomic path).
template <typename T_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, bool kPadHeadDim_ = false>
struct BwdTraits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kPadHeadDim = kPadHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kThreads = kNWarps * 32;
  // Head dim 256 (kSplitCols): dK and dV of a key's whole head dim would take 256 registers a thread,
  // so the warps split into kColGroups = 2 groups (warpgroups on sm_90a) that own the same keys and
  // kDOut = 128 of the output columns each; both recompute S^T and dP^T over the full head dim.
  static constexpr bool kSplitCols = kHeadDim > 128;
  static constexpr int kColGroups = kSplitCols ? 2 : 1;
  static constexpr int kDOut = kHeadDim / kColGroups;
  static constexpr int kKeyWarps = kNWarps / kColGroups;       // warps over the block's keys
  static constexpr int kNTiles = kBlockN / (16 * kKeyWarps);  // key m16 tiles per warp
  static_assert(kBlockN % (16 * kKeyWarps) == 0, "each warp owns whole m16 tiles of keys");
  static_assert(kDOut <= 128, "dK and dV of at most 128 columns a thread");
  // kTransposedDq: 80-query tiles (head dim 128, fixed length or packed, where bwd_query_rows_d128 picks
  // them; the warp-specialized kernel only, as FlashAttention-3 without a mask): dS is stored [query][key] and dQ^T = K^T dS^T runs with the head dim as wgmma's
  // M (80 rows are no multiple of 64); the kDq* split below is the other kernels'.
  static constexpr bool kTransposedDq = kBlockM == 80;
  static_assert(kBlockM % 64 == 0 || (kTransposedDq && kHeadDim == 128 && kNWarps == 8),
                "dS^T rows (kBlockM queries) span 8 16-byte chunks (the smem swizzle)");
  static_assert(kHeadDim % 64 == 0, "rows of at least 8 16-byte chunks (the smem swizzle)");
  // dq = dS K on the atomic path: warps tile kBlockM x kHeadDim as kDqWarpsM x kDqWarpsN.
  static constexpr int kDqWarpsM = kTransposedDq ? 8 : kBlockM / 16 < kNWarps ? kBlockM / 16 : kNWarps;
  static constexpr int kDqWarpsN = kNWarps / kDqWarpsM;
  static_assert(kTransposedDq || (kDqWarpsM * kDqWarpsN == kNWarps && kHeadDim % (16 * kDqWarpsN) == 0 &&
                                  kBlockM % (16 * kDqWarpsM) == 0),
                "dq tile splits evenly over the warps");
  static constexpr int kDqRowTiles = kBlockM / (16 * kDqWarpsM);
  static constexpr int kDqCols = kHeadDim / kDqWarpsN;
  static constexpr int kTileKVBytes = kBlockN * kHeadDim * 2;
  static constexpr int kTileQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kTileDsBytes = kBlockN * kBlockM * 2;
  static constexpr int kStages = 2;
  // K, V; 2 stages of (Q, dO, lse, row_dot); dS (one a column group); 1 KB to align the tiles on 1024
  // bytes (wgmma body).
  static constexpr int kSmemBytes =
      2 * kTileKVBytes + kStages * (2 * kTileQBytes + 2 * kBlockM * 4) + kColGroups * kTileDsBytes + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "fits an H100 SM's shared memory");
};

}  // namespace fuseforge::attention
