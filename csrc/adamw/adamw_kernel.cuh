// fused AdamW device code: one kernel updates every tensor of the table. Block b takes work item
// blocks[first_block + b] = (tensor, chunk) and updates that chunk in quads of 4 elements (16-byte
// float32 vectors, 8-byte float16/bfloat16 ones) when all of the tensor's arrays are aligned for
// them (the scalar path otherwise, and for the tail). The element math is adamw_math.h's, shared with the CPU backend.
//
// Step counts: every block of a tensor reads the tensor's count before it works; the block that
// finishes last (a per-tensor arrival counter) writes count + 1 and resets the counter, so no
// separate increment launch is needed and no block reads a count another block already advanced.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "adamw/adamw_launch.h"  // KernelArgs
#include "adamw/adamw_math.h"
#include "adamw/adamw_meta.h"
#include "common/vec.cuh"

namespace fuseforge::adamw {

constexpr int kThreads = 256;

// Kernel shape, the fastest of six timed on the H100 (docs/design/adamw.md): kUnroll quads of 4 elements
// a thread a trip, every load of the trip issued before any math or store. The addresses come from
// the table, so the compiler cannot prove the arrays do not alias; without this order it kept each
// quad's loads behind the previous quad's stores (one memory round trip per quad), which held the
// 16-bit master path at 1.7 TB/s. kMinBlocksPerSm = 2 leaves 128 registers, enough for two quads of
// five arrays without spills.
constexpr int kUnroll = 2;
constexpr int kMinBlocksPerSm = 2;

// 16-byte global accesses with the streaming (evict-first) hint: every element is read once and
// written once. Explicit ld.global/st.global: the addresses come from the table, so the compiler
// would otherwise emit generic accesses.
template <typename T, int N>
__device__ __forceinline__ AlignedVector<T, N> load_stream(const T* p) {
  static_assert(sizeof(AlignedVector<T, N>) == 16, "16-byte vectors");
  const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(p));
  AlignedVector<T, N> v;
  memcpy(&v, &raw, 16);
  return v;
}

template <typename T, int N>
__device__ __forceinline__ void store_stream(T* p, const AlignedVector<T, N>& v) {
  static_assert(sizeof(AlignedVector<T, N>) == 16, "16-byte vectors");
  uint4 raw;
  memcpy(&raw, &v, 16);
  __stcs(reinterpret_cast<uint4*>(p), raw);
}

