// 16-byte vector loads and stores for the aligned paths of memory-bound kernels (host code may
// include this for is_aligned).
#pragma once
#include <c10/macros/Macros.h>

#include <cstdint>

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

}  // namespace fuseforge
