// glu device code. Every tensor is a rows x cols matrix with its own row stride (the last dim
// dense); a thread owns one 16-byte vector's worth of consecutive columns (8 of a 16-bit type, 4
// float32) and walks rows, loading rows_per_trip rows of every input before it computes (one by
// default: the bytes in flight come from many resident warps). kVec: those columns are one 16-byte
// access (pointers, cols and row strides aligned); otherwise scalar accesses, masked at the row's
// end. Offsets are int64.
#pragma once
#include <ATen/ATen.h>

#include "common/activation.h"
#include "common/launch.cuh"
#include "common/vec.cuh"
#include "glu/glu_launch.h"

// Rows a thread loads before it computes (compile-time knobs, so scripts/tune_variants.sh can build
// variants side by side; docs/design/glu.md). One row: on the H200 more rows a thread cost registers
// (bf16 forward at 4 rows: 99, 2 blocks an SM) and lost to more resident warps (bf16 16384 x 8192
// silu fwd 0.278 / 0.209 / 0.191 ms at 4 / 2 / 1 rows, fwd+bwd 0.657 / 0.587 / 0.508).
#ifndef FUSEFORGE_GLU_FWD_ROWS
#define FUSEFORGE_GLU_FWD_ROWS 1
#endif
#ifndef FUSEFORGE_GLU_BWD_ROWS
#define FUSEFORGE_GLU_BWD_ROWS 1
#endif
// The blocks an SM the register allocation must allow (__launch_bounds__'s second argument; 0: no cap).
#ifndef FUSEFORGE_GLU_MIN_BLOCKS
#define FUSEFORGE_GLU_MIN_BLOCKS 0
#endif

namespace fuseforge::glu {

template <typename T>
using ThreadVector = AlignedVector<T, elems_per_thread<T>()>;

// kVec: one 16-byte load under the L2 policy; otherwise scalar loads of the first n (the rest zero).
// Both kernels read under an L2 evict-last policy (docs/design/glu.md): bf16 16384 x 4096 silu, the
// forward's 0.0957 against 0.0981 ms, the backward's fwd+bwd 0.2523 against 0.2551; evict-first slower.
template <typename T, bool kVec>
__device__ __forceinline__ void load_elems(const T* p, int n, ThreadVector<T>& v, uint64_t policy) {
  if constexpr (kVec) {
    v = load_vector_l2_hint<T, elems_per_thread<T>()>(p, policy);
  } else {
#pragma unroll
    for (int j = 0; j < elems_per_thread<T>(); ++j) v.val[j] = j < n ? p[j] : T(0);
  }
}

// Rounds v once to T and stores the first n (all of them with kVec).
template <typename T, bool kVec>
__device__ __forceinline__ void store_elems(T* p, int n, const float (&v)[elems_per_thread<T>()]) {
  ThreadVector<T> out;
#pragma unroll
  for (int j = 0; j < elems_per_thread<T>(); ++j) out.val[j] = static_cast<T>(v[j]);
  if constexpr (kVec) {
    store_vector<T, elems_per_thread<T>()>(p, out);
  } else {
#pragma unroll
    for (int j = 0; j < elems_per_thread<T>(); ++j)
      if (j < n) p[j] = out.val[j];
  }
}

// This thread's first column and how many of its columns exist (0: none, the thread idles).
__device__ __forceinline__ int thread_columns(int64_t cols, int per_thread, int64_t& col0) {
  col0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * per_thread;
  return static_cast<int>(max(int64_t{0}, min(static_cast<int64_t>(per_thread), cols - col0)));
}

// out = act(gate) * up in float32, rounded once.
template <typename T, Activation A, bool kVec>
__global__ void __launch_bounds__(kThreads, FUSEFORGE_GLU_MIN_BLOCKS) forward_kernel(const ForwardParams<T> p) {
  constexpr int kRows = FUSEFORGE_GLU_FWD_ROWS;
  constexpr int kElems = elems_per_thread<T>();
  int64_t col0;
  const int n = thread_columns(p.cols, kElems, col0);
  if (n == 0) return;
  const uint64_t policy = l2_evict_last_policy();
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * p.rows_per_block;
  const int64_t row_end = min(p.rows, row_begin + p.rows_per_block);
  const int64_t trip_rows = static_cast<int64_t>(blockDim.y) * kRows;
  for (int64_t r = row_begin + threadIdx.y; r < row_end; r += trip_rows) {
    ThreadVector<T> gate[kRows], up[kRows];
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int64_t row = r + static_cast<int64_t>(u) * blockDim.y;
      if (row < row_end) {
        load_elems<T, kVec>(p.gate + row * p.gate_row_stride + col0, n, gate[u], policy);
        load_elems<T, kVec>(p.up + row * p.up_row_stride + col0, n, up[u], policy);
      }
    }
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int64_t row = r + static_cast<int64_t>(u) * blockDim.y;
      if (row >= row_end) break;
      float out[kElems];
#pragma unroll
      for (int j = 0; j < kElems; ++j)
        out[j] = Act<A>::forward(static_cast<float>(gate[u].val[j])) * static_cast<float>(up[u].val[j]);
      store_elems<T, kVec>(p.out + row * p.cols + col0, n, out);
    }
  }
}

// Recomputes act(gate): grad_gate = grad_out * up * act'(gate), grad_up = grad_out * act(gate), in
// float32, each rounded once.
template <typename T, Activation A, bool kVec>
__global__ void __launch_bounds__(kThreads, FUSEFORGE_GLU_MIN_BLOCKS) backward_kernel(const BackwardParams<T> p) {
  constexpr int kRows = FUSEFORGE_GLU_BWD_ROWS;
  constexpr int kElems = elems_per_thread<T>();
  int64_t col0;
  const int n = thread_columns(p.cols, kElems, col0);
  if (n == 0) return;
  const uint64_t policy = l2_evict_last_policy();
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * p.rows_per_block;
  const int64_t row_end = min(p.rows, row_begin + p.rows_per_block);
  const int64_t trip_rows = static_cast<int64_t>(blockDim.y) * kRows;
  for (int64_t r = row_begin + threadIdx.y; r < row_end; r += trip_rows) {
    ThreadVector<T> grad[kRows], gate[kRows], up[kRows];
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int64_t row = r + static_cast<int64_t>(u) * blockDim.y;
      if (row < row_end) {
        load_elems<T, kVec>(p.grad_out + row * p.grad_out_row_stride + col0, n, grad[u], policy);
        load_elems<T, kVec>(p.gate + row * p.gate_row_stride + col0, n, gate[u], policy);
        load_elems<T, kVec>(p.up + row * p.up_row_stride + col0, n, up[u], policy);
      }
    }
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int64_t row = r + static_cast<int64_t>(u) * blockDim.y;
      if (row >= row_end) break;
      float grad_gate[kElems], grad_up[kElems];
#pragma unroll
      for (int j = 0; j < kElems; ++j) {
        const float z = static_cast<float>(gate[u].val[j]), g = static_cast<float>(grad[u].val[j]);
        grad_gate[j] = g * static_cast<float>(up[u].val[j]) * Act<A>::derivative(z);
        grad_up[j] = g * Act<A>::forward(z);
      }
      store_elems<T, kVec>(p.grad_gate + row * p.grad_gate_row_stride + col0, n, grad_gate);
      store_elems<T, kVec>(p.grad_up + row * p.grad_up_row_stride + col0, n, grad_up);
    }
  }
}

}  // namespace fuseforge::glu
