// attention on the C++ side: the host-side launch choices of attention_heuristics.h (the forward's tiles,
// which decide between two kernels, and the backward's block order) and the masks' visible ranges
// the kernels test elements against (attention_params.h), checked here, where every machine can run
// them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "attention/attention_heuristics.h"
#include "testing.h"

namespace at_ = fuseforge::attention;
using fuseforge::testing::expect_error_naming;
using fuseforge::testing::ScopedEnv;

namespace {

at_::FwdParams fixed_length(int seqlen_q, int seqlen_k) {
  at_::FwdParams p;
  p.batch = 2;
  p.seqlen_q = seqlen_q, p.seqlen_k = seqlen_k;
  p.rows_q = seqlen_q, p.rows_k = seqlen_k;
  return p;
}

at_::FwdParams causal(at_::FwdParams p) {  // as the host sets it: left side clamped, right bound 0
  p.window_left = p.seqlen_k, p.window_right = 0;
  return p;
}

// The tile area by brute force: every (query tile, key tile) pair with a visible (query, key) pair.
int64_t brute_force_area(const at_::FwdParams& p, bool local, int sq, int sk, int bm, int bn, bool bottom = false) {
  int64_t area = 0;
  for (int m0 = bottom ? sq - (sq + bm - 1) / bm * bm : 0; m0 < sq; m0 += bm)
    for (int n0 = 0; n0 < sk; n0 += bn) {
      bool seen = !local;
      for (int i = std::max(m0, 0); i < std::min(m0 + bm, sq) && !seen; ++i)
        for (int j = n0; j < std::min(n0 + bn, sk) && !seen; ++j)
          seen = i + (sk - sq) - p.window_left <= j && j <= i + (sk - sq) + p.window_right;
      if (seen) area += static_cast<int64_t>(bm) * bn;
    }
  return area;
}

// A packed batch as the tile-size rules see it (their varlen rule reads the count and the totals; the
// lengths stay on the device): `sequences` causal sequences of `tokens` in all, the longest max_len.
at_::FwdParams packed_causal(int sequences, int tokens, int max_len) {
  static const int cu[2] = {0, 0};  // only its being set matters here
  at_::FwdParams p = causal(fixed_length(max_len, max_len));
  p.cu_seqlens_q = cu, p.batch = sequences, p.rows_q = p.rows_k = tokens;
  return p;
}

// The mask's definition: query i sees key j when j < Sk and, per mode, i + off - left <= j (kWindow)
// and j <= i + off + right (kRightBound, kWindow).
bool visible_by_definition(int mask, int i, int j, int sk, int off, const at_::FwdParams& p) {
  bool seen = j < sk;
  if (mask != at_::kNoMask) seen = seen && j <= i + off + p.window_right;
  if (mask == at_::kWindow) seen = seen && i + off - p.window_left <= j;
  return seen;
}

template <int kMask>
void expect_ranges_match_definition(int sq, int sk, int left, int right) {
  at_::FwdParams p = fixed_length(sq, sk);
  p.window_left = left, p.window_right = right;
  const int off = sk - sq;
  // Every line (rows and keys past the sequences' ends included), its first column anywhere around
  // the sequence, and the offsets a thread's elements take within a tile (up to 128 columns on).
  for (int line = 0; line < std::max(sq, sk) + 4; ++line)
    for (int first = -4; first < std::max(sq, sk) + 8; first += 9) {
      const at_::VisibleRange keys = at_::keys_of_row<kMask>(line, first, sk, off, p);  // line: a query row
      const at_::VisibleRange rows = at_::rows_of_key<kMask>(line, first, sk, off, p);  // line: a key
      for (int c = 0; c < 128; ++c) {
        ASSERT_EQ(keys.contains(c), visible_by_definition(kMask, line, first + c, sk, off, p))
            << "mask " << kMask << " Sq " << sq << " Sk " << sk << " row " << line << " key " << first + c;
        ASSERT_EQ(rows.contains(c), visible_by_definition(kMask, first + c, line, sk, off, p))
            << "mask " << kMask << " Sq " << sq << " Sk " << sk << " key " << line << " row " << first + c;
      }
    }
}

}  // namespace