template <typename T, int N>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[N]) {
  constexpr int kPer = 16 / static_cast<int>(sizeof(T));
  static_assert(N % kPer == 0, "whole 16-byte vectors");
#pragma unroll
  for (int k = 0; k < N / kPer; ++k) {
    const auto v = load_stream<T, kPer>(p + k * kPer);
#pragma unroll
    for (int j = 0; j < kPer; ++j) out[k * kPer + j] = static_cast<float>(v.val[j]);
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_floats(T* p, const float (&in)[N]) {
  constexpr int kPer = 16 / static_cast<int>(sizeof(T));
#pragma unroll
  for (int k = 0; k < N / kPer; ++k) {
    AlignedVector<T, kPer> v;
#pragma unroll
    for (int j = 0; j < kPer; ++j) v.val[j] = static_cast<T>(in[k * kPer + j]);
    store_stream<T, kPer>(p + k * kPer, v);
  }
}

// One quad through the same streaming accesses: a 16-byte vector for float32 arrays
// (load_floats / store_floats), an 8-byte one for float16/bfloat16.
template <typename T>
__device__ __forceinline__ void load_quad(const T* p, float (&out)[4]) {
  if constexpr (sizeof(T) == 4) {
    load_floats<T, 4>(p, out);
  } else {
    static_assert(sizeof(T) == 2, "float32, float16 or bfloat16");
    const uint2 raw = __ldcs(reinterpret_cast<const uint2*>(p));
    AlignedVector<T, 4> v;
    memcpy(&v, &raw, 8);
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = static_cast<float>(v.val[j]);
  }
}

template <typename T>
__device__ __forceinline__ void store_quad(T* p, const float (&in)[4]) {
  if constexpr (sizeof(T) == 4) {
    store_floats<T, 4>(p, in);
  } else {
    AlignedVector<T, 4> v;
#pragma unroll
    for (int j = 0; j < 4; ++j) v.val[j] = static_cast<T>(in[j]);
    uint2 raw;
    memcpy(&raw, &v, 8);
    __stcs(reinterpret_cast<uint2*>(p), raw);
  }
}

template <typename T, bool kMaster, bool kAmsgrad, bool kVec>
__device__ __forceinline__ void update_chunk(const TensorMeta& t, T* grad, int64_t begin, int64_t n,
                                             const StepScalars<float>& s) {
  T* p = static_cast<T*>(t.param) + begin;
  T* g = grad + begin;
  float* m = static_cast<float*>(t.exp_avg) + begin;
  float* v = static_cast<float*>(t.exp_avg_sq) + begin;
  float* vmax = kAmsgrad ? static_cast<float*>(t.max_exp_avg_sq) + begin : nullptr;
  float* master = kMaster ? static_cast<float*>(t.master) + begin : nullptr;
  int64_t vec_end = 0;
  if constexpr (kVec) {
    constexpr int64_t kTrip = int64_t{kThreads} * 4 * kUnroll;
    vec_end = n / 4 * 4;
    for (int64_t e0 = static_cast<int64_t>(threadIdx.x) * 4; e0 < vec_end; e0 += kTrip) {
      float pf[kUnroll][4], gf[kUnroll][4], mf[kUnroll][4], vf[kUnroll][4], xf[kUnroll][4];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t e = e0 + int64_t{u} * kThreads * 4;
        if (e >= vec_end) continue;
        if constexpr (kMaster) load_quad(master + e, pf[u]);
        else load_quad(p + e, pf[u]);
        load_quad(g + e, gf[u]);
        load_quad(m + e, mf[u]);
        load_quad(v + e, vf[u]);
        if constexpr (kAmsgrad) load_quad(vmax + e, xf[u]);
        else xf[u][0] = xf[u][1] = xf[u][2] = xf[u][3] = 0.f;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t e = e0 + int64_t{u} * kThreads * 4;
        if (e >= vec_end) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) adamw_element<float, kAmsgrad>(pf[u][j], gf[u][j], mf[u][j], vf[u][j], xf[u][j], s);
        if constexpr (kMaster) store_quad(master + e, pf[u]);
        store_quad(p + e, pf[u]);
        if (s.unscale) store_quad(g + e, gf[u]);
        store_quad(m + e, mf[u]);
        store_quad(v + e, vf[u]);
        if constexpr (kAmsgrad) store_quad(vmax + e, xf[u]);
      }
    }
  }
  for (int64_t e = vec_end + threadIdx.x; e < n; e += kThreads) {
    float pv = kMaster ? master[e] : static_cast<float>(p[e]);
    float gv = static_cast<float>(g[e]);
    float mv = m[e], vv = v[e];
    float xv = kAmsgrad ? vmax[e] : 0.f;
    adamw_element<float, kAmsgrad>(pv, gv, mv, vv, xv, s);
    if constexpr (kMaster) master[e] = pv;
    p[e] = static_cast<T>(pv);
    if (s.unscale) g[e] = static_cast<T>(gv);
    m[e] = mv;
    v[e] = vv;
    if constexpr (kAmsgrad) vmax[e] = xv;
  }
}

