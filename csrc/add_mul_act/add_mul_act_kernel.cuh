// add_mul_act device code. Every tensor is a rows x cols matrix (cols = the bias dim); a thread
// owns 8 consecutive columns (one byte of the relu mask) and walks rows, so the bias is read once
// per thread and its gradient is summed in registers. kVec: the 8 columns are one or two 16-byte
// accesses (pointers 16-byte aligned and cols % 8 == 0); otherwise scalar accesses, masked at the
// row's end.
#pragma once
#include <ATen/ATen.h>

#include "common/activation.h"
#include "add_mul_act/add_mul_act_launch.h"
#include "common/launch.cuh"
#include "common/vec.cuh"

namespace fuseforge::add_mul_act {

// Rows a thread loads before it computes (loads in flight), for 16-bit and 32-bit types, and the
// blocks an SM the register allocation must allow (__launch_bounds__'s second argument; 0: no
// cap). Compile-time knobs so scripts/tune_variants.sh can build and time variants side by
// side on the GPU; the defaults are the measured best (docs/design/add_mul_act.md).
#ifndef FUSEFORGE_AMA_ROWS_16BIT
#define FUSEFORGE_AMA_ROWS_16BIT 4
#endif
#ifndef FUSEFORGE_AMA_ROWS_32BIT
#define FUSEFORGE_AMA_ROWS_32BIT 4
#endif
// erf-GELU's 16-bit forward is bound by its arithmetic, not its loads: one row a trip (48
// registers against 128: 5 blocks an SM, not 2) took it from 0.248 to 0.217 ms on the H200
// (16384 x 8192 bf16; forward+backward 0.611 -> 0.595). SiLU's forward gained 5% but its
// forward+backward lost 1.2%, ReLU's forward 1.5%: they keep 4.
#ifndef FUSEFORGE_AMA_ROWS_16BIT_GELU
#define FUSEFORGE_AMA_ROWS_16BIT_GELU 1
#endif
// SiLU's 16-bit forward that saves no z (inference) takes one row a trip too (0.193 against 0.203
// ms); the forward that saves z keeps 4 (one row: forward+backward 0.538 against 0.531). Where the
// two forwards' rows agree (every other case), they are one kernel.
#ifndef FUSEFORGE_AMA_ROWS_16BIT_SILU_NO_SAVE
#define FUSEFORGE_AMA_ROWS_16BIT_SILU_NO_SAVE 1
#endif
#ifndef FUSEFORGE_AMA_MIN_BLOCKS
#define FUSEFORGE_AMA_MIN_BLOCKS 0
#endif
// The backward's own knobs. 2 rows a trip: with the interleaved one-wave grid, 2 beat 4 on the
// H100 (bf16 relu fwd+bwd 0.5851 -> 0.5846 ms, fp32 relu 1.153 -> 1.128; 1 and 8 rows lost), and it halves the registers (bf16 relu 80 -> 64: 4 blocks an SM).
#ifndef FUSEFORGE_AMA_BWD_ROWS_16BIT
#define FUSEFORGE_AMA_BWD_ROWS_16BIT 2
#endif
#ifndef FUSEFORGE_AMA_BWD_ROWS_32BIT
#define FUSEFORGE_AMA_BWD_ROWS_32BIT 2
#endif
#ifndef FUSEFORGE_AMA_BWD_MIN_BLOCKS
#define FUSEFORGE_AMA_BWD_MIN_BLOCKS FUSEFORGE_AMA_MIN_BLOCKS
#endif
// The forward's rows a trip; kSaves: it stores z or the relu mask for the backward.
template <typename T, Activation A, bool kSaves>
constexpr int rows_unroll() {
  if constexpr (sizeof(T) >= 4) return FUSEFORGE_AMA_ROWS_32BIT;
  if constexpr (A == Activation::kGelu) return FUSEFORGE_AMA_ROWS_16BIT_GELU;
  if constexpr (A == Activation::kSilu && !kSaves) return FUSEFORGE_AMA_ROWS_16BIT_SILU_NO_SAVE;
  return FUSEFORGE_AMA_ROWS_16BIT;
}
template <typename T>
constexpr int backward_rows_unroll() {
  return sizeof(T) >= 4 ? FUSEFORGE_AMA_BWD_ROWS_32BIT : FUSEFORGE_AMA_BWD_ROWS_16BIT;
}

// 8 consecutive elements of a row, as loaded: whole 16-byte vectors, indexed only with
// compile-time constants so they stay in registers.
template <typename T>
struct Group {
  static constexpr int kPerVec = 16 / sizeof(T);
  AlignedVector<T, kPerVec> vec[kGroup / kPerVec];
  __device__ __forceinline__ T& operator[](int j) { return vec[j / kPerVec].val[j % kPerVec]; }
  __device__ __forceinline__ const T& operator[](int j) const { return vec[j / kPerVec].val[j % kPerVec]; }
};

// kVec: one or two 16-byte loads under the L2 policy from l2_evict_last_policy(); otherwise scalar
// loads of the first n (the rest zero). Evict-last on the streamed inputs measured faster on the
// H200 (docs/design/add_mul_act.md), as it did for glu.
template <typename T, bool kVec>
__device__ __forceinline__ void load_group(const T* p, int n, Group<T>& g, uint64_t policy) {
  if constexpr (kVec) {
#pragma unroll
    for (int k = 0; k < kGroup / Group<T>::kPerVec; ++k)
      g.vec[k] = load_vector_l2_hint<T, Group<T>::kPerVec>(p + k * Group<T>::kPerVec, policy);
  } else {
#pragma unroll
    for (int j = 0; j < kGroup; ++j) g[j] = j < n ? p[j] : T(0);
  }
}

template <typename T, bool kVec>
__device__ __forceinline__ void store_group(T* p, int n, const float (&v)[kGroup]) {
  Group<T> g;
#pragma unroll
  for (int j = 0; j < kGroup; ++j) g[j] = static_cast<T>(v[j]);
  if constexpr (kVec) {
#pragma unroll
    for (int k = 0; k < kGroup / Group<T>::kPerVec; ++k)
      store_vector<T, Group<T>::kPerVec>(p + k * Group<T>::kPerVec, g.vec[k]);
  } else {
#pragma unroll
    for (int j = 0; j < kGroup; ++j)
      if (j < n) p[j] = g[j];
  }
}

template <typename T, Activation A, bool kVec, int kUnroll>
__global__ void __launch_bounds__(kThreads, FUSEFORGE_AMA_MIN_BLOCKS) forward_kernel(const ForwardParams<T> p) {
  const int64_t group = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (group >= p.groups_per_row) return;
  const int64_t col0 = group * kGroup;
  const int n = static_cast<int>(min(static_cast<int64_t>(kGroup), p.cols - col0));
  const uint64_t policy = l2_evict_last_policy();
  Group<T> bias_raw;
  float b[kGroup] = {};
  if (p.bias) {
    load_group<T, kVec>(p.bias + col0, n, bias_raw, policy);
#pragma unroll
    for (int j = 0; j < kGroup; ++j) b[j] = static_cast<float>(bias_raw[j]);
  }
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * p.rows_per_block;
  const int64_t row_end = min(p.rows, row_begin + p.rows_per_block);
  for (int64_t r = row_begin + threadIdx.y; r < row_end; r += static_cast<int64_t>(blockDim.y) * kUnroll) {
    Group<T> xg[kUnroll], yg[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t row = r + static_cast<int64_t>(u) * blockDim.y;
      if (row < row_end) {
        load_group<T, kVec>(p.x + row * p.cols + col0, n, xg[u], policy);
        load_group<T, kVec>(p.y + row * p.cols + col0, n, yg[u], policy);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t row = r + static_cast<int64_t>(u) * blockDim.y;
      if (row >= row_end) break;
      float z[kGroup], o[kGroup];
      uint32_t bits = 0;
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        z[j] = fmaf(p.alpha, static_cast<float>(yg[u][j]), static_cast<float>(xg[u][j])) + b[j];
        o[j] = Act<A>::forward(z[j]);
        bits |= static_cast<uint32_t>(z[j] > 0.f) << j;
      }
      const int64_t offset = row * p.cols + col0;
      store_group<T, kVec>(p.out + offset, n, o);
      if (p.saved_z) store_group<T, kVec>(p.saved_z + offset, n, z);
      if (p.saved_mask) p.saved_mask[row * p.groups_per_row + group] = static_cast<uint8_t>(bits);
    }
  }
}

// One backward trip: kUnroll rows (blockDim.y apart) of grad_out and of the saved state, loaded
// together before any is used, so they are in flight at once. (Loading the next trip before this
// one's stores was slower on the H100: more registers, fewer resident blocks.)
template <typename T, int kUnroll>
struct BackwardTrip {
  Group<T> grad[kUnroll], z[kUnroll];
  uint32_t mask[kUnroll];
};

template <typename T, Activation A, bool kVec, int kUnroll>
__device__ __forceinline__ void load_trip(const BackwardParams<T>& p, int64_t r, int64_t row_end, int64_t group,
                                          int n, uint64_t policy, BackwardTrip<T, kUnroll>& t) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t row = r + static_cast<int64_t>(u) * blockDim.y;
    if (row < row_end) {
      load_group<T, kVec>(p.grad_out + row * p.cols + group * kGroup, n, t.grad[u], policy);
      if constexpr (saves_mask(A)) {
        t.mask[u] = p.saved_mask[row * p.groups_per_row + group];
      } else {
        load_group<T, kVec>(p.saved_z + row * p.cols + group * kGroup, n, t.z[u], policy);
      }
    }
  }
}

