// rms_norm device code. Every tensor is a rows x cols matrix (cols = hidden). Two kernels a
// direction:
// - rows kernels (vectorized, a row that fits in registers): threads_per_row threads hold a row
//   as 16-byte vectors (k{Forward,Backward}RowShapes), so it is read once; a block takes several
//   narrow rows at once (the forward's kForwardMinThreads, the backward's 256 threads); blocks walk
//   the rows in a grid-stride loop (the backward: one wave of resident blocks, each summing its
//   weight-gradient partials in registers over all the rows it takes).
// - two-pass kernels (rows too long for registers, or not vectorizable): a block a row, the row
//   read twice (the second read mostly from L2); N = elements an access (a vector or 1).
// All arithmetic is fp32; reductions have a fixed order (deterministic results).
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "common/async_copy.cuh"
#include "common/column_sum.cuh"
#include "common/cuda_utils.h"
#include "common/dispatch.h"
#include "common/env.h"
#include "common/launch.cuh"
#include "common/vec.cuh"
#include "rms_norm/rms_norm_launch.h"

namespace fuseforge::rms_norm {

template <typename T>
inline constexpr int kVecElems = 16 / static_cast<int>(sizeof(T));

template <typename U>
struct TypeTag {
  using type = U;
};

// Calls f(TypeTag<U>{}) with U the element type of a run-time dtype, compiling only the types
// that occur beside activations of type T. The weight: T or float32.
template <typename T, typename F>
__device__ __forceinline__ void with_weight_type(Dtype dtype, F&& f) {
  if constexpr (!std::is_same_v<T, float>) {
    if (dtype == Dtype::kFloat) return f(TypeTag<float>{});
  }
  f(TypeTag<T>{});
}

// out and grad_out: T, or bf16 / fp16 beside a float32 T.
template <typename T, typename F>
__device__ __forceinline__ void with_out_type(Dtype dtype, F&& f) {
  if constexpr (std::is_same_v<T, float>) {
    if (dtype == Dtype::kBFloat16) return f(TypeTag<at::BFloat16>{});
    if (dtype == Dtype::kHalf) return f(TypeTag<at::Half>{});
  }
  f(TypeTag<T>{});
}

// N consecutive elements as floats, in accesses of min(16 bytes, the N elements) each (a 16-bit
// element alone: one 2-byte access).
template <int N, typename U>
__device__ __forceinline__ void load_floats(const U* p, float (&v)[N]) {
  if constexpr (N % kElemsPerWord<U> != 0) {
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = static_cast<float>(p[j]);
  } else {
    constexpr int kAccess = 16 / static_cast<int>(sizeof(U)) < N ? 16 / static_cast<int>(sizeof(U)) : N;
#pragma unroll
    for (int a = 0; a < N / kAccess; ++a) {
      PackedElements<U, kAccess> chunk;
      chunk.load(p + a * kAccess);
#pragma unroll
      for (int j = 0; j < kAccess; ++j) v[a * kAccess + j] = chunk.get(j);
    }
  }
}

template <int N, typename U>
__device__ __forceinline__ void store_floats(U* p, const float (&v)[N]) {
  if constexpr (N % kElemsPerWord<U> != 0) {
#pragma unroll
    for (int j = 0; j < N; ++j) p[j] = static_cast<U>(v[j]);
  } else {
    constexpr int kAccess = 16 / static_cast<int>(sizeof(U)) < N ? 16 / static_cast<int>(sizeof(U)) : N;
#pragma unroll
    for (int a = 0; a < N / kAccess; ++a) {
      float part[kAccess];
#pragma unroll
      for (int j = 0; j < kAccess; ++j) part[j] = v[a * kAccess + j];
      PackedElements<U, kAccess> chunk;
      chunk.set(part);
      chunk.store(p + a * kAccess);
    }
  }
}

// weight_offset + weight for the N columns from col, or 1 without a weight (no scale). The weight
// is read for every row: it stays in L1/L2 and would cost registers the row needs.
template <typename T, int N>
__device__ __forceinline__ void load_scale(const void* weight, Dtype dtype, float offset, int64_t col,
                                           float (&s)[N]) {
  if (weight == nullptr) {
#pragma unroll
    for (int j = 0; j < N; ++j) s[j] = 1.f;
    return;
  }
  with_weight_type<T>(dtype, [&](auto tag) {
    using W = typename decltype(tag)::type;
    load_floats<N>(static_cast<const W*>(weight) + col, s);
  });
#pragma unroll
  for (int j = 0; j < N; ++j) s[j] = offset + s[j];
}

template <typename T, int kThreadsPerRow_, int kVecs_, int kMinThreads = 256>
struct RowTraits {
  static constexpr int kThreadsPerRow = kThreadsPerRow_;
  static constexpr int kVecs = kVecs_;
  static constexpr int kElems = kVecElems<T>;
  static constexpr int kThreads = kThreadsPerRow > kMinThreads ? kThreadsPerRow : kMinThreads;
  static constexpr int kRowsPerIter = kThreads / kThreadsPerRow;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kWarpsPerRow = kThreadsPerRow >= 32 ? kThreadsPerRow / 32 : 1;
  // The weight gradient's partial sums: after the warp shuffles, one set a warp (narrow rows) or a
  // row slot (wide rows), held by the first kThreadsPerRow threads of each group.
  static constexpr int kGroupThreads = kThreadsPerRow > 32 ? kThreadsPerRow : 32;
  static constexpr int kGroups = kThreads / kGroupThreads;
  // The forward reads rows of up to 16 KB under an L2 evict-last policy, as torch.compile's norm
  // marks its first read of a row (docs/design/rms_norm.md): 16384 x 8192 bf16 0.131 against 0.136
  // ms, 262144 x 128 bf16 0.038 against 0.039; 32 KB rows (fp32 8192) were slower with it (0.204
  // against 0.193). The backward's reads under it were slower (8192 bf16 fwd+bwd 0.356 vs 0.349).
  static constexpr bool kL2EvictLast = kThreadsPerRow * kVecs <= 1024;
  static_assert(kThreadsPerRow <= 32 || kThreadsPerRow % 32 == 0, "wide rows take whole warps");
  static_assert((kThreadsPerRow & (kThreadsPerRow - 1)) == 0, "the shuffles pair lanes by xor");
};

// The forward's block: a row's threads, or kForwardMinThreads when a row takes fewer (several rows a
// block). LayerNorm's at 64 (H200, 16384 rows bf16, ms: 1024 / 2048 / 4096 0.0253 / 0.0381 / 0.0725
// against 0.0259 / 0.0406 / 0.0762 at 256, in an A/B run); RMSNorm's stay at 256 (2048 bf16 0.0353
// against 0.0357 at 64).
template <bool kCentered>
inline constexpr int kForwardMinThreads = kCentered ? 64 : 256;
template <typename T, int kShape, bool kCentered>
using ForwardRow = RowTraits<T, kForwardRowShapes[kShape].threads_per_row, kForwardRowShapes[kShape].vecs,
                             kForwardMinThreads<kCentered>>;
template <typename T, int kShape>
using BackwardRow = RowTraits<T, kBackwardRowShapes[kShape].threads_per_row, kBackwardRowShapes[kShape].vecs>;

// The sum of v over the kThreadsPerRow threads of a row, which all get it, bit for bit (the xor
// butterfly adds the same pairs in every lane; the warps are added in order). Wide rows go through
// red[parity]: alternating halves let one barrier a row suffice.
template <typename R>
__device__ __forceinline__ float row_sum(float v, float* red, int parity) {
  constexpr int kWidth = R::kThreadsPerRow < 32 ? R::kThreadsPerRow : 32;
#pragma unroll
  for (int o = kWidth / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if constexpr (R::kThreadsPerRow <= 32) {
    return v;
  } else {
    float* buf = red + parity * R::kWarps;
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) buf[warp] = v;
    __syncthreads();
    const int first = warp / R::kWarpsPerRow * R::kWarpsPerRow;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < R::kWarpsPerRow; ++w) sum += buf[first + w];
    return sum;
  }
}

