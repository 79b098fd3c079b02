// glu's launch interface, shared by the host code (glu_cuda.cpp, compiled by the C++ compiler) and
// the kernels (*.cu): kernel parameters, the grid plan, the launchers.
#pragma once
#include <algorithm>
#include <cstdint>

#include "common/cuda_utils.h"
#include "glu/glu.h"

namespace fuseforge::glu {

constexpr int kThreads = 256;  // threads a block

// Elements a thread owns in a row: one 16-byte vector (8 of a 16-bit type, 4 float32).
template <typename T>
constexpr int elems_per_thread() { return 16 / static_cast<int>(sizeof(T)); }

// Strides are in elements; up may point into gate's rows (the fused form: up = gate + cols).
template <typename T>
struct ForwardParams {
  const T* gate;
  const T* up;
  T* out;  // contiguous rows x cols
  int64_t gate_row_stride, up_row_stride;
  int64_t rows, cols, rows_per_block;
};

// grad_up may point into grad_gate's rows (the fused gradient: row stride 2 * cols).
template <typename T>
struct BackwardParams {
  const T* grad_out;
  const T* gate;
  const T* up;
  T* grad_gate;
  T* grad_up;
  int64_t grad_out_row_stride, gate_row_stride, up_row_stride, grad_gate_row_stride, grad_up_row_stride;
  int64_t rows, cols, rows_per_block;
};

// A block is tx column vectors by ty rows (tx * ty = kThreads); each thread loads rows_per_trip rows
// (ty apart) before it computes, and a block makes trips_per_block such trips. tx is the width in
// {256, 128, 64, 32} that wastes the fewest threads past the row's end (704 vectors, Llama 1B's
// 5632 bf16 columns: 64 x 11, none), the widest on a tie; rows narrower than 32 vectors take the
// next power of two, so a block still holds 256 threads.
struct LaunchPlan {
  dim3 grid, block;
  int64_t rows_per_block = 0;
};

inline LaunchPlan plan_launch(int64_t rows, int64_t cols, int elems_per_thread, int rows_per_trip,
                              int64_t trips_per_block) {
  const int64_t vectors = ceil_div(cols, elems_per_thread);
  int tx = 1;
  if (vectors < 32) {
    while (tx < vectors) tx *= 2;
  } else {
    int64_t least_waste = -1;
    for (int width = kThreads; width >= 32; width /= 2) {
      const int64_t waste = ceil_div(vectors, width) * width - vectors;
      if (least_waste < 0 || waste < least_waste) least_waste = waste, tx = width;
    }
  }
  const int ty = kThreads / tx;
  const int64_t trip_rows = static_cast<int64_t>(ty) * rows_per_trip;
  int64_t rows_per_block = std::max(trip_rows * trips_per_block, ceil_div(rows, 65535));  // gridDim.y limit
  rows_per_block = ceil_div(rows_per_block, trip_rows) * trip_rows;
  LaunchPlan plan;
  plan.block = dim3(tx, ty);
  plan.grid = dim3(static_cast<unsigned>(ceil_div(vectors, tx)), static_cast<unsigned>(ceil_div(rows, rows_per_block)));
  plan.rows_per_block = rows_per_block;
  return plan;
}

// Rows a thread loads before it computes, forward and backward (glu_kernel.cuh; compile-time knobs
// FUSEFORGE_GLU_FWD_ROWS / FUSEFORGE_GLU_BWD_ROWS).
int forward_rows_per_trip();
int backward_rows_per_trip();

// Defined in glu_fwd.cu / glu_bwd.cu for float, at::Half, at::BFloat16; they launch on the current
// stream and never synchronize. vectorized: every pointer 16-byte aligned and cols and every row
// stride multiples of elems_per_thread<T>().
template <typename T>
void launch_forward(const ForwardParams<T>& params, Activation act, const LaunchPlan& plan, bool vectorized);
template <typename T>
void launch_backward(const BackwardParams<T>& params, Activation act, const LaunchPlan& plan, bool vectorized);

}  // namespace fuseforge::glu
