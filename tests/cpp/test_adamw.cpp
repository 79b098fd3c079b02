// GoogleTest: host-side packing of the fused AdamW metadata (csrc/adamw/adamw_meta.{h,cpp}) and the
// shared element math (csrc/adamw/adamw_math.h). No GPU needed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "adamw/adamw_math.h"
#include "adamw/adamw_meta.h"

namespace fa = fuseforge::adamw;
constexpr int64_t kChunk = fa::kDefaultChunkElems;  // sizes below are in chunks: the default may change

namespace {

// Every element of every tensor is covered exactly once, in order, by the plan's blocks.
void expect_covers(const fa::BlockPlan& plan, const std::vector<int64_t>& numels, int64_t chunk) {
  ASSERT_EQ(plan.num_chunks.size(), numels.size());
  size_t b = 0;
  for (size_t t = 0; t < numels.size(); ++t) {
    const int64_t expected_chunks = numels[t] == 0 ? 1 : (numels[t] + chunk - 1) / chunk;
    ASSERT_EQ(plan.num_chunks[t], expected_chunks) << "tensor " << t;
    int64_t covered = 0;
    for (int32_t c = 0; c < plan.num_chunks[t]; ++c, ++b) {
      ASSERT_LT(b, plan.blocks.size());
      EXPECT_EQ(plan.blocks[b].tensor, static_cast<int32_t>(t));
      EXPECT_EQ(plan.blocks[b].chunk, c);
      const int64_t begin = static_cast<int64_t>(c) * chunk;
      covered += std::max<int64_t>(0, std::min(chunk, numels[t] - begin));
    }
    EXPECT_EQ(covered, numels[t]) << "tensor " << t;
  }
  EXPECT_EQ(b, plan.blocks.size());
  int64_t next = 0;
  for (const auto& l : plan.launches) {
    EXPECT_EQ(l.first_block, next);
    EXPECT_GT(l.num_blocks, 0);
    next += l.num_blocks;
  }
  EXPECT_EQ(next, static_cast<int64_t>(plan.blocks.size()));
}

}  // namespace

TEST(AdamWPacking, EmptyTensorsGetOneBookkeepingBlockAndNoElements) {
  const std::vector<int64_t> numels{0, 5, 0, 0, kChunk, 0};
  const auto plan = fa::plan_blocks(numels);
  expect_covers(plan, numels, fa::kDefaultChunkElems);
  EXPECT_EQ(plan.blocks.size(), 6u);  // one block each: the empty ones only advance their step
  EXPECT_EQ(plan.launches.size(), 1u);
}

TEST(AdamWPacking, ChunksOddSizes) {
  const std::vector<int64_t> numels{1, 37, kChunk - 1, kChunk, kChunk + 1, 3 * kChunk + 100};
  const auto plan = fa::plan_blocks(numels);
  expect_covers(plan, numels, fa::kDefaultChunkElems);
  EXPECT_EQ(plan.num_chunks[5], 4);
  fa::PlanOptions small;
  small.chunk_elems = 8;
  expect_covers(fa::plan_blocks(numels, small), numels, 8);
}

TEST(AdamWPacking, MoreTensorsThanOneLaunchHolds) {
  std::vector<int64_t> numels(100000);
  for (size_t i = 0; i < numels.size(); ++i) numels[i] = (i % 3 == 0) ? 0 : static_cast<int64_t>(i % 4096) + 1;
  fa::PlanOptions opt;
  opt.max_blocks_per_launch = 1000;
  const auto plan = fa::plan_blocks(numels, opt);
  expect_covers(plan, numels, opt.chunk_elems);
  EXPECT_EQ(plan.launches.size(), 100u);  // 100000 one-chunk tensors, 1000 blocks a launch
  for (const auto& l : plan.launches) EXPECT_LE(l.num_blocks, 1000);
  // A tensor's chunks may straddle two launches: still every block exactly once.
  opt.max_blocks_per_launch = 7;
  const std::vector<int64_t> big{20 * kChunk, 3, 9 * kChunk + 1};
  const auto split = fa::plan_blocks(big, opt);
  expect_covers(split, big, opt.chunk_elems);
  EXPECT_EQ(split.launches.size(), 5u);  // 31 blocks
}

