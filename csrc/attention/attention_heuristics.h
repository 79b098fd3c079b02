// The attention launchers' host-side grid plan (which tiles a call runs), in plain C++ (no CUDA
// headers) so GoogleTest checks it on any machine (tests/cpp/test_attention.cpp).
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>

#include "attention/attention_params.h"
#include "common/env.h"

namespace fuseforge::attention {

// Query rows x keys the forward's tiles of block_m rows compute for one (sequence, head) of seqlen_q
// x seqlen_k under p's mask (local: p.window_left / window_right): the key tiles QueryBlock visits
// (query_key_tiles), each whole. A causal mask has no left bound; with window_left clamped to the
// max length, as the host does, the left bound reaches no key then either. bottom: the tiles end at
// the last row, a partial tile first (the warp-specialized forward's: QueryBlock's kBottom); else
// they start at row 0 (the cp.async forward's, and the backward's query tiles).
inline int64_t fwd_tile_area(const FwdParams& p, bool local, int64_t seqlen_q, int64_t seqlen_k, int block_m,
                             int block_n, bool bottom = false) {
  int64_t area = 0;
  for (int64_t m0 = query_tile_first_row<int64_t>(bottom, seqlen_q, block_m, 0); m0 < seqlen_q; m0 += block_m) {
    int64_t n_begin = 0, n_end = 0;
    const int64_t first = std::max<int64_t>(m0, 0);  // the tile's first row inside the sequence
    query_key_tiles<int64_t>(local, /*left_bound=*/true, first, std::min<int64_t>(m0 + block_m, seqlen_q) - first,
                             seqlen_k, seqlen_k - seqlen_q, p.window_left, p.window_right, block_n, n_begin, n_end);
    area += (n_end - n_begin) * block_n * block_m;
  }
  return area;
}

// fwd_tile_area of the sequence the tile-size rules judge a call by: the sequence at fixed length,
// the mean sequence for varlen (its lengths are on the device; rows_q / rows_k are the totals).
inline int64_t typical_tile_area(const FwdParams& p, bool local, int block_m, int block_n, bool bottom = false) {
  if (p.cu_seqlens_q == nullptr) return fwd_tile_area(p, local, p.seqlen_q, p.seqlen_k, block_m, block_n, bottom);
  const int64_t sequences = std::max(1, p.batch);
  return fwd_tile_area(p, local, (p.rows_q + sequences - 1) / sequences, (p.rows_k + sequences - 1) / sequences,
                       block_m, block_n, bottom);
}

// Head dim 64's forward tiles: 192 rows (WarpSpecFwdTraits) computes ~15% more a second than 128
// (H100: S16384 causal 5.13 -> 4.55 ms for 2.3% more tile area, S4096 1.41 -> 1.33 for
// 9% more), but where a sequence is a few tiles long its partial tile and the causal diagonal waste
// more of a 192-row tile. So 128 rows where the 192-row tiles' area is over 1.15x theirs (measured:
// the faster of the two in each of five rows), counted with
// the kernel's tiles ending at the last row: S1024 causal is then 1.125x and takes 192 rows (7% fewer
// cycles than 128; with tiles aligned to the start it would be 1.33x and level). Varlen: the mean
// sequence (the lengths are on the device). FUSEFORGE_ATTENTION_FWD_ROWS=128 or 192 forces one.
inline int fwd_query_rows_d64(const FwdParams& p, bool local) {
  const std::string knob = dev_choice("FUSEFORGE_ATTENTION_FWD_ROWS", {"128", "192"});
  if (!knob.empty()) return knob == "128" ? 128 : 192;
  const int64_t area128 = typical_tile_area(p, local, 128, 128, /*bottom=*/true);
  const int64_t area192 = typical_tile_area(p, local, 192, 128, /*bottom=*/true);
  return area192 * 100 > area128 * 115 ? 128 : 192;
}

// Query rows of head dim 128's dk/dv tiles (the warp-specialized kernel on the atomic path; softcap
// and deterministic calls keep 64): 80, FlashAttention-3's choice without a mask
// (hopper/flash_bwd_launch_template.h: 25% more work a tile for the same barriers, waits and softmax
// bookkeeping), where the tiles' area (the forward's count of query tile x key tile pairs, the same
// pairs the backward visits) is at most 1.05x the 64-row tiles' area. Measured on the H100
// (forward+backward, A B B A): without a mask 1-3% faster at S = 1024-16384 (locked clock: 2.2-6.5%
// fewer cycles); causal S16384 -4.8% (1.006x the area), S4096 -1.4% (1.045x), the 4096 window on
// S16384 -2.9% (1.016x), S1024 +2.3% (1.076x: the diagonal starts inside a tile). FA3 keeps 64 with a
// mask. Varlen: the area of the mean sequence, with or without a mask (a sequence's partial last tile
// wastes more of 80 rows; the lengths are on the device). FUSEFORGE_ATTENTION_BWD_ROWS=64 or 80 forces
// one (A/B timings, tests).
inline int bwd_query_rows_d128(const FwdParams& p, bool local) {
  const std::string knob = dev_choice("FUSEFORGE_ATTENTION_BWD_ROWS", {"64", "80"});
  if (!knob.empty()) return knob == "64" ? 64 : 80;
  if (!local && p.cu_seqlens_q == nullptr) return 80;
  const int64_t area64 = typical_tile_area(p, local, 64, 128);
  const int64_t area80 = typical_tile_area(p, local, 80, 128);
  return area80 * 100 <= area64 * 105 ? 80 : 64;
}

// The 80-query dk/dv tiles start at a key block's first visible row rounded down to 16 rows (KeyBlock).
// FUSEFORGE_ATTENTION_BWD_ROW_ALIGN=80 rounds down to 80 instead, the tiling before (A/B timings, tests).
inline int bwd_row_align() {
  return dev_choice("FUSEFORGE_ATTENTION_BWD_ROW_ALIGN", {"16", "80"}) == "80" ? 80 : 16;
}

// How far ahead (in real blocks: varlen counts only those within their sequence) the dk/dv kernel
// zeroes dq_accum (BwdParams::dq_zero_ahead): a wave of resident blocks, so a unit is zeroed about a
// block's time before its first reduction; at least a grid row (kv_blocks: a block waits only on lower
// ones). Measured on the H100: forward+backward at S1024 2.4-4.0% faster than with the row_dot
// kernel's zeroing (two waves ahead: 1.9-3.0%), packed documents 1.2-1.3% (the distance in real blocks;
// in grid slots, most of them blocks past their sequence, 1.5% slower). ncu reads the zeros
// going out to memory and back all the same (the gain is the row_dot kernel's 268 MB of stores
// moved under the dk/dv kernel's compute); 33 blocks ahead keeps most in L2 (dk/dv DRAM bytes -29%)
// and times level. 0 where the row_dot kernel zeroes dq_accum:
// FUSEFORGE_ATTENTION_BWD_ZERO_AHEAD=0, or a grid the zero-first kernel would cover whole. The
// knob's positive values set the distance (A/B timings, tests).
inline int64_t bwd_dq_zero_ahead(int64_t blocks, int64_t resident, int64_t kv_blocks) {
  if (dev_string("FUSEFORGE_ATTENTION_BWD_ZERO_AHEAD") == "0") return 0;
  const int64_t ahead = std::max(dev_positive_int("FUSEFORGE_ATTENTION_BWD_ZERO_AHEAD", resident), kv_blocks);
  return ahead < blocks && blocks <= INT32_MAX ? ahead : 0;
}

// The backward's programmatic dependent launches (launch_attention_bwd); FUSEFORGE_ATTENTION_BWD_OVERLAP=0
// launches serially (A/B timings, tests). Measured on the H100: the 1.2-1.6 us between the backward's
// kernels go; forward+backward level at fixed length, the
// window 1.0% and the packed documents 0.8% faster.
inline bool bwd_overlap_launches() { return dev_flag("FUSEFORGE_ATTENTION_BWD_OVERLAP", true); }

// Varlen: the kernels take the sequences longest first (check_and_order_sequences_async, FwdParams::
// seq_order). FUSEFORGE_ATTENTION_VARLEN_LONGEST_FIRST=0 keeps the given order (A/B timings, tests).
inline bool varlen_longest_first() { return dev_flag("FUSEFORGE_ATTENTION_VARLEN_LONGEST_FIRST", true); }

// The dk/dv kernel's block order for a local mask (see launch_attention_bwd): key blocks slowest (every
// head's heaviest causal block in the first wave) when the grid is at most `max_waves` waves of
// `resident` blocks, else a head's key blocks side by side (sharing its Q / dO tiles in L2).
// FUSEFORGE_ATTENTION_BWD_KV_SLOWEST=0 or 1 forces the order (A/B timings); without a local mask
// the kernel has one order only.
inline bool bwd_kv_block_slowest(bool local, int64_t blocks, int64_t resident, int64_t kv_blocks, int max_waves) {
  const std::string knob = dev_choice("FUSEFORGE_ATTENTION_BWD_KV_SLOWEST", {"0", "1"});
  if (!local || kv_blocks > 65535) return false;  // grid z holds the key blocks
  return knob.empty() ? blocks <= max_waves * resident : knob == "1";
}

// Keys a dk/dv block takes (BwdConfig::DkdvTraits' kBlockN): 64 at head dim 256, else 128.
constexpr int bwd_key_block_rows(int64_t head_dim) { return head_dim > 128 ? 64 : 128; }

// Grouped-query heads in the backward (attention_bwd_cuda): a dk/dv block loops over the `group`
// query heads of its KV head, so a small batch of short sequences makes fewer, longer blocks than the
// GPU has SMs. B1 Hk8 S2048 gives 128 blocks of 4 heads on 132 SMs. Its causal blocks' tail, modelled
// block by block, puts the dk/dv kernel at ~1.9x its work spread over the SMs. Splitting each group over `split` blocks gives split x the blocks: the blocks of a
// split read their KV head's K and V in place (FwdParams::kv_head_split), and their dK / dV partials
// are summed after. The returned split divides the group.
// FUSEFORGE_ATTENTION_BWD_HEAD_SPLIT:
// - unset or "auto" (the default): the smallest power-of-two divisor of the group that brings the
//   grid to min_waves waves of `resident` blocks. On the H200 it takes B1 Hq32 Hk8 S2048's
//   forward+backward from 0.401 to 0.374 ms (split 4); split 2 there, 256 blocks, gains nothing.
// - "1": no split; another divisor of the group: that split.
inline int64_t bwd_gqa_head_split(int64_t blocks, int64_t group, int64_t resident, int64_t min_waves = 2) {
  const std::string knob = dev_string("FUSEFORGE_ATTENTION_BWD_HEAD_SPLIT");
  if (knob.empty() || knob == "auto") {
    int64_t split = 1;
    while (blocks * split < min_waves * resident && group % (2 * split) == 0) split *= 2;
    return split;
  }
  const int64_t split = dev_positive_int("FUSEFORGE_ATTENTION_BWD_HEAD_SPLIT", 1);
  TORCH_CHECK(group % split == 0, "FUSEFORGE_ATTENTION_BWD_HEAD_SPLIT: expected auto or a divisor of the ",
              group, " query heads a KV head has, got '", knob, "'");
  return split;
}

}  // namespace fuseforge::attention