// The sum of v over the block (blockDim.x a multiple of 32), which every thread gets.
__device__ __forceinline__ float block_sum(float v, float* red /* [32] */) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float sum = 0.f;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) sum += red[w];
  __syncthreads();  // red is reused by the next call
  return sum;
}

// ---- forward ----------------------------------------------------------------------------------
// kCentered (LayerNorm): mean = the row's mean, rstd from the mean of (h - mean)^2 (a second reduction
// over the row in registers: exact where the mean dwarfs the deviations), out = (h - mean) * rstd * w + b.

// kBackwardShape: the row held as the backward's shape kShape (two vectors a thread) instead of the
// forward's (the residual form's, residual_takes_two_vectors).
template <typename T, int kShape, bool kCentered, bool kBackwardShape>
using ForwardKernelRow =
    std::conditional_t<kBackwardShape, BackwardRow<T, kShape>, ForwardRow<T, kShape, kCentered>>;
// The plain and the residual forward's rows of shape kShape, for make_plan.
template <bool kCentered>
struct ForwardRows {
  template <typename T, int kShape>
  using Plain = ForwardRow<T, kShape, kCentered>;
  template <typename T, int kShape>
  using Residual = ForwardKernelRow<T, kShape, kCentered, residual_takes_two_vectors(kCentered, kShape)>;
};

// x's dtype as the kernels' run-time Dtype (the weight's and bias's, when they are x's).
template <typename T>
inline constexpr Dtype kDtypeOf =
    std::is_same_v<T, float> ? Dtype::kFloat : (std::is_same_v<T, at::Half> ? Dtype::kHalf : Dtype::kBFloat16);

// LayerNorm's preloading shapes are held to 768 resident threads an SM: the weight's and bias's
// words took ptxas to 87-90 registers (512 threads) without the bound, 80 with it and no spill. 0:
// no bound (a minimum of 1 block changes ptxas's allocation: 40 -> 70 registers at 32 x 4).
template <typename T, int kShape, bool kCentered, bool kBackwardShape, int kThreads>
constexpr int forward_min_blocks() {
  return kCentered && !kBackwardShape && preloads_scale(kCentered, kShape, sizeof(T)) ? 768 / kThreads : 0;
}

// forward_rows_kernel's body. kPreloaded: the weight (and bias) of the thread's columns loaded as
// words of T ahead of each row group's own loads (preloads_scale's shapes, parameters of x's
// dtype), so the output step waits on no load; otherwise it loads them (L1 hits) after the row's
// reductions.
template <typename T, int kShape, bool kCentered, bool kBackwardShape, bool kPreloaded>
__device__ __forceinline__ void forward_rows(const ForwardParams<T> p) {
  using R = ForwardKernelRow<T, kShape, kCentered, kBackwardShape>;
  constexpr int E = R::kElems;
  __shared__ float red[2 * R::kWarps];
  const int lane = threadIdx.x % R::kThreadsPerRow;
  const int slot = threadIdx.x / R::kThreadsPerRow;
  const int64_t vectors = p.cols / E;
  const uint64_t policy = R::kL2EvictLast ? l2_evict_last_policy() : 0;
  const auto load_row = [&](PackedElements<T, E>& v, const T* src) {
    if constexpr (R::kL2EvictLast) {
      v.load_l2_hint(src, policy);
    } else {
      v.load(src);
    }
  };
  int parity = 0;
  // Every thread of the block takes the same trips (the barriers of row_sum).
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * R::kRowsPerIter; first < p.rows;
       first += static_cast<int64_t>(gridDim.x) * R::kRowsPerIter, parity ^= 1) {
    const int64_t row = first + slot;
    const bool row_ok = row < p.rows;
    const int64_t base = row * p.cols;
    [[maybe_unused]] PackedElements<T, E> weight[kPreloaded ? R::kVecs : 1];
    [[maybe_unused]] PackedElements<T, E> bias[kPreloaded && kCentered ? R::kVecs : 1];
    if constexpr (kPreloaded) {
#pragma unroll
      for (int v = 0; v < R::kVecs; ++v) {
        const int64_t vi = static_cast<int64_t>(v) * R::kThreadsPerRow + lane;
        if (vi < vectors) {
          weight[v].load(static_cast<const T*>(p.weight) + vi * E);
          if constexpr (kCentered) bias[v].load(static_cast<const T*>(p.bias) + vi * E);
        }
      }
    }
    // The row as words (PackedElements): 16-bit elements two to a register.
    PackedElements<T, E> h[R::kVecs];
#pragma unroll
    for (int v = 0; v < R::kVecs; ++v) {
      const int64_t vi = static_cast<int64_t>(v) * R::kThreadsPerRow + lane;
      if (row_ok && vi < vectors) {
        load_row(h[v], p.x + base + vi * E);
      } else {
        h[v].set_zero();
      }
    }
    if (p.residual != nullptr) {
      PackedElements<T, E> r[R::kVecs];
#pragma unroll
      for (int v = 0; v < R::kVecs; ++v) {
        const int64_t vi = static_cast<int64_t>(v) * R::kThreadsPerRow + lane;
        if (row_ok && vi < vectors) {
          load_row(r[v], p.residual + base + vi * E);
        } else {
          r[v].set_zero();
        }
      }
#pragma unroll
      for (int v = 0; v < R::kVecs; ++v) {
        // h rounded to T, as the unfused `residual + x` is, before it is squared.
        float sum[E];
#pragma unroll
        for (int j = 0; j < E; ++j) sum[j] = h[v].get(j) + r[v].get(j);
        h[v].set(sum);
        const int64_t vi = static_cast<int64_t>(v) * R::kThreadsPerRow + lane;
        if (row_ok && vi < vectors) h[v].store(p.residual_out + base + vi * E);
      }
    }
    float mean = 0.f;
    if constexpr (kCentered) {
      float sum = 0.f;
#pragma unroll
      for (int v = 0; v < R::kVecs; ++v)
#pragma unroll
        for (int j = 0; j < E; ++j) sum += h[v].get(j);
      mean = row_sum<R>(sum, red, parity) / static_cast<float>(p.cols);
      parity ^= 1;  // the next reduction takes the other buffer (and the loop's toggle brings this one back)
      if (p.mean != nullptr && row_ok && lane == 0) p.mean[row] = mean;
    }
    float sumsq = 0.f;
#pragma unroll
    for (int v = 0; v < R::kVecs; ++v) {
      const int64_t vi = static_cast<int64_t>(v) * R::kThreadsPerRow + lane;
      if (kCentered && vi >= vectors) continue;  // a zeroed vector is no deviation of 0 from the mean
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const float f = h[v].get(j) - mean;
        sumsq = fmaf(f, f, sumsq);
      }
    }
    sumsq = row_sum<R>(sumsq, red, parity);
    const float rstd = 1.f / sqrtf(sumsq / static_cast<float>(p.cols) + p.eps);
    if (p.rstd != nullptr && row_ok && lane == 0) p.rstd[row] = rstd;
    with_out_type<T>(p.out_dtype, [&](auto tag) {
      using O = typename decltype(tag)::type;
#pragma unroll
      for (int v = 0; v < R::kVecs; ++v) {
        const int64_t vi = static_cast<int64_t>(v) * R::kThreadsPerRow + lane;
        if (!row_ok || vi >= vectors) continue;
        float o[E];
        if constexpr (kPreloaded) {
#pragma unroll
          for (int j = 0; j < E; ++j) o[j] = (h[v].get(j) - mean) * rstd * (p.weight_offset + weight[v].get(j));
          if constexpr (kCentered) {
#pragma unroll
            for (int j = 0; j < E; ++j) o[j] += bias[v].get(j);
          }
        } else {
          float s[E];
          load_scale<T, E>(p.weight, p.weight_dtype, p.weight_offset, vi * E, s);
#pragma unroll
          for (int j = 0; j < E; ++j) o[j] = (h[v].get(j) - mean) * rstd * s[j];
          if (kCentered && p.bias != nullptr) {
            float b[E];
            load_scale<T, E>(p.bias, p.bias_dtype, 0.f, vi * E, b);
#pragma unroll
            for (int j = 0; j < E; ++j) o[j] += b[j];
          }
        }
        store_floats<E>(static_cast<O*>(p.out) + base + vi * E, o);
      }
    });
  }
}