TEST(AdamWPacking, HugeTensorsUseInt64Offsets) {
  const int64_t huge = 5'000'000'000;  // > 2^32 elements
  const std::vector<int64_t> numels{huge, 3};
  const auto plan = fa::plan_blocks(numels);
  EXPECT_EQ(plan.num_chunks[0], (huge + fa::kDefaultChunkElems - 1) / fa::kDefaultChunkElems);
  const auto& last = plan.blocks[plan.num_chunks[0] - 1];
  const int64_t begin = static_cast<int64_t>(last.chunk) * fa::kDefaultChunkElems;
  EXPECT_GT(begin, int64_t{1} << 32);
  EXPECT_EQ(huge - begin, huge % fa::kDefaultChunkElems == 0 ? fa::kDefaultChunkElems : huge % fa::kDefaultChunkElems);
  // More chunks than int32 indices hold is refused, not wrapped.
  fa::PlanOptions tiny;
  tiny.chunk_elems = 8;
  EXPECT_THROW(fa::plan_blocks({int64_t{8} << 31}, tiny), std::invalid_argument);
}

TEST(AdamWPacking, BadInputsThrow) {
  EXPECT_THROW(fa::plan_blocks({-1}), std::invalid_argument);
  fa::PlanOptions bad;
  bad.chunk_elems = 12;  // not a multiple of 8: breaks 16-byte alignment of chunk starts
  EXPECT_THROW(fa::plan_blocks({16}, bad), std::invalid_argument);
  bad.chunk_elems = 16;
  bad.max_blocks_per_launch = 0;
  EXPECT_THROW(fa::plan_blocks({16}, bad), std::invalid_argument);
}

TEST(AdamWPacking, MixedDtypesShareOneTable) {
  std::vector<float> p32(10), m(64), v(64);
  std::vector<uint16_t> p16(20), pbf(30);
  float steps[3] = {0, 4, 9};
  std::vector<fa::TensorMeta> table(3);
  const fa::ParamDtype dts[3] = {fa::ParamDtype::kFloat, fa::ParamDtype::kHalf, fa::ParamDtype::kBFloat16};
  void* params[3] = {p32.data(), p16.data(), pbf.data()};
  const int64_t numels[3] = {10, 20, 30};
  for (int i = 0; i < 3; ++i) {
    table[i].param = params[i];
    table[i].exp_avg = m.data();
    table[i].exp_avg_sq = v.data();
    table[i].master = i == 2 ? m.data() + 32 : nullptr;
    table[i].step = &steps[i];
    table[i].numel = numels[i];
    table[i].dtype = static_cast<int32_t>(dts[i]);
    table[i].group = i % 2;
  }
  const auto plan = fa::plan_blocks({10, 20, 30});
  for (int i = 0; i < 3; ++i) table[i].num_chunks = plan.num_chunks[i];
  EXPECT_EQ(plan.launches.size(), 1u);  // one launch whatever the dtypes
  std::vector<uint8_t> bytes;
  const size_t n = fa::pack_table(table, plan.blocks, bytes);
  ASSERT_EQ(n, 3 * sizeof(fa::TensorMeta) + 3 * sizeof(fa::BlockWork));
  EXPECT_EQ(fa::table_blocks_offset(3) % 8, 0u);
  for (int i = 0; i < 3; ++i) {
    fa::TensorMeta back;
    std::memcpy(&back, bytes.data() + i * sizeof(fa::TensorMeta), sizeof back);
    EXPECT_EQ(back.param, params[i]);
    EXPECT_EQ(back.dtype, static_cast<int32_t>(dts[i]));
    EXPECT_EQ(back.numel, numels[i]);
    EXPECT_EQ(back.step, &steps[i]);
    EXPECT_EQ(back.master != nullptr, i == 2);
    fa::BlockWork w;
    std::memcpy(&w, bytes.data() + fa::table_blocks_offset(3) + i * sizeof(fa::BlockWork), sizeof w);
    EXPECT_EQ(w.tensor, i);
  }
  EXPECT_EQ(fa::param_dtype_bytes(fa::ParamDtype::kBFloat16), 2);
  EXPECT_EQ(fa::param_dtype_bytes(fa::ParamDtype::kDouble), 8);
}

