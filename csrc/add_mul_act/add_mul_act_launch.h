// add_mul_act's launch interface, shared by the host code (add_mul_act_cuda.cpp, compiled by the
// C++ compiler) and the kernels (*.cu): kernel parameters, the grid plan, the launchers.
#pragma once
#include <cstdint>

#include "common/activation.h"
#include "add_mul_act/add_mul_act.h"
#include "common/cuda_utils.h"

namespace fuseforge::add_mul_act {

constexpr int kGroup = 8;      // columns a thread owns = bits of one mask byte
constexpr int kThreads = 256;  // threads a block
constexpr int kRowUnroll = 8;  // the most rows a thread loads before it computes (rows_unroll)
// The backward kernel's static shared memory: fp32 bias partials, kGroup per thread.
constexpr size_t kBackwardStaticSmem = kGroup * kThreads * sizeof(float);

template <typename T>
struct ForwardParams {
  const T* x;
  const T* y;
  const T* bias;       // nullable
  T* out;              // may equal x (in-place variant): each element is read before it is written
  T* saved_z;          // nullable: pre-activation for the backward
  uint8_t* saved_mask; // nullable: relu's bit mask, mask_row_bytes a row
  float alpha;
  int64_t rows, cols, groups_per_row, rows_per_block;
};

template <typename T>
struct BackwardParams {
  const T* grad_out;
  const T* saved_z;          // for every activation but relu
  const uint8_t* saved_mask; // for relu
  T* grad_x;
  T* grad_y;                 // nullable: alpha * grad_x
  float* bias_partials;      // nullable: (gridDim.y, cols) partial column sums, fp32
  float alpha;
  int64_t rows, cols, groups_per_row;  // the rows are taken in interleaved trips (backward_kernel)
};

// The grid for a rows x cols problem. A block is tx column groups by ty rows, as wide as the row
// allows (up to 256 groups = 4 KB of a bf16 row), so a block reads long contiguous runs. Without a
// bias reduction each thread handles kRowUnroll rows (many small blocks). With one
// (bias_blocks_per_sm > 0: the backward kernel's resident blocks an SM), the grid is exactly one wave
// of resident blocks, so there are few partial sums to reduce and no partly filled last wave; the
// blocks take their rows in interleaved trips (backward_kernel).
struct LaunchPlan {
  dim3 grid, block;
  int64_t rows_per_block = 0;  // the forward's
  size_t smem_bytes = 0;       // dynamic shared memory: only to cap the resident blocks an SM
};

inline LaunchPlan plan_launch(const Shape2d& s, int64_t bias_blocks_per_sm) {
  LaunchPlan plan;
  const int64_t groups = ceil_div(s.cols, kGroup);
  int tx = 1;
  while (tx < kThreads && tx < groups) tx *= 2;
  const int ty = kThreads / tx;
  const int64_t grid_x = ceil_div(groups, tx);
  const int64_t row_step = static_cast<int64_t>(ty) * kRowUnroll;
  int64_t rows_per_block = std::max(row_step, ceil_div(s.rows, 65535));  // gridDim.y limit
  rows_per_block = ceil_div(rows_per_block, row_step) * row_step;
  int64_t grid_y = ceil_div(s.rows, rows_per_block);
  if (bias_blocks_per_sm > 0 && grid_x > 0) {
    grid_y = std::min(grid_y, std::max<int64_t>(1, bias_blocks_per_sm * num_sms() / grid_x));
  }
  plan.block = dim3(tx, ty);
  plan.grid = dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y));
  plan.rows_per_block = rows_per_block;
  return plan;
}

// The backward kernel's resident blocks an SM at `smem_bytes` of dynamic shared memory, from the
// occupancy calculator (cached per device and kernel); defined in add_mul_act_bwd.cu.
template <typename T>
int backward_blocks_per_sm(Activation act, bool vectorized, size_t smem_bytes);

// Defined in add_mul_act_fwd.cu / add_mul_act_bwd.cu for float, at::Half, at::BFloat16; they launch
// on the current stream and never synchronize. launch_backward also reduces the bias partials into
// grad_bias (when params.bias_partials is set).
template <typename T>
void launch_forward(ForwardParams<T> params, Activation act, const LaunchPlan& plan, bool vectorized);
template <typename T>
void launch_backward(BackwardParams<T> params, Activation act, const LaunchPlan& plan, bool vectorized,
                     T* grad_bias);

}  // namespace fuseforge::add_mul_act