template <typename T, int kShape, bool kCentered, bool kBackwardShape>
__global__ void __launch_bounds__(ForwardKernelRow<T, kShape, kCentered, kBackwardShape>::kThreads,
                                  forward_min_blocks<T, kShape, kCentered, kBackwardShape,
                                                     ForwardKernelRow<T, kShape, kCentered, kBackwardShape>::kThreads>())
    forward_rows_kernel(const ForwardParams<T> p) {
  if constexpr (!kBackwardShape && preloads_scale(kCentered, kShape, sizeof(T))) {
    // Uniform over the grid: a weight (and LayerNorm's bias) of x's dtype.
    if (p.weight != nullptr && p.weight_dtype == kDtypeOf<T> &&
        (!kCentered || (p.bias != nullptr && p.bias_dtype == kDtypeOf<T>))) {
      return forward_rows<T, kShape, kCentered, kBackwardShape, true>(p);
    }
  }
  forward_rows<T, kShape, kCentered, kBackwardShape, false>(p);
}

// One access of a two-pass row: N elements as whole 32-bit words (PackedElements), or a lone
// 16-bit element (the scalar path) as a float.
template <typename T, int N, bool kWords = (N % kElemsPerWord<T> == 0)>
struct RowAccess : PackedElements<T, N> {};
template <typename T, int N>
struct RowAccess<T, N, false> {
  static_assert(N == 1, "a lone 16-bit element");
  float f;
  __device__ __forceinline__ void load(const T* p) { f = static_cast<float>(*p); }
  __device__ __forceinline__ void store(T* p) const { *p = static_cast<T>(f); }
  __device__ __forceinline__ void set_zero() { f = 0.f; }
  __device__ __forceinline__ float get(int) const { return f; }
  __device__ __forceinline__ void set(const float (&v)[N]) { f = static_cast<float>(static_cast<T>(v[0])); }
};

// Accesses a two-pass forward thread loads in a loop trip before it uses any (a compile-time knob,
// so scripts/tune_variants.sh can build variants side by side). Two, at two 1024-thread blocks an SM
// (32 registers; 4-16 bytes of spill): one a trip left the DRAM idle between a thread's trips, four
// (58 registers, one block an SM) left it idle while the SM's one row was in its second pass.
#ifndef FUSEFORGE_RMS_NORM_TWO_PASS_BATCH
#define FUSEFORGE_RMS_NORM_TWO_PASS_BATCH 2
#endif

template <typename T, int N, bool kCentered>
__global__ void __launch_bounds__(1024, 2) forward_two_pass_kernel(const ForwardParams<T> p) {
  constexpr int kBatch = FUSEFORGE_RMS_NORM_TWO_PASS_BATCH;
  using A = RowAccess<T, N>;
  // The first read of a row under an L2 evict-last policy, as the rows kernels read theirs, so
  // that the second pass finds it in L2 (16-byte accesses).
  constexpr bool kEvictLast = N * sizeof(T) == 16;
  __shared__ float red[32];
  const int64_t accesses = p.cols / N;
  const int64_t step = blockDim.x;
  const uint64_t policy = kEvictLast ? l2_evict_last_policy() : 0;
  // The second pass reads h back: from residual_out, which this thread wrote itself.
  const T* h_src = p.residual != nullptr ? p.residual_out : p.x;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int64_t base = row * p.cols;
    // A trip's kBatch accesses i0, i0 + step, ...: a thread's accesses in the order one a trip
    // takes them, so the sums' order is that of one a trip; those past the row's end are zeros.
    const auto load_batch = [&](A (&v)[kBatch], const T* src, int64_t i0, bool first_read) {
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int64_t i = i0 + u * step;
        if (i < accesses) {
          if constexpr (kEvictLast) {
            if (first_read) {
              v[u].load_l2_hint(src + base + i * N, policy);
              continue;
            }
          }
          v[u].load(src + base + i * N);
        } else {
          v[u].set_zero();
        }
      }
    };
    float sumsq = 0.f;
    for (int64_t i0 = threadIdx.x; i0 < accesses; i0 += kBatch * step) {
      A h[kBatch];
      load_batch(h, p.x, i0, true);
      if (p.residual != nullptr) {
        A r[kBatch];
        load_batch(r, p.residual, i0, true);
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          float sum[N];  // h rounded to T, as the unfused `residual + x` is, before it is squared
#pragma unroll
          for (int j = 0; j < N; ++j) sum[j] = h[u].get(j) + r[u].get(j);
          h[u].set(sum);
          if (i0 + u * step < accesses) h[u].store(p.residual_out + base + (i0 + u * step) * N);
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const float f = h[u].get(j);
          sumsq = kCentered ? sumsq + f : fmaf(f, f, sumsq);  // centered: the sum
        }
    }
    sumsq = block_sum(sumsq, red);
    float mean = 0.f;
    if constexpr (kCentered) {
      // A second read of the row for the deviations' squares (an L2 hit mostly).
      mean = sumsq / static_cast<float>(p.cols);
      if (p.mean != nullptr && threadIdx.x == 0) p.mean[row] = mean;
      sumsq = 0.f;
      for (int64_t i0 = threadIdx.x; i0 < accesses; i0 += kBatch * step) {
        A h[kBatch];
        load_batch(h, h_src, i0, false);
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          if (i0 + u * step >= accesses) continue;  // a zeroed access is no deviation of 0 from the mean
#pragma unroll
          for (int j = 0; j < N; ++j) sumsq = fmaf(h[u].get(j) - mean, h[u].get(j) - mean, sumsq);
        }
      }
      sumsq = block_sum(sumsq, red);
    }
    const float rstd = 1.f / sqrtf(sumsq / static_cast<float>(p.cols) + p.eps);
    if (p.rstd != nullptr && threadIdx.x == 0) p.rstd[row] = rstd;
    with_out_type<T>(p.out_dtype, [&](auto tag) {
      using O = typename decltype(tag)::type;
      for (int64_t i0 = threadIdx.x; i0 < accesses; i0 += kBatch * step) {
        A h[kBatch];
        load_batch(h, h_src, i0, false);
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int64_t i = i0 + u * step;
          if (i >= accesses) continue;
          float s[N], o[N];
          load_scale<T, N>(p.weight, p.weight_dtype, p.weight_offset, i * N, s);
#pragma unroll
          for (int j = 0; j < N; ++j) o[j] = (h[u].get(j) - mean) * rstd * s[j];
          if (kCentered && p.bias != nullptr) {
            float b[N];
            load_scale<T, N>(p.bias, p.bias_dtype, 0.f, i * N, b);
#pragma unroll
            for (int j = 0; j < N; ++j) o[j] += b[j];
          }
          store_floats<N>(static_cast<O*>(p.out) + base + i * N, o);
        }
      }
    });
  }
}