TEST(AdamWPacking, StepDataHoldsGroupsThenGrads) {
  std::vector<fa::GroupHyper> groups(2);
  groups[0].lr = 1e-3;
  groups[1].lr = 2e-3;
  groups[1].maximize = 1;
  int dummy[3];
  const std::vector<const void*> grads{&dummy[0], nullptr, &dummy[2]};
  std::vector<uint8_t> bytes;
  const size_t n = fa::pack_step_data(groups, grads, bytes);
  ASSERT_EQ(n, 2 * sizeof(fa::GroupHyper) + 3 * sizeof(void*));
  ASSERT_EQ(n % 8, 0u);  // uploaded as 8-byte words
  const size_t at = fa::step_data_grads_offset(2);
  EXPECT_EQ(at % alignof(void*), 0u);
  const void* back[3];
  std::memcpy(back, bytes.data() + at, sizeof back);
  EXPECT_EQ(back[0], &dummy[0]);
  EXPECT_EQ(back[1], nullptr);  // no grad this step: the kernel skips the tensor
  EXPECT_EQ(back[2], &dummy[2]);
  fa::GroupHyper g1;
  std::memcpy(&g1, bytes.data() + sizeof(fa::GroupHyper), sizeof g1);
  EXPECT_EQ(g1.lr, 2e-3);
  EXPECT_EQ(g1.maximize, 1);
}

TEST(AdamWMath, FirstStepIsSignedLrStep) {
  // Step 1 from zero moments: p <- p (1 - lr wd) - lr g / (|g| + eps).
  const double lr = 1e-2, wd = 0.1, eps = 1e-8;
  const auto s = fa::make_step_scalars<double>(lr, 0.9, 0.999, eps, wd, false, 1.0, nullptr);
  const auto sf = fa::make_step_scalars<float>(lr, 0.9, 0.999, eps, wd, false, 1.0, nullptr);
  EXPECT_NEAR(sf.one_minus_beta2, 1e-3, 1e-3 * 1e-7);  // 1 - beta2 accurate: the moments do not drift
  // 20000 steps of a constant grad: the float32 moments track torch's CUDA rounding (update in double,
  // stored in float32) within an ulp, with no drift.
  float m32 = 0, v32 = 0, mt = 0, vt = 0;
  const float gc = 0.37f;
  for (int t = 0; t < 20000; ++t) {
    m32 = std::fma(sf.one_minus_beta1, gc - m32, m32);
    v32 = std::fma(sf.one_minus_beta2, gc * gc - v32, v32);
    mt = static_cast<float>(0.9 * mt + (1 - 0.9) * gc);
    vt = static_cast<float>(0.999 * vt + (1 - 0.999) * static_cast<double>(gc) * gc);
  }
  EXPECT_NEAR(m32, mt, 2e-7 * mt);
  EXPECT_NEAR(v32, vt, 2e-7 * vt);
  for (double g0 : {0.5, -3.0, 1e-3}) {
    double p = 1.5, g = g0, m = 0, v = 0, vmax = 0;
    fa::adamw_element<double, false>(p, g, m, v, vmax, s);
    const double expect = 1.5 * (1 - lr * wd) - lr * g0 / (std::fabs(g0) + eps);
    EXPECT_NEAR(p, expect, 1e-12);
    EXPECT_NEAR(m, 0.1 * g0, 1e-15);
  }
  // maximize flips the direction; amsgrad keeps the running max.
  const auto smax = fa::make_step_scalars<double>(lr, 0.9, 0.999, eps, 0.0, true, 1.0, nullptr);
  double p = 0, g = 2, m = 0, v = 0, vmax = 5;
  fa::adamw_element<double, true>(p, g, m, v, vmax, smax);
  EXPECT_EQ(vmax, 5.0);
  EXPECT_GT(p, 0.0);
  // grad_scale divides the grad and hands the unscaled grad back.
  const float scale = 8.f;
  const auto ss = fa::make_step_scalars<float>(lr, 0.9, 0.999, eps, 0.0, false, 1.0, &scale);
  float pf = 0, gf = 16, mf = 0, vf = 0, xf = 0;
  fa::adamw_element<float, false>(pf, gf, mf, vf, xf, ss);
  EXPECT_EQ(gf, 2.f);
}
