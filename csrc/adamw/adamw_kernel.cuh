// fused AdamW device code: one kernel updates every tensor of the table. Block b takes work item
// blocks[first_block + b] = (tensor, chunk) and updates that chunk in quads of 4 elements (16-byte
// float32 vectors, 8-byte float16/bfloat16 ones) when all of the tensor's arrays are aligned for
// them (the scalar path otherwise, and for the tail). The element math is adamw_math.h's, shared with the CPU backend.
// Compact states (adamw_lowbit.h): bfloat16 moments take the quad path (decoded on load, rounded
// stochastically on store); int8 moments take update_chunk_int8, a warp per 256-element block.
//
// Step counts: every block of a tensor reads the tensor's count before it works; the block that
// finishes last (a per-tensor arrival counter) writes count + 1 and resets the counter, so no
// separate increment launch is needed and no block reads a count another block already advanced.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#include "adamw/adamw_launch.h"  // KernelArgs
#include "adamw/adamw_lowbit.h"
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

// Moments of type S: float (float32 states) or uint16_t (bfloat16 bits). bfloat16 stores round
// stochastically with 16 bits of the element's random word (rounding_bits), the high half for
// exp_avg (shift 16), the low half for exp_avg_sq and max_exp_avg_sq (shift 0).
template <typename S>
__device__ __forceinline__ void load_state_quad(const S* p, float (&out)[4]) {
  if constexpr (std::is_same_v<S, float>) {
    load_quad(p, out);
  } else {
    const uint2 raw = __ldcs(reinterpret_cast<const uint2*>(p));
    out[0] = bits_float(raw.x << 16);
    out[1] = bits_float(raw.x & 0xFFFF0000u);
    out[2] = bits_float(raw.y << 16);
    out[3] = bits_float(raw.y & 0xFFFF0000u);
  }
}

template <typename S>
__device__ __forceinline__ void store_state_quad(S* p, const float (&in)[4], const uint32_t (&random)[4], int shift) {
  if constexpr (std::is_same_v<S, float>) {
    store_quad(p, in);
  } else {
    uint32_t b[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) b[j] = float_to_bf16_stochastic(in[j], random[j] >> shift);
    __stcs(reinterpret_cast<uint2*>(p), make_uint2(b[0] | (b[1] << 16), b[2] | (b[3] << 16)));
  }
}

template <typename S>
__device__ __forceinline__ float load_state(const S* p) {
  if constexpr (std::is_same_v<S, float>) return *p;
  else return bf16_bits_to_float(*p);
}

template <typename S>
__device__ __forceinline__ void store_state(S* p, float x, uint32_t random, int shift) {
  if constexpr (std::is_same_v<S, float>) *p = x;
  else *p = float_to_bf16_stochastic(x, random >> shift);
}