// RMSNorm without a residual on rows of kRereadRowShapes[kShape] (rms_norm_launch.h): a block a row,
// each thread reading its vectors for the sum of squares (L1 evict-last, L2 evict-last, as the rows
// kernels' first read), then each again for the output (L1 hits, evict-first). The row is not kept
// in registers across the reduction: 2048 resident threads an SM at 32 registers.
template <typename T, int kShape>
using RereadRow = RowTraits<T, kRereadRowShapes[kShape].threads_per_row, kRereadRowShapes[kShape].vecs>;

template <typename T, int kShape>
__global__ void __launch_bounds__(RereadRow<T, kShape>::kThreads, 2048 / RereadRow<T, kShape>::kThreads)
    forward_reread_kernel(const ForwardParams<T> p) {
  using R = RereadRow<T, kShape>;
  static_assert(R::kThreadsPerRow == R::kThreads, "a block a row");
  constexpr int E = R::kElems;
  __shared__ float red[2 * R::kWarps];
  const int lane = threadIdx.x;
  const int64_t vectors = p.cols / E;
  const uint64_t keep = l2_policy<Eviction::kLast>(), drop = l2_policy<Eviction::kFirst>();
  int parity = 0;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x, parity ^= 1) {
    const T* x = p.x + row * p.cols;
    float sumsq = 0.f;
    {
      PackedElements<T, E> h[R::kVecs];
#pragma unroll
      for (int v = 0; v < R::kVecs; ++v) {
        const int64_t vi = static_cast<int64_t>(v) * R::kThreadsPerRow + lane;
        if (vi < vectors) {
          h[v].template load_cached<Eviction::kLast>(x + vi * E, keep);
        } else {
          h[v].set_zero();
        }
      }
#pragma unroll
      for (int v = 0; v < R::kVecs; ++v)
#pragma unroll
        for (int j = 0; j < E; ++j) sumsq = fmaf(h[v].get(j), h[v].get(j), sumsq);
    }
    sumsq = row_sum<R>(sumsq, red, parity);
    const float rstd = 1.f / sqrtf(sumsq / static_cast<float>(p.cols) + p.eps);
    if (p.rstd != nullptr && lane == 0) p.rstd[row] = rstd;
    with_out_type<T>(p.out_dtype, [&](auto tag) {
      using O = typename decltype(tag)::type;
#pragma unroll
      for (int v = 0; v < R::kVecs; ++v) {
        const int64_t vi = static_cast<int64_t>(v) * R::kThreadsPerRow + lane;
        if (vi >= vectors) continue;
        PackedElements<T, E> h;
        h.template load_cached<Eviction::kFirst>(x + vi * E, drop);
        float s[E], o[E];
        load_scale<T, E>(p.weight, p.weight_dtype, p.weight_offset, vi * E, s);
#pragma unroll
        for (int j = 0; j < E; ++j) o[j] = h.get(j) * rstd * s[j];
        store_floats<E>(static_cast<O*>(p.out) + row * p.cols + vi * E, o);
      }
    });
  }
}

// RMSNorm without a residual on 16-bit rows of kNarrowThreadsPerRow vectors (takes_narrow_rows): a
// thread loads its vector of each of its two rows, then the weight's, so a block's rows are all in
// flight at once; 16-lane shuffles; rstd from rsqrtf (MUFU.RSQ, 2 ulp) as torch.compile's norm takes
// it: with `1 / sqrtf` the same kernel ran 2% slower. W, the weight's type (T or float; void: no
// weight), is a template parameter rather than load_scale's run-time switch: 38 registers instead
// of 40 (H200, 262144 x 128 bf16: 0.0362 ms against 0.0367).
template <typename T, typename W>
__global__ void __launch_bounds__(kNarrowThreads, 2048 / kNarrowThreads / 2)
    forward_narrow_kernel(const ForwardParams<T> p) {
  static_assert(sizeof(T) == 2, "16-bit rows");
  constexpr int E = kVecElems<T>;
  constexpr int kCols = kNarrowThreadsPerRow * E;
  constexpr int kRowsPerPass = kNarrowThreads / kNarrowThreadsPerRow;
  const int lane = threadIdx.x % kNarrowThreadsPerRow;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kNarrowRowsPerBlock + threadIdx.x / kNarrowThreadsPerRow;
  const int64_t offset = row0 * kCols + lane * E;
  PackedElements<T, E> h[kNarrowRowsPerThread];
#pragma unroll
  for (int r = 0; r < kNarrowRowsPerThread; ++r) {
    if (row0 + r * kRowsPerPass < p.rows) {
      h[r].load(p.x + offset + r * kRowsPerPass * kCols);
    } else {
      h[r].set_zero();
    }
  }
  float s[E];
  if constexpr (std::is_void_v<W>) {
#pragma unroll
    for (int j = 0; j < E; ++j) s[j] = 1.f;
  } else {
    load_floats<E>(static_cast<const W*>(p.weight) + lane * E, s);
#pragma unroll
    for (int j = 0; j < E; ++j) s[j] += p.weight_offset;
  }
  float sumsq[kNarrowRowsPerThread];
#pragma unroll
  for (int r = 0; r < kNarrowRowsPerThread; ++r) {
    sumsq[r] = 0.f;
#pragma unroll
    for (int j = 0; j < E; ++j) sumsq[r] = fmaf(h[r].get(j), h[r].get(j), sumsq[r]);
  }
#pragma unroll
  for (int o = kNarrowThreadsPerRow / 2; o > 0; o >>= 1)
#pragma unroll
    for (int r = 0; r < kNarrowRowsPerThread; ++r) sumsq[r] += __shfl_xor_sync(0xffffffffu, sumsq[r], o);
#pragma unroll
  for (int r = 0; r < kNarrowRowsPerThread; ++r) {
    const int64_t row = row0 + r * kRowsPerPass;
    if (row >= p.rows) continue;
    const float rstd = rsqrtf(sumsq[r] * (1.f / kCols) + p.eps);
    if (p.rstd != nullptr && lane == 0) p.rstd[row] = rstd;
    float o[E];
#pragma unroll
    for (int j = 0; j < E; ++j) o[j] = h[r].get(j) * rstd * s[j];
    store_floats<E>(static_cast<T*>(p.out) + offset + r * kRowsPerPass * kCols, o);
  }
}