TEST(AttentionMask, VisibleRangesMatchTheMaskDefinition) {
  // (Sq, Sk, left, right) as the host clamps them: causal is right = 0 with left = Sk.
  for (const auto& [sq, sk] : {std::pair{200, 200}, {77, 300}, {300, 77}, {1, 129}, {129, 1}}) {
    expect_ranges_match_definition<at_::kNoMask>(sq, sk, sk, sq);
    expect_ranges_match_definition<at_::kRightBound>(sq, sk, sk, 0);
    expect_ranges_match_definition<at_::kWindow>(sq, sk, 63, 0);
    expect_ranges_match_definition<at_::kWindow>(sq, sk, 0, 0);
    expect_ranges_match_definition<at_::kWindow>(sq, sk, 17, 40);
    expect_ranges_match_definition<at_::kWindow>(sq, sk, sk, 5);
  }
}

TEST(AttentionTiling, AreaCountsTheKeyTilesEachQueryTileVisits) {
  // S1024 causal: 36 of the 64 pairs of 128-row tiles; 32 of the 48 of 192-row ones (2, 3, 5, 6, 8, 8
  // key tiles; the partial last query tile counts whole): 1.33x the area.
  EXPECT_EQ(at_::fwd_tile_area(causal(fixed_length(1024, 1024)), true, 1024, 1024, 128, 128), 36 * 128 * 128);
  EXPECT_EQ(at_::fwd_tile_area(causal(fixed_length(1024, 1024)), true, 1024, 1024, 192, 128), 32 * 192 * 128);
  EXPECT_EQ(at_::fwd_tile_area(fixed_length(1024, 1024), false, 1024, 1024, 192, 128), 6 * 8 * 192 * 128);
  // Tiles ending at the last row (the warp-specialized forward's): the partial tile is the first, rows
  // 0-63, with one key tile (8, 7, 5, 4, 2, 1 key tiles): 1.125x the 128-row area.
  EXPECT_EQ(at_::fwd_tile_area(causal(fixed_length(1024, 1024)), true, 1024, 1024, 192, 128, /*bottom=*/true),
            27 * 192 * 128);
  // Against brute force: odd lengths, Sq != Sk (bottom-right aligned), sliding windows.
  for (int sq : {1, 77, 300, 1000})
    for (int sk : {1, 129, 700})
      for (int left : {0, 40, 1 << 20})
        for (int right : {0, 5}) {
          at_::FwdParams p = fixed_length(sq, sk);
          p.window_left = std::min(left, sk), p.window_right = std::min(right, sk);
          for (int bm : {128, 192})
            for (bool bottom : {false, true})
              EXPECT_EQ(at_::fwd_tile_area(p, true, sq, sk, bm, 128, bottom),
                        brute_force_area(p, true, sq, sk, bm, 128, bottom))
                  << "sq=" << sq << " sk=" << sk << " left=" << left << " right=" << right << " bm=" << bm
                  << " bottom=" << bottom;
        }
}

TEST(AttentionTiling, HeadDim64TakesTheRowsThatWasteLess) {
  // The H100's measurements (fwd_query_rows_d64): 192 rows as fast as 128 at S1024 causal with
  // tiles aligned to the start (1.33x the area), 7% faster aligned to the end (1.125x).
  EXPECT_EQ(at_::fwd_query_rows_d64(causal(fixed_length(1024, 1024)), true), 192);
  EXPECT_EQ(at_::fwd_query_rows_d64(fixed_length(1024, 1024), false), 192);
  EXPECT_EQ(at_::fwd_query_rows_d64(causal(fixed_length(4096, 4096)), true), 192);
  EXPECT_EQ(at_::fwd_query_rows_d64(fixed_length(4096, 4096), false), 192);
  EXPECT_EQ(at_::fwd_query_rows_d64(causal(fixed_length(16384, 16384)), true), 192);
  // Varlen: the mean length. 18 documents in 32768 tokens (the benchmark's) -> 192; 4 short ones -> 128.
  EXPECT_EQ(at_::fwd_query_rows_d64(packed_causal(18, 32768, 5287), true), 192);
  EXPECT_EQ(at_::fwd_query_rows_d64(packed_causal(4, 221, 5287), true), 128);
}

TEST(AttentionTiling, RowsKnobForcesOneAndNamesABadValue) {
  {
    ScopedEnv env("FUSEFORGE_ATTENTION_FWD_ROWS", "128");
    EXPECT_EQ(at_::fwd_query_rows_d64(fixed_length(4096, 4096), false), 128);
  }
  {
    ScopedEnv env("FUSEFORGE_ATTENTION_FWD_ROWS", "192");
    EXPECT_EQ(at_::fwd_query_rows_d64(packed_causal(4, 221, 5287), true), 192);
  }
  ScopedEnv env("FUSEFORGE_ATTENTION_FWD_ROWS", "64");
  expect_error_naming([] { at_::fwd_query_rows_d64(fixed_length(64, 64), false); },
                      "FUSEFORGE_ATTENTION_FWD_ROWS: expected 128 or 192, got '64'");
}

