// 16-byte vector loads and stores for the aligned paths of memory-bound kernels, and 16-bit
// elements packed two to a register (host code may include this for is_aligned).
#pragma once
#include <c10/macros/Macros.h>

#include <cstdint>
#if defined(__CUDACC__)
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>
#endif

namespace fuseforge {

template <typename T, int N>
struct alignas(sizeof(T) * N) AlignedVector {
  T val[N];
};

template <typename T, int N>
C10_DEVICE __forceinline__ AlignedVector<T, N> load_vector(const T* ptr) {
  return *reinterpret_cast<const AlignedVector<T, N>*>(ptr);
}

template <typename T, int N>
C10_DEVICE __forceinline__ void store_vector(T* ptr, const AlignedVector<T, N>& v) {
  *reinterpret_cast<AlignedVector<T, N>*>(ptr) = v;
}

C10_HOST_DEVICE inline bool is_aligned(const void* ptr, int bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

#if defined(__CUDACC__)
// Elements kept as 32-bit words: two 16-bit elements a word (the first in the low half), or one
// float. An array of c10::BFloat16 / c10::Half takes a register an element and a PRMT to split
// each out of its load (two where the load is predicated); as words a bf16 widens to float with
// one shift or mask, an fp16 with one cvt, and two floats round back into a word with one F2FP.
template <typename U>
inline constexpr int kElemsPerWord = 4 / static_cast<int>(sizeof(U));

// Element i (0 or 1 for 16-bit U, 0 for float) of a word, as float.
template <typename U>
__device__ __forceinline__ float word_element(uint32_t word, int i) {
  if constexpr (std::is_same_v<U, float>) {
    return __uint_as_float(word);
  } else if constexpr (std::is_same_v<U, c10::BFloat16>) {
    return __uint_as_float(i == 0 ? word << 16 : word & 0xffff0000u);
  } else {
    static_assert(std::is_same_v<U, c10::Half>, "float, c10::BFloat16 or c10::Half");
    return __half2float(__ushort_as_half(static_cast<unsigned short>(i == 0 ? word : word >> 16)));
  }
}

// kElemsPerWord<U> floats rounded to U (to nearest even, as static_cast<U> rounds) into a word.
template <typename U>
__device__ __forceinline__ uint32_t floats_to_word(const float* f) {
  if constexpr (std::is_same_v<U, float>) {
    return __float_as_uint(f[0]);
  } else if constexpr (std::is_same_v<U, c10::BFloat16>) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(f[0], f[1]);
    return *reinterpret_cast<const uint32_t*>(&pair);
  } else {
    const __half2 pair = __floats2half2_rn(f[0], f[1]);
    return *reinterpret_cast<const uint32_t*>(&pair);
  }
}

// Which lines a cache evicts first: kLast, lines read again (kept); kFirst, lines read for the last time.
enum class Eviction { kLast, kFirst };

// An L2 policy for load_l2_hint / load_cached (createpolicy, sm_80+; before sm_80 the loads are plain).
template <Eviction kPriority>
__device__ __forceinline__ uint64_t l2_policy() {
  uint64_t policy = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kPriority == Eviction::kLast) {
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  } else {
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  }
#endif
  return policy;
}
__device__ __forceinline__ uint64_t l2_evict_last_policy() { return l2_policy<Eviction::kLast>(); }

// N consecutive elements of U (4, 8 or 16 bytes) as words: one aligned access to load or store.
template <typename U, int N>
struct PackedElements {
  static constexpr int kWords = N / kElemsPerWord<U>;
  static_assert(N % kElemsPerWord<U> == 0 && (kWords == 1 || kWords == 2 || kWords == 4),
                "4, 8 or 16 bytes of whole words");
  AlignedVector<uint32_t, kWords> words;

  __device__ __forceinline__ void load(const U* p) {
    words = load_vector<uint32_t, kWords>(reinterpret_cast<const uint32_t*>(p));
  }
  // The same load under an L2 eviction policy (from l2_evict_last_policy()).
  __device__ __forceinline__ void load_l2_hint(const U* p, uint64_t policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (kWords == 4) {
      asm("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
          : "=r"(words.val[0]), "=r"(words.val[1]), "=r"(words.val[2]), "=r"(words.val[3])
          : "l"(p), "l"(policy));
    } else if constexpr (kWords == 2) {
      asm("ld.global.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;"
          : "=r"(words.val[0]), "=r"(words.val[1])
          : "l"(p), "l"(policy));
    } else {
      asm("ld.global.L2::cache_hint.u32 %0, [%1], %2;" : "=r"(words.val[0]) : "l"(p), "l"(policy));
    }
#else
    load(p);
#endif
  }
  // The 16-byte load under an L2 policy (l2_policy()) with an L1 eviction priority: a line read
  // again from L1 kLast, its last read kFirst. Volatile: the compiler neither merges a re-read with
  // the first read nor hoists it across a barrier, so the row need not stay in registers.
  template <Eviction kL1>
  __device__ __forceinline__ void load_cached(const U* p, uint64_t policy) {
    static_assert(kWords == 4, "16-byte accesses");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (kL1 == Eviction::kLast) {
      asm volatile("ld.global.L1::evict_last.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                   : "=r"(words.val[0]), "=r"(words.val[1]), "=r"(words.val[2]), "=r"(words.val[3])
                   : "l"(p), "l"(policy));
    } else {
      asm volatile("ld.global.L1::evict_first.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                   : "=r"(words.val[0]), "=r"(words.val[1]), "=r"(words.val[2]), "=r"(words.val[3])
                   : "l"(p), "l"(policy));
    }
#else
    load(p);
#endif
  }
  __device__ __forceinline__ void store(U* p) const {
    store_vector<uint32_t, kWords>(reinterpret_cast<uint32_t*>(p), words);
  }
  __device__ __forceinline__ void set_zero() {
#pragma unroll
    for (int w = 0; w < kWords; ++w) words.val[w] = 0u;
  }
  __device__ __forceinline__ float get(int j) const {
    return word_element<U>(words.val[j / kElemsPerWord<U>], j % kElemsPerWord<U>);
  }
  __device__ __forceinline__ void set(const float (&f)[N]) {
#pragma unroll
    for (int w = 0; w < kWords; ++w) words.val[w] = floats_to_word<U>(f + w * kElemsPerWord<U>);
  }
};

// load_vector's load (4, 8 or 16 bytes) under an L2 eviction policy (PackedElements::load_l2_hint).
template <typename T, int N>
__device__ __forceinline__ AlignedVector<T, N> load_vector_l2_hint(const T* p, uint64_t policy) {
  PackedElements<T, N> packed;
  packed.load_l2_hint(p, policy);
  return *reinterpret_cast<const AlignedVector<T, N>*>(&packed.words);
}
#endif  // __CUDACC__

}  // namespace fuseforge