// ---- backward ---------------------------------------------------------------------------------
// With xhat = h * rstd and s = weight_offset + weight: grad_input = rstd * (g s - xhat * mean(g s
// xhat)) (+ grad_residual_out); the weight gradient sums g * xhat over the rows. kCentered
// (LayerNorm): xhat = (h - mean) * rstd, grad_input = rstd * (g s - mean(g s) - xhat * mean(g s xhat)),
// and the bias gradient sums g over the rows.

// The backward's resident threads an SM that ptxas must leave room for (a compile-time knob, so
// scripts/tune_variants.sh can build variants side by side): 64 registers, four 256-thread blocks
// an SM, not the two that 89-97 registers allowed (the DRAM idle while a block waits at its row's
// barrier).
#ifndef FUSEFORGE_RMS_NORM_BWD_THREADS_PER_SM
#define FUSEFORGE_RMS_NORM_BWD_THREADS_PER_SM 1024
#endif
// LayerNorm's 16-bit backward keeps the bias gradient's sums too: half the resident threads (128
// registers; at 1024 its 8192-wide rows ran 0.575 against 0.496 ms, with 152 bytes of spill), its
// float32 one as many as RMSNorm's (64 registers, no spill: 4096-wide 0.300 against 0.409 ms at 512).
template <typename R, bool kCentered>
constexpr int min_blocks_per_sm() {
  constexpr int kThreadsPerSm = FUSEFORGE_RMS_NORM_BWD_THREADS_PER_SM / (kCentered && R::kElems != 4 ? 2 : 1);
  return R::kThreads >= kThreadsPerSm ? 1 : kThreadsPerSm / R::kThreads;
}

// A compile-time knob (0: the loads straight into registers; 1: h and grad_out staged, not the
// residual's gradient), so scripts/tune_variants.sh can build variants side by side.
#ifndef FUSEFORGE_NORM_BWD_STAGED
#define FUSEFORGE_NORM_BWD_STAGED 2
#endif
// LayerNorm's 16-bit backward takes a row group of h and grad_out into shared memory with cp.async
// one trip ahead (each thread copies the vectors it will read itself), so that its SM's loads stay
// in flight while it reduces and writes the row group before: at 96-122 registers one block an SM,
// whose rows are otherwise the only ones there (H200, 16384 x 8192 bf16 forward + backward 0.432 ms
// against 0.492). Rows kernels of up to 1024 vectors a block (32 KB).
template <typename T, typename R, bool kCentered>
inline constexpr bool kStagedBackward =
    FUSEFORGE_NORM_BWD_STAGED && kCentered && sizeof(T) == 2 && R::kThreads * R::kVecs <= 1024;
// The residual's gradient staged with them where a block's row group is up to 512 vectors (a third
// 16 KB): otherwise it is the one load a row group waits on (residual form, bf16 forward + backward,
// 16384 x 2048 / 4096: 0.1623 / 0.3032 ms against 0.1659-0.1682 / 0.3093-0.3095).
template <typename T, typename R, bool kCentered>
inline constexpr bool kStagedResidual =
    kStagedBackward<T, R, kCentered> && FUSEFORGE_NORM_BWD_STAGED >= 2 && R::kThreads * R::kVecs <= 512;

template <typename T, int kShape, bool kCentered>
__global__ void __launch_bounds__(BackwardRow<T, kShape>::kThreads,
                                  min_blocks_per_sm<BackwardRow<T, kShape>, kCentered>())
    backward_rows_kernel(const BackwardParams<T> p) {
  using R = BackwardRow<T, kShape>;
  constexpr int E = R::kElems;
  constexpr int kExchange = R::kGroups > 1 ? R::kGroups * E * R::kThreadsPerRow : 1;
  constexpr bool kStaged = kStagedBackward<T, R, kCentered>;
  __shared__ float red[2 * R::kWarps];
  __shared__ float exchange[kExchange];
  // [tensor: h, grad_out, grad_residual_out where staged][vector][thread], 16 bytes each.
  constexpr bool kStagedRes = kStagedResidual<T, R, kCentered>;
  __shared__ AlignedVector<uint32_t, 4> stage[kStaged ? (kStagedRes ? 3 : 2) * R::kVecs * R::kThreads : 1];
  const int lane = threadIdx.x % R::kThreadsPerRow;
  const int slot = threadIdx.x / R::kThreadsPerRow;
  const int64_t vectors = p.cols / E;
  const bool want_weight = p.weight_partials != nullptr;  // uniform over the grid
  const bool want_bias = kCentered && p.bias_partials != nullptr;
  // The weight (and bias) gradient's sums for this thread's columns over all the rows its block takes,
  // in registers (ptxas fits the weight's in min_blocks_per_sm's 64 registers without spills since the
  // rows are packed words; in shared memory they cost 16384 x 8192 bf16 forward + backward 4%).
  float dw[R::kVecs][E];
  float db[kCentered ? R::kVecs : 1][E];
#pragma unroll
  for (int v = 0; v < R::kVecs; ++v)
#pragma unroll
    for (int j = 0; j < E; ++j) {
      dw[v][j] = 0.f;
      if constexpr (kCentered) db[v][j] = 0.f;
    }
  // kStaged: this thread's vectors of h and grad_out of row group `first` (zeros past the ends) into
  // its stage slots.
  [[maybe_unused]] const auto stage_rows = [&](int64_t first) {
    const int64_t row = first + slot;
#pragma unroll
    for (int v = 0; v < R::kVecs; ++v) {
      const int64_t vi = static_cast<int64_t>(v) * R::kThreadsPerRow + lane;
      const bool valid = row < p.rows && vi < vectors;
      const int64_t offset = valid ? row * p.cols + vi * E : 0;
      cp_async_16(smem_addr(&stage[v * R::kThreads + threadIdx.x]), p.h + offset, valid);
      cp_async_16(smem_addr(&stage[(R::kVecs + v) * R::kThreads + threadIdx.x]),
                  static_cast<const T*>(p.grad_out) + offset, valid);
      if constexpr (kStagedRes) {
        if (p.grad_residual_out != nullptr)
          cp_async_16(smem_addr(&stage[(2 * R::kVecs + v) * R::kThreads + threadIdx.x]), p.grad_residual_out + offset,
                      valid);
      }
    }
    cp_async_commit();
  };
  if constexpr (kStaged) stage_rows(static_cast<int64_t>(blockIdx.x) * R::kRowsPerIter);
  int parity = 0;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * R::kRowsPerIter; first < p.rows;
       first += static_cast<int64_t>(gridDim.x) * R::kRowsPerIter, parity ^= 1) {
    const int64_t row = first + slot;
    const bool row_ok = row < p.rows;
    const int64_t base = row * p.cols;
    // The rows as words (PackedElements: 16-bit elements two to a register). g is kept as T
    // (exact: a 16-bit grad_out is T itself, and beside a float32 T any out dtype converts exactly).
    PackedElements<T, E> h[R::kVecs], g[R::kVecs], grad_res[R::kVecs];
    if constexpr (kStaged) {
      cp_async_wait<0>();
      asm volatile("" ::: "memory");  // the reads below stay after the wait
#pragma unroll
      for (int v = 0; v < R::kVecs; ++v) {
        h[v].words = stage[v * R::kThreads + threadIdx.x];
        g[v].words = stage[(R::kVecs + v) * R::kThreads + threadIdx.x];
        if constexpr (kStagedRes) grad_res[v].words = stage[(2 * R::kVecs + v) * R::kThreads + threadIdx.x];
      }
      // The slots are this thread's own, read above before the next group's copies overwrite them.
      asm volatile("" ::: "memory");
      const int64_t next = first + static_cast<int64_t>(gridDim.x) * R::kRowsPerIter;
      if (next < p.rows) stage_rows(next);
    } else {
#pragma unroll
      for (int v = 0; v < R::kVecs; ++v) {
        const int64_t vi = static_cast<int64_t>(v) * R::kThreadsPerRow + lane;
        if (row_ok && vi < vectors) {
          h[v].load(p.h + base + vi * E);
        } else {
          h[v].set_zero();
        }
      }
      with_out_type<T>(p.out_dtype, [&](auto tag) {
        using O = typename decltype(tag)::type;
#pragma unroll
        for (int v = 0; v < R::kVecs; ++v) {
          const int64_t vi = static_cast<int64_t>(v) * R::kThreadsPerRow + lane;
          if (!row_ok || vi >= vectors) {
            g[v].set_zero();
          } else if constexpr (std::is_same_v<O, T>) {
            g[v].load(static_cast<const T*>(p.grad_out) + base + vi * E);
          } else {
            float f[E];
            load_floats<E>(static_cast<const O*>(p.grad_out) + base + vi * E, f);
            g[v].set(f);
          }
        }
      });
    }
    if (!kStagedRes && p.grad_residual_out != nullptr) {
#pragma unroll
      for (int v = 0; v < R::kVecs; ++v) {
        const int64_t vi = static_cast<int64_t>(v) * R::kThreadsPerRow + lane;
        if (row_ok && vi < vectors) grad_res[v].load(p.grad_residual_out + base + vi * E);
      }
    }
    const float rstd = row_ok ? p.rstd[row] : 0.f;
    const float mu = kCentered && row_ok ? p.mean[row] : 0.f;
    float dot = 0.f, gsum = 0.f;
#pragma unroll
    for (int v = 0; v < R::kVecs; ++v) {
      const int64_t vi = static_cast<int64_t>(v) * R::kThreadsPerRow + lane;
      float s[E];
      load_scale<T, E>(vi < vectors ? p.weight : nullptr, p.weight_dtype, p.weight_offset, vi * E, s);
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const float xhat = (h[v].get(j) - mu) * rstd;
        const float gf = g[v].get(j);
        if (want_weight) {  // zero for masked elements (g = 0)
          dw[v][j] = fmaf(gf, xhat, dw[v][j]);
        }
        if constexpr (kCentered) {
          if (want_bias) db[v][j] += gf;
          gsum = fmaf(gf, s[j], gsum);
        }
        dot = fmaf(gf * s[j], xhat, dot);
      }
    }
    float gmean = 0.f;
    if constexpr (kCentered) {
      gmean = row_sum<R>(gsum, red, parity) / static_cast<float>(p.cols);
      parity ^= 1;  // as the forward: the next reduction takes the other buffer
    }
    const float mean = row_sum<R>(dot, red, parity) / static_cast<float>(p.cols);