template <typename T, typename S, bool kMaster, bool kAmsgrad, bool kVec>
__device__ __forceinline__ void update_chunk(const TensorMeta& t, T* grad, int64_t begin, int64_t n,
                                             const StepScalars<float>& s) {
  constexpr bool kRound = !std::is_same_v<S, float>;  // bfloat16 states: stochastic rounding
  T* p = static_cast<T*>(t.param) + begin;
  T* g = grad + begin;
  S* m = static_cast<S*>(t.exp_avg) + begin;
  S* v = static_cast<S*>(t.exp_avg_sq) + begin;
  S* vmax = kAmsgrad ? static_cast<S*>(t.max_exp_avg_sq) + begin : nullptr;
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
        load_state_quad(m + e, mf[u]);
        load_state_quad(v + e, vf[u]);
        if constexpr (kAmsgrad) load_state_quad(vmax + e, xf[u]);
        else xf[u][0] = xf[u][1] = xf[u][2] = xf[u][3] = 0.f;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t e = e0 + int64_t{u} * kThreads * 4;
        if (e >= vec_end) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) adamw_element<float, kAmsgrad>(pf[u][j], gf[u][j], mf[u][j], vf[u][j], xf[u][j], s);
        uint32_t random[4] = {0, 0, 0, 0};
        if constexpr (kRound) {
#pragma unroll
          for (int j = 0; j < 4; ++j) random[j] = rounding_bits(static_cast<uint64_t>(begin + e + j), s.step_index);
        }
        if constexpr (kMaster) store_quad(master + e, pf[u]);
        store_quad(p + e, pf[u]);
        if (s.unscale) store_quad(g + e, gf[u]);
        store_state_quad(m + e, mf[u], random, 16);
        store_state_quad(v + e, vf[u], random, 0);
        if constexpr (kAmsgrad) store_state_quad(vmax + e, xf[u], random, 0);
      }
    }
  }
  for (int64_t e = vec_end + threadIdx.x; e < n; e += kThreads) {
    float pv = kMaster ? master[e] : static_cast<float>(p[e]);
    float gv = static_cast<float>(g[e]);
    float mv = load_state(m + e), vv = load_state(v + e);
    float xv = kAmsgrad ? load_state(vmax + e) : 0.f;
    adamw_element<float, kAmsgrad>(pv, gv, mv, vv, xv, s);
    const uint32_t random = kRound ? rounding_bits(static_cast<uint64_t>(begin + e), s.step_index) : 0u;
    if constexpr (kMaster) master[e] = pv;
    p[e] = static_cast<T>(pv);
    if (s.unscale) g[e] = static_cast<T>(gv);
    store_state(m + e, mv, random, 16);
    store_state(v + e, vv, random, 0);
    if constexpr (kAmsgrad) store_state(vmax + e, xv, random, 0);
  }
}

// ---- int8 states ----------------------------------------------------------------------------------
// A warp updates one 256-element quantization block at a time, kLaneElems elements a lane: lane l
// owns elements 8l .. 8l+7 on the aligned path (one 8-byte code load a moment, 16-byte param/grad
// vectors) and l, l+32, ... on the scalar one (unaligned tensors, a tensor's partial last block).
// Between the update and the encoding the block's new absmax is a warp reduction: five
// shuffle-max steps a moment, no shared memory and no barrier. The chunk's blocks go round-robin over
// the CUDA block's warps. max is exact and order-free, so the absmax (and the codes) do not depend
// on the path or the reduction order: the CPU backend gets the same bits from the same floats.
constexpr int kWarps = kThreads / 32;
constexpr int kLaneElems = static_cast<int>(kQuantBlock) / 32;
static_assert(kLaneElems == 8, "one 8-byte code vector a lane");

// Code j of a lane's 8 (byte j of the two words).
__device__ __forceinline__ uint32_t code_at(uint2 raw, int j) {
  return ((j < 4 ? raw.x : raw.y) >> (8 * (j & 3))) & 0xFFu;
}