// grad_x = grad_out * act'(z) (and grad_y = alpha * grad_x) for a loaded trip; grad_x summed into acc.
template <typename T, Activation A, bool kVec, int kUnroll>
__device__ __forceinline__ void finish_trip(const BackwardParams<T>& p, int64_t r, int64_t row_end, int64_t group,
                                            int n, const BackwardTrip<T, kUnroll>& t, float (&acc)[kGroup]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t row = r + static_cast<int64_t>(u) * blockDim.y;
    if (row >= row_end) break;
    float gx[kGroup];
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      float d;
      if constexpr (saves_mask(A)) {
        d = static_cast<float>((t.mask[u] >> j) & 1u);
      } else {
        d = Act<A>::derivative(static_cast<float>(t.z[u][j]));
      }
      gx[j] = static_cast<float>(t.grad[u][j]) * d;
      acc[j] += gx[j];
    }
    const int64_t offset = row * p.cols + group * kGroup;
    store_group<T, kVec>(p.grad_x + offset, n, gx);
    if (p.grad_y) {
#pragma unroll
      for (int j = 0; j < kGroup; ++j) gx[j] *= p.alpha;
      store_group<T, kVec>(p.grad_y + offset, n, gx);
    }
  }
}

// The grid's blocks take the rows in interleaved trips (block y takes trips y, y + gridDim.y, ...),
// so at any moment the resident blocks work on one contiguous band of rows, as a flat elementwise
// kernel does: on the H100 this beat each block walking its own contiguous range of rows
// (docs/design/add_mul_act.md). The assignment is fixed, so grad_bias stays deterministic.
template <typename T, Activation A, bool kVec>
__global__ void __launch_bounds__(kThreads, FUSEFORGE_AMA_BWD_MIN_BLOCKS) backward_kernel(const BackwardParams<T> p) {
  constexpr int kUnroll = backward_rows_unroll<T>();
  // Partial bias sums laid out [column-in-group][threadIdx.y][threadIdx.x] so a warp's stores hit
  // consecutive banks.
  __shared__ float partial[kBackwardStaticSmem / sizeof(float)];
  const int64_t group = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool active = group < p.groups_per_row;
  const int n = active ? static_cast<int>(min(static_cast<int64_t>(kGroup), p.cols - group * kGroup)) : 0;
  float acc[kGroup] = {};
  if (active) {
    const uint64_t policy = l2_evict_last_policy();
    const int64_t trip_rows = static_cast<int64_t>(blockDim.y) * kUnroll;
    const int64_t stride = gridDim.y * trip_rows;
    for (int64_t t0 = blockIdx.y * trip_rows; t0 < p.rows; t0 += stride) {
      BackwardTrip<T, kUnroll> cur;
      const int64_t r = t0 + threadIdx.y, row_end = min(p.rows, t0 + trip_rows);
      load_trip<T, A, kVec, kUnroll>(p, r, row_end, group, n, policy, cur);
      finish_trip<T, A, kVec, kUnroll>(p, r, row_end, group, n, cur, acc);
    }
  }
  if (p.bias_partials == nullptr) return;  // uniform over the grid
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
#pragma unroll
  for (int j = 0; j < kGroup; ++j) partial[j * kThreads + tid] = acc[j];
  __syncthreads();
  // One thread per (column-in-group, threadIdx.x) sums over threadIdx.y in order: deterministic.
  for (int k = tid; k < static_cast<int>(blockDim.x) * kGroup; k += kThreads) {
    const int tx = k % blockDim.x;
    const int j = k / blockDim.x;
    const int64_t col = (static_cast<int64_t>(blockIdx.x) * blockDim.x + tx) * kGroup + j;
    float sum = 0.f;
    for (int ty = 0; ty < static_cast<int>(blockDim.y); ++ty) sum += partial[j * kThreads + ty * blockDim.x + tx];
    if (col < p.cols) p.bias_partials[static_cast<int64_t>(blockIdx.y) * p.cols + col] = sum;
  }
}

// grad_bias[c] = sum over row blocks b of partials[b][c]. A block is 32 columns x 8 slices: slice s
// sums the row blocks b = s, s + 8, ... and the 8 slice sums are added in order: a fixed order, so
// deterministic, with 8 loads in flight per column instead of one.
constexpr int kFinalizeCols = 32;
constexpr int kFinalizeSlices = 8;

template <typename T>
__global__ void __launch_bounds__(kFinalizeCols * kFinalizeSlices)
    bias_grad_finalize_kernel(const float* partials, int64_t row_blocks, int64_t cols, T* grad_bias) {
  __shared__ float slice_sum[kFinalizeSlices][kFinalizeCols];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kFinalizeCols + threadIdx.x;
  float sum = 0.f;
  if (col < cols)
    for (int64_t b = threadIdx.y; b < row_blocks; b += kFinalizeSlices) sum += partials[b * cols + col];
  slice_sum[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.f;
#pragma unroll
    for (int s = 0; s < kFinalizeSlices; ++s) total += slice_sum[s][threadIdx.x];
    grad_bias[col] = static_cast<T>(total);
  }
}

}  // namespace fuseforge::add_mul_act