#pragma unroll
    for (int v = 0; v < R::kVecs; ++v) {
      const int64_t vi = static_cast<int64_t>(v) * R::kThreadsPerRow + lane;
      if (!row_ok || vi >= vectors) continue;
      float s[E], gi[E];
      load_scale<T, E>(p.weight, p.weight_dtype, p.weight_offset, vi * E, s);  // again: an L1 hit, not registers
#pragma unroll
      for (int j = 0; j < E; ++j) {
        const float xhat = (h[v].get(j) - mu) * rstd;
        gi[j] = rstd * (g[v].get(j) * s[j] - gmean - xhat * mean);
        if (p.grad_residual_out != nullptr) gi[j] += grad_res[v].get(j);
      }
      store_floats<E>(p.grad_input + base + vi * E, gi);
    }
  }

  // This block's weight-gradient (bias-gradient) partial: first across the row slots of a warp
  // (butterfly: the same sum in every lane of a column), then across groups in order through shared
  // memory.
  const int group = threadIdx.x / R::kGroupThreads;
  const bool holder = threadIdx.x % R::kGroupThreads < R::kThreadsPerRow;
  auto store_partial = [&](float (&acc)[R::kVecs][E], float* partials) {
    if constexpr (R::kThreadsPerRow < 32) {
#pragma unroll
      for (int v = 0; v < R::kVecs; ++v)
#pragma unroll
        for (int j = 0; j < E; ++j)
#pragma unroll
          for (int o = R::kThreadsPerRow; o < 32; o <<= 1) acc[v][j] += __shfl_xor_sync(0xffffffffu, acc[v][j], o);
    }
    float* partial = partials + static_cast<int64_t>(blockIdx.x) * p.cols;
#pragma unroll
    for (int v = 0; v < R::kVecs; ++v) {
      const int64_t vi = static_cast<int64_t>(v) * R::kThreadsPerRow + lane;
      if constexpr (R::kGroups == 1) {
        if (vi < vectors) store_floats<E>(partial + vi * E, acc[v]);
      } else {
        // [group][element][lane]: a warp's stores hit consecutive banks.
        if (holder) {
#pragma unroll
          for (int j = 0; j < E; ++j) exchange[(group * E + j) * R::kThreadsPerRow + lane] = acc[v][j];
        }
        __syncthreads();
        if (group == 0 && holder && vi < vectors) {
          float sum[E];
#pragma unroll
          for (int j = 0; j < E; ++j) sum[j] = 0.f;
          for (int k = 0; k < R::kGroups; ++k)
#pragma unroll
            for (int j = 0; j < E; ++j) sum[j] += exchange[(k * E + j) * R::kThreadsPerRow + lane];
          store_floats<E>(partial + vi * E, sum);
        }
        __syncthreads();
      }
    }
  };
  if (want_weight) store_partial(dw, p.weight_partials);
  if constexpr (kCentered) {
    if (want_bias) store_partial(db, p.bias_partials);
  }
}