template <typename T, bool kMaster>
__device__ __forceinline__ void update_typed(const TensorMeta& t, const void* grad, int64_t begin, int64_t n,
                                             const StepScalars<float>& s) {
  T* g = static_cast<T*>(const_cast<void*>(grad));
  const bool amsgrad = t.max_exp_avg_sq != nullptr;
  // The param/grad quads need 4 * sizeof(T) bytes of alignment, the float32 arrays 16. Chunks
  // start at multiples of chunk_elems (a multiple of 8), so the base addresses decide.
  const uintptr_t narrow_bits = reinterpret_cast<uintptr_t>(t.param) | reinterpret_cast<uintptr_t>(grad);
  const uintptr_t float_bits = reinterpret_cast<uintptr_t>(t.exp_avg) | reinterpret_cast<uintptr_t>(t.exp_avg_sq) |
                               reinterpret_cast<uintptr_t>(t.max_exp_avg_sq) | reinterpret_cast<uintptr_t>(t.master);
  constexpr uintptr_t narrow_align = 4 * sizeof(T);
  const bool vec = (narrow_bits & (narrow_align - 1)) == 0 && (float_bits & 15u) == 0;
  if (vec) {
    if (amsgrad) update_chunk<T, kMaster, true, true>(t, g, begin, n, s);
    else update_chunk<T, kMaster, false, true>(t, g, begin, n, s);
  } else {
    if (amsgrad) update_chunk<T, kMaster, true, false>(t, g, begin, n, s);
    else update_chunk<T, kMaster, false, false>(t, g, begin, n, s);
  }
}

__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) adamw_multi_tensor_kernel(const KernelArgs a) {
  const BlockWork w = a.blocks[a.first_block + blockIdx.x];
  const void* grad = a.grads[w.tensor];
  if (grad == nullptr) return;                                   // no grad: untouched, like torch
  if (a.found_inf != nullptr && *a.found_inf != 0.f) return;     // GradScaler saw inf/nan: skip the step
  const TensorMeta& t = a.table[w.tensor];
  const GroupHyper& h = a.groups[t.group];
  double lr = h.lr;
  if (h.lr_ptr != nullptr)
    lr = h.lr_is_double ? *static_cast<const double*>(h.lr_ptr) : static_cast<double>(*static_cast<const float*>(h.lr_ptr));
  float* step_ptr = t.step;
  const float step = *step_ptr + 1.0f;
  const StepScalars<float> s = make_step_scalars<float>(lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.maximize != 0,
                                                        static_cast<double>(step), a.grad_scale);
  const int64_t begin = static_cast<int64_t>(w.chunk) * a.chunk_elems;
  const int64_t n = max(int64_t{0}, min(a.chunk_elems, t.numel - begin));
  if (n > 0) {
    switch (static_cast<ParamDtype>(t.dtype)) {
      case ParamDtype::kFloat: update_typed<float, false>(t, grad, begin, n, s); break;
      case ParamDtype::kHalf:
        if (t.master) update_typed<c10::Half, true>(t, grad, begin, n, s);
        else update_typed<c10::Half, false>(t, grad, begin, n, s);
        break;
      case ParamDtype::kBFloat16:
        if (t.master) update_typed<c10::BFloat16, true>(t, grad, begin, n, s);
        else update_typed<c10::BFloat16, false>(t, grad, begin, n, s);
        break;
      default: break;  // float64 is CPU-only (rejected on the host)
    }
  }
  // Every thread has read *step_ptr above; the last block of the tensor advances it.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const int32_t arrived = atomicAdd(a.done + w.tensor, 1);
    if (arrived == t.num_chunks - 1) {
      *step_ptr = step;
      a.done[w.tensor] = 0;
    }
  }
}

// Writes `count` 8-byte words carried in the kernel's parameters to dst: the per-step upload of
// grad addresses and group hyperparameters. The data travels inside the launch, so the upload
// needs no pinned host buffer and is safe to record in a CUDA graph (replays rewrite the captured
// values).
template <int kWords>
struct PatchArgs {
  uint64_t* dst;
  int64_t count;
  uint64_t words[kWords];
};

template <int kWords>
__global__ void __launch_bounds__(kThreads) patch_words_kernel(const PatchArgs<kWords> a) {
  for (int64_t i = threadIdx.x; i < a.count; i += kThreads) a.dst[i] = a.words[i];
}

}  // namespace fuseforge::adamw
