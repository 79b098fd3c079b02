// Deterministic column sums of fp32 partials (rows x cols, e.g. one row a block of a backward
// kernel that summed its own rows of a weight or bias gradient): out[c] = sum over r of
// partials[r][c], in a fixed order, so the result does not depend on timing (no float atomics).
#pragma once
#include <cstdint>

#include "common/cuda_utils.h"
#include "common/launch.cuh"

namespace fuseforge {

constexpr int kColumnSumCols = 32;  // columns a block: a warp reads 128 contiguous bytes of a row

// A block is 32 columns x blockDim.y slices: slice s sums rows s, s + blockDim.y, ... (several
// loads in flight), then thread y = 0 adds the slice sums in order.
template <typename Out>
__device__ __forceinline__ void sum_block_columns(const float* partials, int64_t rows, int64_t cols, Out* out) {
  __shared__ float slice_sum[32][kColumnSumCols];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColumnSumCols + threadIdx.x;
  const int slices = blockDim.y;
  float sum = 0.f;
  if (col < cols) {
#pragma unroll 8
    for (int64_t r = threadIdx.y; r < rows; r += slices) sum += partials[r * cols + col];
  }
  slice_sum[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.f;
    for (int s = 0; s < slices; ++s) total += slice_sum[s][threadIdx.x];
    out[col] = static_cast<Out>(total);
  }
}

// gridDim.y sums of the same shape in one launch (a LayerNorm's weight and bias gradients: a launch
// less a backward, which a small batch's step waits for on the host): blockIdx.y picks the sum.
template <typename Out0, typename Out1>
__global__ void __launch_bounds__(1024) column_sum_kernel(const float* partials0, Out0* out0, const float* partials1,
                                                          Out1* out1, int64_t rows, int64_t cols) {
  if (blockIdx.y == 0) {
    sum_block_columns(partials0, rows, cols, out0);
  } else {
    sum_block_columns(partials1, rows, cols, out1);
  }
}

// More slices when there are few columns, so a narrow sum (a q/k norm's 128) still has loads in
// flight on enough SMs; the slice count depends only on the shape, so the order is fixed.
template <typename Out0, typename Out1>
inline void launch_column_sums(const float* partials0, Out0* out0, const float* partials1, Out1* out1, int64_t rows,
                               int64_t cols) {
  const int64_t blocks = ceil_div(cols, kColumnSumCols);
  const int slices = blocks >= 64 ? 8 : 32;
  launch_kernel(column_sum_kernel<Out0, Out1>, dim3(static_cast<unsigned>(blocks), partials1 != nullptr ? 2 : 1),
                dim3(kColumnSumCols, slices), 0, partials0, out0, partials1, out1, rows, cols);
}

template <typename Out>
inline void launch_column_sum(const float* partials, int64_t rows, int64_t cols, Out* out) {
  launch_column_sums(partials, out, static_cast<const float*>(nullptr), static_cast<Out*>(nullptr), rows, cols);
}

}  // namespace fuseforge