template <typename T, bool kMaster, bool kVec>
__device__ __forceinline__ void update_chunk_int8(const TensorMeta& t, T* grad, int64_t begin, int64_t n,
                                                  const StepScalars<float>& s) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  T* p = static_cast<T*>(t.param) + begin;
  T* g = grad + begin;
  float* master = kMaster ? static_cast<float*>(t.master) + begin : nullptr;
  uint8_t* mq = static_cast<uint8_t*>(t.exp_avg) + begin;
  uint8_t* vq = static_cast<uint8_t*>(t.exp_avg_sq) + begin;
  float* m_absmax = t.exp_avg_absmax + begin / kQuantBlock;  // chunks start at multiples of kQuantBlock
  float* v_absmax = t.exp_avg_sq_absmax + begin / kQuantBlock;
  const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  for (int64_t b = threadIdx.x / 32; b < blocks; b += kWarps) {
    const int64_t base = b * kQuantBlock;
    const bool whole = kVec && base + kQuantBlock <= n;
    float pf[kLaneElems], gf[kLaneElems], mf[kLaneElems], vf[kLaneElems];
    uint2 mc = make_uint2(0, 0), vc = make_uint2(0, 0);  // the lane's 8 codes of each moment, packed
    // Every lane reads the old scales before the shuffles below; lane 0 writes the new ones after.
    const float m_decode = decode_scale<ExpAvgCode>(m_absmax[b]);
    const float v_decode = decode_scale<ExpAvgSqCode>(v_absmax[b]);
    if (whole) {
      const int64_t e = base + lane * kLaneElems;
      if constexpr (kMaster) load_floats<float, kLaneElems>(master + e, pf);
      else load_floats<T, kLaneElems>(p + e, pf);
      load_floats<T, kLaneElems>(g + e, gf);
      mc = __ldcs(reinterpret_cast<const uint2*>(mq + e));
      vc = __ldcs(reinterpret_cast<const uint2*>(vq + e));
    } else {
#pragma unroll
      for (int j = 0; j < kLaneElems; ++j) {
        const int64_t e = base + lane + 32 * j;
        const bool in = e < n;
        pf[j] = in ? (kMaster ? master[e] : static_cast<float>(p[e])) : 0.f;
        gf[j] = in ? static_cast<float>(g[e]) : 0.f;
        const uint32_t shift = 8 * (j & 3);
        const uint32_t mb = in ? mq[e] : 0u, vb = in ? vq[e] : 0u;
        if (j < 4) {
          mc.x |= mb << shift;
          vc.x |= vb << shift;
        } else {
          mc.y |= mb << shift;
          vc.y |= vb << shift;
        }
      }
    }
    float m_max = 0.f, v_max = 0.f;
#pragma unroll
    for (int j = 0; j < kLaneElems; ++j) {
      mf[j] = decode_exp_avg(code_at(mc, j), m_decode);
      vf[j] = decode_exp_avg_sq(code_at(vc, j), v_decode);
      float unused = 0.f;
      adamw_element<float, false>(pf[j], gf[j], mf[j], vf[j], unused, s);
      if (!whole && base + lane + 32 * j >= n) mf[j] = vf[j] = 0.f;  // past the tensor: no part of the absmax
      m_max = fmaxf(m_max, abs_float(mf[j]));  // fmaxf skips NaN, as the CPU's magnitude_key does
      v_max = fmaxf(v_max, vf[j]);
    }
    // The param (and grad) are final: stored before the reduction, so only the moments stay live.
    if (whole) {
      const int64_t e = base + lane * kLaneElems;
      if constexpr (kMaster) store_floats<float, kLaneElems>(master + e, pf);
      store_floats<T, kLaneElems>(p + e, pf);
      if (s.unscale) store_floats<T, kLaneElems>(g + e, gf);
    } else {
#pragma unroll
      for (int j = 0; j < kLaneElems; ++j) {
        const int64_t e = base + lane + 32 * j;
        if (e >= n) continue;
        if constexpr (kMaster) master[e] = pf[j];
        p[e] = static_cast<T>(pf[j]);
        if (s.unscale) g[e] = static_cast<T>(gf[j]);
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      m_max = fmaxf(m_max, __shfl_xor_sync(0xFFFFFFFFu, m_max, offset));
      v_max = fmaxf(v_max, __shfl_xor_sync(0xFFFFFFFFu, v_max, offset));
    }
    const float m_encode = encode_scale<ExpAvgCode>(m_max), v_encode = encode_scale<ExpAvgSqCode>(v_max);
    mc = vc = make_uint2(0, 0);
#pragma unroll
    for (int j = 0; j < kLaneElems; ++j) {
      const uint32_t shift = 8 * (j & 3);
      const uint32_t mb = encode_exp_avg(mf[j], m_encode), vb = encode_exp_avg_sq(vf[j], v_encode);
      if (j < 4) {
        mc.x |= mb << shift;
        vc.x |= vb << shift;
      } else {
        mc.y |= mb << shift;
        vc.y |= vb << shift;
      }
    }
    if (lane == 0) {
      m_absmax[b] = m_max;
      v_absmax[b] = v_max;
    }
    if (whole) {
      const int64_t e = base + lane * kLaneElems;
      __stcs(reinterpret_cast<uint2*>(mq + e), mc);
      __stcs(reinterpret_cast<uint2*>(vq + e), vc);
    } else {
#pragma unroll
      for (int j = 0; j < kLaneElems; ++j) {
        const int64_t e = base + lane + 32 * j;
        if (e >= n) continue;
        mq[e] = static_cast<uint8_t>(code_at(mc, j));
        vq[e] = static_cast<uint8_t>(code_at(vc, j));
      }
    }
  }
}