TEST(AttentionTiling, HeadDim128BackwardTakes80RowsWhereTheAreaAllows) {
  // 80-query tiles where they cover at most 1.05x the 64-query tiles' area (bwd_query_rows_d128):
  // without a mask always; causal S1024 1.076x -> 64, S4096 1.045x and S16384 1.006x -> 80;
  // the 4096 window on S16384 1.016x -> 80.
  EXPECT_EQ(at_::bwd_query_rows_d128(fixed_length(1024, 1024), false), 80);
  EXPECT_EQ(at_::bwd_query_rows_d128(fixed_length(50, 70), false), 80);
  EXPECT_EQ(at_::bwd_query_rows_d128(causal(fixed_length(1024, 1024)), true), 64);
  EXPECT_EQ(at_::bwd_query_rows_d128(causal(fixed_length(4096, 4096)), true), 80);
  EXPECT_EQ(at_::bwd_query_rows_d128(causal(fixed_length(16384, 16384)), true), 80);
  at_::FwdParams window = fixed_length(16384, 16384);
  window.window_left = 4095, window.window_right = 0;
  EXPECT_EQ(at_::bwd_query_rows_d128(window, true), 80);
  // Varlen: the mean length, with or without a mask. The benchmark's 18 documents in 32768 tokens
  // (mean 1821: 1.017x causal) -> 80; 4 short ones (mean 56: one tile either way, 1.25x) -> 64.
  const at_::FwdParams docs = packed_causal(18, 32768, 5287), short_docs = packed_causal(4, 221, 5287);
  EXPECT_EQ(at_::bwd_query_rows_d128(docs, true), 80);
  EXPECT_EQ(at_::bwd_query_rows_d128(docs, false), 80);
  EXPECT_EQ(at_::bwd_query_rows_d128(short_docs, true), 64);
  EXPECT_EQ(at_::bwd_query_rows_d128(short_docs, false), 64);
  {
    ScopedEnv env("FUSEFORGE_ATTENTION_BWD_ROWS", "64");
    EXPECT_EQ(at_::bwd_query_rows_d128(fixed_length(4096, 4096), false), 64);
  }
  {
    ScopedEnv env("FUSEFORGE_ATTENTION_BWD_ROWS", "80");
    EXPECT_EQ(at_::bwd_query_rows_d128(causal(fixed_length(1024, 1024)), true), 80);
  }
  ScopedEnv env("FUSEFORGE_ATTENTION_BWD_ROWS", "128");
  expect_error_naming([] { at_::bwd_query_rows_d128(fixed_length(64, 64), false); },
                      "FUSEFORGE_ATTENTION_BWD_ROWS: expected 64 or 80, got '128'");
}

TEST(AttentionBackwardOrder, KeyBlocksSlowestOnlyForSmallLocalGrids) {
  // 132 resident blocks (an H100 with one dk/dv block an SM); the warp-specialized kernel's limit is 4
  // waves, the others' 8 (launch_attention_bwd).
  EXPECT_TRUE(at_::bwd_kv_block_slowest(true, 383, 132, 8, 4));     // the 1.2B Llama's step: 2.9 waves
  EXPECT_FALSE(at_::bwd_kv_block_slowest(true, 1024, 132, 32, 4));  // GQA softcap S4096: 7.75 waves
  EXPECT_TRUE(at_::bwd_kv_block_slowest(true, 1024, 132, 64, 8));   // the same grid on head dim 256's kernel
  EXPECT_FALSE(at_::bwd_kv_block_slowest(false, 16, 132, 8, 4));    // no mask: one order only
  EXPECT_FALSE(at_::bwd_kv_block_slowest(true, 70000, 132 * 1000, 70000, 4));  // past grid z's 65535
}

TEST(AttentionBackwardTiles, RowAlignKnob) {
  const char* name = "FUSEFORGE_ATTENTION_BWD_ROW_ALIGN";
  EXPECT_EQ(at_::bwd_row_align(), 16);
  {
    ScopedEnv env(name, "80");
    EXPECT_EQ(at_::bwd_row_align(), 80);
  }
  ScopedEnv env(name, "64");
  expect_error_naming([] { at_::bwd_row_align(); }, "FUSEFORGE_ATTENTION_BWD_ROW_ALIGN: expected 16 or 80, got '64'");
}