// weight_partials (when set) is zeroed by the host: each block adds its rows into its own row, each
// thread into the columns only it touches.
template <typename T, int N, bool kCentered>
__global__ void __launch_bounds__(1024) backward_two_pass_kernel(const BackwardParams<T> p) {
  __shared__ float red[32];
  const int64_t accesses = p.cols / N;
  float* partial = p.weight_partials ? p.weight_partials + static_cast<int64_t>(blockIdx.x) * p.cols : nullptr;
  float* bias_partial =
      kCentered && p.bias_partials ? p.bias_partials + static_cast<int64_t>(blockIdx.x) * p.cols : nullptr;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int64_t base = row * p.cols;
    const float rstd = p.rstd[row];
    const float mu = kCentered ? p.mean[row] : 0.f;
    with_out_type<T>(p.out_dtype, [&](auto tag) {
      using O = typename decltype(tag)::type;
      const O* grad_out = static_cast<const O*>(p.grad_out) + base;
      float dot = 0.f, gsum = 0.f;  // sums of g s (h - mean) (times rstd below) and of g s
      for (int64_t i = threadIdx.x; i < accesses; i += blockDim.x) {
        float g[N], h[N], s[N];
        load_floats<N>(grad_out + i * N, g);
        load_floats<N>(p.h + base + i * N, h);
        load_scale<T, N>(p.weight, p.weight_dtype, p.weight_offset, i * N, s);
#pragma unroll
        for (int j = 0; j < N; ++j) {
          dot = fmaf(g[j] * s[j], h[j] - mu, dot);
          if constexpr (kCentered) gsum = fmaf(g[j], s[j], gsum);
        }
      }
      const float gmean = kCentered ? block_sum(gsum, red) / static_cast<float>(p.cols) : 0.f;
      const float mean = block_sum(dot, red) * rstd / static_cast<float>(p.cols);
      for (int64_t i = threadIdx.x; i < accesses; i += blockDim.x) {
        float g[N], h[N], s[N], gi[N];
        load_floats<N>(grad_out + i * N, g);
        load_floats<N>(p.h + base + i * N, h);
        load_scale<T, N>(p.weight, p.weight_dtype, p.weight_offset, i * N, s);
        if (p.grad_residual_out != nullptr) {
          load_floats<N>(p.grad_residual_out + base + i * N, gi);
        } else {
#pragma unroll
          for (int j = 0; j < N; ++j) gi[j] = 0.f;
        }
        float dw[N] = {};
        if (partial) load_floats<N>(partial + i * N, dw);
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const float xhat = (h[j] - mu) * rstd;
          gi[j] += rstd * (g[j] * s[j] - gmean - xhat * mean);
          dw[j] = fmaf(g[j], xhat, dw[j]);
        }
        store_floats<N>(p.grad_input + base + i * N, gi);
        if (partial) store_floats<N>(partial + i * N, dw);
        if (bias_partial) {
          float db[N];
          load_floats<N>(bias_partial + i * N, db);
#pragma unroll
          for (int j = 0; j < N; ++j) db[j] += g[j];
          store_floats<N>(bias_partial + i * N, db);
        }
      }
    });
  }
}

// ---- planning ---------------------------------------------------------------------------------

template <typename F>
decltype(auto) with_row_shape(int index, F&& f) {
  static_assert(kNumRowShapes == 8, "one case a row shape");
  switch (index) {
    case 0: return f(std::integral_constant<int, 0>{});
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    default: return f(std::integral_constant<int, 7>{});
  }
}

// Resident blocks an SM of `kernel` at `threads` threads a block, asked once a device.
template <typename Kernel>
int resident_blocks(std::atomic<int> (&cache)[kMaxCachedDevices], Kernel kernel, int threads) {
  return cached_per_device(cache, [&] {
    int blocks = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0));
    return blocks;
  });
}

inline constexpr int64_t kMaxGrid = 0x7fffffff;  // gridDim.x's limit; the kernels loop over any further rows

// 16-byte accesses: whole vectors a row and aligned pointers.
template <typename T>
bool takes_vectors(int64_t cols, bool aligned) {
  return aligned && cols % kVecElems<T> == 0;
}

// one_wave (the backward): one wave of resident blocks, so that the weight gradient's partials are
// as few as the grid allows. Otherwise (the forward) a block for each kRowsPerIter rows (a two-pass
// block for each row): the hardware hands a finished block's place to the next one at once, which
// a grid-stride loop over a fixed wave does not. RowOf<T, S> is the direction's RowTraits of shape S;
// row_kernel(std::integral_constant<int, S>) and two_pass_kernel(bool vectorized) name its kernels;
// allow_rows false: the two-pass kernel for every row (a development knob's).
template <typename T, template <typename, int> class RowOf, typename RowKernel, typename TwoPassKernel>
LaunchPlan make_plan(int64_t rows, int64_t cols, bool aligned, bool one_wave, bool allow_rows, RowKernel row_kernel,
                     TwoPassKernel two_pass_kernel) {
  static std::atomic<int> row_cache[kNumRowShapes][kMaxCachedDevices];
  static std::atomic<int> two_pass_cache[2][6][kMaxCachedDevices];  // by vectorized, log2(threads / 32)
  LaunchPlan plan;
  plan.vectorized = takes_vectors<T>(cols, aligned);
  const int64_t vectors = cols / kVecElems<T>;
  plan.row_shape = plan.vectorized && allow_rows ? pick_row_shape(vectors) : -1;
  const int64_t sms = num_sms();
  if (plan.row_shape >= 0) {
    with_row_shape(plan.row_shape, [&](auto shape) {
      constexpr int kShape = decltype(shape)::value;
      using R = RowOf<T, kShape>;
      const int64_t resident = resident_blocks(row_cache[kShape], row_kernel(shape), R::kThreads);
      plan.block = dim3(R::kThreads);
      const int64_t cap = one_wave ? resident * sms : kMaxGrid;
      plan.grid = dim3(static_cast<unsigned>(std::min(ceil_div(rows, R::kRowsPerIter), cap)));
    });
  } else {
    const int64_t accesses = plan.vectorized ? vectors : cols;
    int threads = 32, level = 0;
    while (threads < 1024 && threads < accesses) {
      threads *= 2;
      ++level;
    }
    const int64_t resident =
        resident_blocks(two_pass_cache[plan.vectorized][level], two_pass_kernel(plan.vectorized), threads);
    plan.block = dim3(threads);
    plan.grid = dim3(static_cast<unsigned>(std::min(rows, one_wave ? resident * sms : kMaxGrid)));
  }
  return plan;
}

// ---- launchers (instantiated in rms_norm_{fwd,bwd}.cu and layer_norm_{fwd,bwd}.cu) ------------

// Development knob (FUSEFORGE_DEV builds), read at every call: FUSEFORGE_RMS_NORM_FORWARD=rows|reread|two_pass
// forces that forward kernel where the row allows it (the tests cover each kernel on small rows).
inline std::string forced_forward_kernel() {
  return dev_choice("FUSEFORGE_RMS_NORM_FORWARD", {"rows", "reread", "two_pass"});
}

template <typename T, bool kCentered>
LaunchPlan plan_forward(int64_t rows, int64_t cols, bool aligned, bool residual) {
  const auto two_pass_kernel = [](bool vectorized) {
    return vectorized ? forward_two_pass_kernel<T, kVecElems<T>, kCentered> : forward_two_pass_kernel<T, 1, kCentered>;
  };
  const std::string forced = forced_forward_kernel();
  // (A grid of kMaxGrid blocks holds 1.7e10 rows: no loop over more.)
  if (forced.empty() && takes_narrow_rows(kCentered, residual, sizeof(T), cols, takes_vectors<T>(cols, aligned)) &&
      rows <= kMaxGrid * kNarrowRowsPerBlock) {
    LaunchPlan plan;
    plan.narrow = true;
    plan.vectorized = true;
    plan.block = dim3(kNarrowThreads);
    plan.grid = dim3(static_cast<unsigned>(ceil_div(rows, int64_t{kNarrowRowsPerBlock})));
    return plan;
  }
  const bool reread_allowed = !kCentered && !residual && (forced.empty() || forced == "reread");
  const int reread_shape = reread_allowed && takes_vectors<T>(cols, aligned)
                               ? pick_reread_shape(cols / kVecElems<T>, forced == "reread")
                               : -1;
  if (reread_shape >= 0) {
    LaunchPlan plan;
    plan.reread_shape = reread_shape;
    plan.vectorized = true;
    plan.block = dim3(kRereadRowShapes[reread_shape].threads_per_row);
    plan.grid = dim3(static_cast<unsigned>(std::min(rows, kMaxGrid)));
    return plan;
  }
  const bool allow_rows = forced != "two_pass";
  if (residual) {
    LaunchPlan plan = make_plan<T, ForwardRows<kCentered>::template Residual>(
        rows, cols, aligned, /*one_wave=*/false, allow_rows,
        [](auto shape) {
          constexpr int kShape = decltype(shape)::value;
          return forward_rows_kernel<T, kShape, kCentered, residual_takes_two_vectors(kCentered, kShape)>;
        },
        two_pass_kernel);
    plan.backward_shape = residual_takes_two_vectors(kCentered, plan.row_shape);
    return plan;
  }
  return make_plan<T, ForwardRows<kCentered>::template Plain>(
      rows, cols, aligned, /*one_wave=*/false, allow_rows,
      [](auto shape) { return forward_rows_kernel<T, decltype(shape)::value, kCentered, false>; }, two_pass_kernel);
}

