// Helpers of the per-ISA CPU kernels (common/cpu_isa.h): include only from an `<op>_cpu_kernel.h`.
// Everything here has internal linkage (an unnamed namespace), so the baseline, AVX2 and AVX-512
// builds of a helper can never be merged by the linker into one copy of the wrong ISA. For the same
// reason kernels use Buffer / fill / thread_scratch rather than std::vector / std::fill: library
// templates have external linkage, are instantiated in every ISA build, and the linker keeps one
// copy of each (possibly the AVX-512 one, for every build).
#pragma once
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Exception.h>

#include <cstdlib>

#include <cstdint>
#include <type_traits>

#ifndef FUSEFORGE_CPU_NS
#error "include a common/cpu_isa_prologue_*.h or define FUSEFORGE_CPU_NS first (see common/cpu_isa.h)"
#endif

namespace fuseforge {
namespace {

template <typename M>
using CpuVec = at::vec::Vectorized<M>;

// erf to ~1 ulp: at::vec's float erf on AVX2/AVX-512 is a 5-term polynomial whose relative error in
// gelu reaches 5e-7 near z = -0.1 on one machine and 1.8e-6 on another (eager's gelu is ~1e-8 there),
// so the float builds call SLEEF's erf (exported by libtorch_cpu); double and the baseline build use
// at::vec's (SLEEF u10 / libm).
template <typename M>
CpuVec<M> accurate_erf(CpuVec<M> v) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<M, float>) return CpuVec<M>(Sleef_erff16_u10(static_cast<__m512>(v)));
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<M, float>) return CpuVec<M>(Sleef_erff8_u10(static_cast<__m256>(v)));
#endif
  return v.erf();
}

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

// Zero-initialised memory of n Ms, freed at scope exit.
template <typename M>
class Buffer {
 public:
  explicit Buffer(int64_t n) : p_(n > 0 ? new M[n]() : nullptr) {}
  ~Buffer() { delete[] p_; }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  M* data() const { return p_; }

 private:
  M* p_;
};

template <typename M>
inline void fill(M* p, int64_t n, M value) {
  for (int64_t i = 0; i < n; ++i) p[i] = value;
}

// A scratch buffer of n Ms for the calling thread, kept between calls (contents undefined): fresh
// allocations of 128 KiB and more are mmap'd by glibc, and touching their new pages cost a backward
// of add_mul_act at the demo's size a third of its time.
struct ScratchMemory {
  void* p = nullptr;
  size_t bytes = 0;
  ~ScratchMemory() { std::free(p); }
};

template <typename M>
M* thread_scratch(int64_t n) {
  thread_local ScratchMemory mem;
  const size_t need = static_cast<size_t>(n > 0 ? n : 1) * sizeof(M);
  if (mem.bytes < need) {
    std::free(mem.p);
    mem.p = std::malloc(need);
    mem.bytes = mem.p ? need : 0;
    TORCH_CHECK(mem.p != nullptr, "out of memory: a CPU kernel's scratch buffer of ", need, " bytes");
  }
  return static_cast<M*>(mem.p);
}

template <typename T, typename M>
void store_math(const M* src, T* dst, int64_t n) {
  if constexpr (!std::is_same_v<T, M>)
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// The lanes' maximum (NaN if a lane is NaN: at::vec::maximum propagates it), by halving shuffles.
template <typename M>
M lanes_max(const CpuVec<M>& v) {
  return at::vec::vec_reduce_all<M>([](const CpuVec<M>& a, const CpuVec<M>& b) { return at::vec::maximum(a, b); },
                                    v);
}

}  // namespace
}  // namespace fuseforge
