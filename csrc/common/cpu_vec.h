// Helpers of the per-ISA CPU kernels (common/cpu_isa.h): include only from an `<op>_cpu_kernel.h`.
// Everything here has internal linkage (an unnamed namespace), so the baseline, AVX2 and AVX-512
// builds of a helper can never be merged by the linker into one copy of the wrong ISA.
#pragma once
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <type_traits>

#ifndef FUSEFORGE_CPU_NS
#error "include a common/cpu_isa_prologue_*.h or define FUSEFORGE_CPU_NS first (see common/cpu_isa.h)"
#endif

namespace fuseforge {
namespace {

template <typename M>
using CpuVec = at::vec::Vectorized<M>;

// Elements a kernel converts at a time for low-precision inputs (a multiple of every vector width).
constexpr int64_t kCpuTile = 256;

// src as M: src itself when T is M, else its elements converted into buf.
template <typename T, typename M>
const M* as_math(const T* src, M* buf, int64_t n) {
  if constexpr (std::is_same_v<T, M>) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<M>(src[i]);
    return buf;
  }
}

// Where to compute a T output in M: dst itself when T is M, else buf (then store_math converts).
template <typename T, typename M>
M* math_dst(T* dst, M* buf) {
  if constexpr (std::is_same_v<T, M>) return dst;
  else return buf;
}

template <typename T, typename M>
void store_math(const M* src, T* dst, int64_t n) {
  if constexpr (!std::is_same_v<T, M>)
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

}  // namespace
}  // namespace fuseforge