template <typename T, bool kCentered>
void launch_forward(const ForwardParams<T>& params, const LaunchPlan& plan) {
  if constexpr (!kCentered && sizeof(T) == 2) {
    if (plan.narrow) {
      if (params.weight == nullptr) {
        launch_kernel(forward_narrow_kernel<T, void>, plan.grid, plan.block, 0, params);
      } else if (params.weight_dtype == Dtype::kFloat) {
        launch_kernel(forward_narrow_kernel<T, float>, plan.grid, plan.block, 0, params);
      } else {
        launch_kernel(forward_narrow_kernel<T, T>, plan.grid, plan.block, 0, params);
      }
      return;
    }
  }
  if constexpr (!kCentered) {
    static_assert(kNumRereadShapes == 2, "one case a reread shape");
    if (plan.reread_shape >= 0) {
      if (plan.reread_shape == 0) {
        launch_kernel(forward_reread_kernel<T, 0>, plan.grid, plan.block, 0, params);
      } else {
        launch_kernel(forward_reread_kernel<T, 1>, plan.grid, plan.block, 0, params);
      }
      return;
    }
  }
  if (plan.row_shape >= 0) {
    with_row_shape(plan.row_shape, [&](auto shape) {
      constexpr int kShape = decltype(shape)::value;
      if constexpr (residual_takes_two_vectors(kCentered, kShape)) {
        if (plan.backward_shape) {
          launch_kernel(forward_rows_kernel<T, kShape, kCentered, true>, plan.grid, plan.block, 0, params);
          return;
        }
      }
      launch_kernel(forward_rows_kernel<T, kShape, kCentered, false>, plan.grid, plan.block, 0, params);
    });
  } else {
    FUSEFORGE_BOOL_SWITCH(plan.vectorized, kVec, [&] {
      launch_kernel(forward_two_pass_kernel<T, kVec ? kVecElems<T> : 1, kCentered>, plan.grid, plan.block, 0, params);
    });
  }
}

template <typename T, bool kCentered>
LaunchPlan plan_backward(int64_t rows, int64_t cols, bool aligned) {
  return make_plan<T, BackwardRow>(
      rows, cols, aligned, /*one_wave=*/true, /*allow_rows=*/true,
      [](auto shape) { return backward_rows_kernel<T, decltype(shape)::value, kCentered>; },
      [](bool vectorized) {
        return vectorized ? backward_two_pass_kernel<T, kVecElems<T>, kCentered>
                          : backward_two_pass_kernel<T, 1, kCentered>;
      });
}

// Calls f with out as the element type of a gradient in its parameter's dtype (T or float32).
template <typename T, typename F>
void with_gradient_type(Dtype dtype, void* out, F&& f) {
  if (dtype == Dtype::kFloat) {
    f(static_cast<float*>(out));
  } else {
    f(static_cast<T*>(out));
  }
}

template <typename T, bool kCentered>
void launch_backward(const BackwardParams<T>& params, const LaunchPlan& plan, void* grad_weight, void* grad_bias) {
  if (plan.row_shape >= 0) {
    with_row_shape(plan.row_shape, [&](auto shape) {
      launch_kernel(backward_rows_kernel<T, decltype(shape)::value, kCentered>, plan.grid, plan.block, 0, params);
    });
  } else {
    FUSEFORGE_BOOL_SWITCH(plan.vectorized, kVec, [&] {
      launch_kernel(backward_two_pass_kernel<T, kVec ? kVecElems<T> : 1, kCentered>, plan.grid, plan.block, 0,
                    params);
    });
  }
  const int64_t blocks = plan.grid.x;
  const bool want_weight = params.weight_partials != nullptr;
  const bool want_bias = kCentered && params.bias_partials != nullptr;
  if constexpr (kCentered) {
    if (want_weight && want_bias) {
      with_gradient_type<T>(params.weight_dtype, grad_weight, [&](auto* weight_out) {
        with_gradient_type<T>(params.bias_dtype, grad_bias, [&](auto* bias_out) {
          launch_column_sums(params.weight_partials, weight_out, params.bias_partials, bias_out, blocks, params.cols);
        });
      });
      return;
    }
  }
  if (want_weight || want_bias) {
    with_gradient_type<T>(want_weight ? params.weight_dtype : params.bias_dtype, want_weight ? grad_weight : grad_bias,
                          [&](auto* out) {
                            launch_column_sum(want_weight ? params.weight_partials : params.bias_partials, blocks,
                                              params.cols, out);
                          });
  }
}

// One direction's planner and launcher for the three dtypes (a file a direction and form, built in parallel).
#define FUSEFORGE_NORM_INSTANTIATE_FORWARD(CENTERED)                                                   \
  template LaunchPlan plan_forward<float, CENTERED>(int64_t, int64_t, bool, bool);                    \
  template LaunchPlan plan_forward<at::Half, CENTERED>(int64_t, int64_t, bool, bool);                 \
  template LaunchPlan plan_forward<at::BFloat16, CENTERED>(int64_t, int64_t, bool, bool);             \
  template void launch_forward<float, CENTERED>(const ForwardParams<float>&, const LaunchPlan&);      \
  template void launch_forward<at::Half, CENTERED>(const ForwardParams<at::Half>&, const LaunchPlan&); \
  template void launch_forward<at::BFloat16, CENTERED>(const ForwardParams<at::BFloat16>&, const LaunchPlan&);
#define FUSEFORGE_NORM_INSTANTIATE_BACKWARD(CENTERED)                                                            \
  template LaunchPlan plan_backward<float, CENTERED>(int64_t, int64_t, bool);                                   \
  template LaunchPlan plan_backward<at::Half, CENTERED>(int64_t, int64_t, bool);                                \
  template LaunchPlan plan_backward<at::BFloat16, CENTERED>(int64_t, int64_t, bool);                            \
  template void launch_backward<float, CENTERED>(const BackwardParams<float>&, const LaunchPlan&, void*, void*); \
  template void launch_backward<at::Half, CENTERED>(const BackwardParams<at::Half>&, const LaunchPlan&, void*,   \
                                                    void*);                                                    \
  template void launch_backward<at::BFloat16, CENTERED>(const BackwardParams<at::BFloat16>&, const LaunchPlan&,  \
                                                        void*, void*);

}  // namespace fuseforge::rms_norm