template <typename T, typename S, bool kMaster>
__device__ __forceinline__ void update_states(const TensorMeta& t, T* g, int64_t begin, int64_t n,
                                              const StepScalars<float>& s) {
  const bool amsgrad = t.max_exp_avg_sq != nullptr;
  // The param/grad quads need 4 * sizeof(T) bytes of alignment, the state quads 4 * sizeof(S), the
  // master's 16. Chunks start at multiples of chunk_elems (a multiple of 256), so the base addresses decide.
  const uintptr_t narrow_bits = reinterpret_cast<uintptr_t>(t.param) | reinterpret_cast<uintptr_t>(g);
  const uintptr_t state_bits = reinterpret_cast<uintptr_t>(t.exp_avg) | reinterpret_cast<uintptr_t>(t.exp_avg_sq) |
                               reinterpret_cast<uintptr_t>(t.max_exp_avg_sq);
  const bool vec = (narrow_bits & (4 * sizeof(T) - 1)) == 0 && (state_bits & (4 * sizeof(S) - 1)) == 0 &&
                   (reinterpret_cast<uintptr_t>(t.master) & 15u) == 0;
  if (vec) {
    if (amsgrad) update_chunk<T, S, kMaster, true, true>(t, g, begin, n, s);
    else update_chunk<T, S, kMaster, false, true>(t, g, begin, n, s);
  } else {
    if (amsgrad) update_chunk<T, S, kMaster, true, false>(t, g, begin, n, s);
    else update_chunk<T, S, kMaster, false, false>(t, g, begin, n, s);
  }
}

template <typename T, bool kMaster, bool kInt8Path>
__device__ __forceinline__ void update_typed(const TensorMeta& t, const void* grad, int64_t begin, int64_t n,
                                             const StepScalars<float>& s) {
  T* g = static_cast<T*>(const_cast<void*>(grad));
  const auto format = static_cast<StateFormat>(t.state_format);
  if constexpr (kInt8Path) {  // (the host launches this kernel for a table with int8 states)
    if (format == StateFormat::kInt8) {
      // 8 param/grad elements a lane in 16-byte vectors (two for float32), 8 codes in one 8-byte load.
      const uintptr_t wide_bits = reinterpret_cast<uintptr_t>(t.param) | reinterpret_cast<uintptr_t>(grad) |
                                  reinterpret_cast<uintptr_t>(t.master);
      const uintptr_t code_bits = reinterpret_cast<uintptr_t>(t.exp_avg) | reinterpret_cast<uintptr_t>(t.exp_avg_sq);
      if ((wide_bits & 15u) == 0 && (code_bits & 7u) == 0) update_chunk_int8<T, kMaster, true>(t, g, begin, n, s);
      else update_chunk_int8<T, kMaster, false>(t, g, begin, n, s);
      return;
    }
  }
  if (format == StateFormat::kBFloat16) update_states<T, uint16_t, kMaster>(t, g, begin, n, s);
  else update_states<T, float, kMaster>(t, g, begin, n, s);
}

// kInt8Path: the kernel with the int8 path, launched for tables that hold int8 states. The path
// takes 108 registers where the others take 79 (sm_90a, CUDA 13), so steps without int8 states
// launch the kernel without it and keep 3 resident blocks an SM instead of 2.
template <bool kInt8Path>
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
      case ParamDtype::kFloat: update_typed<float, false, kInt8Path>(t, grad, begin, n, s); break;
      case ParamDtype::kHalf:
        if (t.master) update_typed<c10::Half, true, kInt8Path>(t, grad, begin, n, s);
        else update_typed<c10::Half, false, kInt8Path>(t, grad, begin, n, s);
        break;
      case ParamDtype::kBFloat16:
        if (t.master) update_typed<c10::BFloat16, true, kInt8Path>(t, grad, begin, n, s);
        else update_typed<c10::BFloat16, false, kInt8Path>(t, grad, begin, n, s);
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