TEST(AttentionBackwardOrder, KnobForcesTheOrderAndNamesABadValue) {
  const char* name = "FUSEFORGE_ATTENTION_BWD_KV_SLOWEST";
  {
    ScopedEnv env(name, "1");
    EXPECT_TRUE(at_::bwd_kv_block_slowest(true, 100000, 132, 64, 4));
    EXPECT_FALSE(at_::bwd_kv_block_slowest(false, 16, 132, 8, 4));  // no mask: still the one order
  }
  {
    ScopedEnv env(name, "0");
    EXPECT_FALSE(at_::bwd_kv_block_slowest(true, 16, 132, 8, 4));
  }
  ScopedEnv env(name, "yes");
  expect_error_naming([] { at_::bwd_kv_block_slowest(true, 16, 132, 8, 4); },
                      "FUSEFORGE_ATTENTION_BWD_KV_SLOWEST: expected 0 or 1, got 'yes'");
}

TEST(AttentionBackwardZeroing, DistanceIsAWaveAtLeastARowAndOffForShortGrids) {
  const char* name = "FUSEFORGE_ATTENTION_BWD_ZERO_AHEAD";
  // 132 resident blocks: D128/S1024 (4096 blocks of 8 key blocks a row), S16384 (128 a row).
  EXPECT_EQ(at_::bwd_dq_zero_ahead(4096, 132, 8), 132);
  EXPECT_EQ(at_::bwd_dq_zero_ahead(4096, 132, 512), 512);  // at least a grid row
  EXPECT_EQ(at_::bwd_dq_zero_ahead(132, 132, 8), 0);       // the zero-first kernel would do it all
  {
    ScopedEnv env(name, "1");
    EXPECT_EQ(at_::bwd_dq_zero_ahead(4096, 132, 8), 8);
  }
  {
    ScopedEnv env(name, "0");
    EXPECT_EQ(at_::bwd_dq_zero_ahead(4096, 132, 8), 0);
  }
  ScopedEnv env(name, "-3");
  expect_error_naming([] { at_::bwd_dq_zero_ahead(4096, 132, 8); },
                      "FUSEFORGE_ATTENTION_BWD_ZERO_AHEAD: expected a positive integer, got '-3'");
}

TEST(AttentionBackwardHeadSplit, AutoFillsTwoWavesByDefaultKnobMustDivideTheGroup) {
  const char* name = "FUSEFORGE_ATTENTION_BWD_HEAD_SPLIT";
  EXPECT_EQ(at_::bwd_key_block_rows(64), 128);  // the blocks the rule counts (BwdConfig's key tiles)
  EXPECT_EQ(at_::bwd_key_block_rows(96), 128);
  EXPECT_EQ(at_::bwd_key_block_rows(256), 64);
  EXPECT_EQ(at_::bwd_gqa_head_split(128, 4, 132), 4);  // unset: auto
  {
    ScopedEnv env(name, "1");
    EXPECT_EQ(at_::bwd_gqa_head_split(16, 4, 132), 1);  // off
  }
  {
    ScopedEnv env(name, "auto");
    EXPECT_EQ(at_::bwd_gqa_head_split(128, 4, 132), 4);  // B1 Hk8 S2048: 256 blocks at 2 are still < 264
    EXPECT_EQ(at_::bwd_gqa_head_split(192, 4, 132), 2);  // 384 blocks at 2
    EXPECT_EQ(at_::bwd_gqa_head_split(384, 4, 132), 1);  // the 1.2B Llama's step at batch 6: 2.9 waves
    EXPECT_EQ(at_::bwd_gqa_head_split(16, 4, 132), 4);   // stops at the group
    EXPECT_EQ(at_::bwd_gqa_head_split(16, 6, 132), 2);   // powers of two that divide the group
    EXPECT_EQ(at_::bwd_gqa_head_split(16, 1, 132), 1);   // no grouped heads
  }
  {
    ScopedEnv env(name, "2");
    EXPECT_EQ(at_::bwd_gqa_head_split(10000, 4, 132), 2);  // forced, however many blocks
  }
  {
    ScopedEnv env(name, "3");
    expect_error_naming([] { at_::bwd_gqa_head_split(128, 4, 132); },
                        "FUSEFORGE_ATTENTION_BWD_HEAD_SPLIT: expected auto or a divisor of the 4 query heads a KV "
                        "head has, got '3'");
  }
  ScopedEnv env(name, "two");
  expect_error_naming([] { at_::bwd_gqa_head_split(128, 4, 132); },
                      "FUSEFORGE_ATTENTION_BWD_HEAD_SPLIT: expected a positive integer, got 'two'");
}
