// CPU kernels built once per x86 ISA level (baseline, AVX2 + FMA, AVX-512) and picked at run time,
// as ATen builds its own CPU kernels (one object per capability, DispatchStub), made small: each op
// keeps its vectorized kernels in `<op>_cpu_kernel.h`, written once with at::vec::Vectorized, and
// includes it from one file per level:
//
//   <op>_cpu_default.cpp:  #define FUSEFORGE_CPU_NS cpu_default
//                          #include "<op>/<op>_cpu_kernel.h"
//   <op>_cpu_avx2.cpp:     #include "common/cpu_isa_prologue_avx2.h"   // first: the build's ISA
//                          #if FUSEFORGE_CPU_ISA_TU
//                          #include "<op>/<op>_cpu_kernel.h"
//                          #endif
//   <op>_cpu_avx512.cpp:   the same with common/cpu_isa_prologue_avx512.h
//
// The kernel header declares everything inside `namespace fuseforge::<op>::FUSEFORGE_CPU_NS`, so the
// builds never share a symbol of their own (at::vec's classes are per-capability already, through its
// `inline namespace CPU_CAPABILITY`). Host code calls FUSEFORGE_CPU_ISA_CALL(fn, args...); kernels
// take raw pointers, so the ISA-specific files include no more of ATen than at::vec needs.
//
// Why: Vectorized<float>'s exp/erf/tanh are scalar loops in the baseline build and 8 (AVX2) or 16
// (AVX-512) lanes wide with the target enabled; torch's own kernels on the same machine use the widest.
#pragma once

// x86-64: setup.py and CMakeLists.txt compile the `_cpu_avx2.cpp` / `_cpu_avx512.cpp` files with
// their ISA flags (GCC and Clang take the same -m flags).
#if defined(__x86_64__) && defined(__GNUC__)
#define FUSEFORGE_CPU_HAS_ISA_BUILDS 1
#else
#define FUSEFORGE_CPU_HAS_ISA_BUILDS 0
#endif

namespace fuseforge {

enum class CpuIsa { kDefault, kAvx2, kAvx512 };

// torch's own answer (at::get_cpu_capability(): "DEFAULT", "AVX2", "AVX512"; it honours
// ATEN_CPU_CAPABILITY=default|avx2|avx512, which the tests use to run each build), read once.
CpuIsa cpu_isa();

}  // namespace fuseforge

// Calls cpu_avx512::FN(...), cpu_avx2::FN(...) or cpu_default::FN(...), whichever the CPU runs best.
#if FUSEFORGE_CPU_HAS_ISA_BUILDS
#define FUSEFORGE_CPU_ISA_CALL(FN, ...)                                                         \
  [&] {                                                                                         \
    switch (::fuseforge::cpu_isa()) {                                                           \
      case ::fuseforge::CpuIsa::kAvx512: return cpu_avx512::FN(__VA_ARGS__);                    \
      case ::fuseforge::CpuIsa::kAvx2: return cpu_avx2::FN(__VA_ARGS__);                        \
      default: return cpu_default::FN(__VA_ARGS__);                                             \
    }                                                                                           \
  }()
#else
#define FUSEFORGE_CPU_ISA_CALL(FN, ...) cpu_default::FN(__VA_ARGS__)
#endif

// Declares FN's three builds in the enclosing namespace: FUSEFORGE_CPU_ISA_DECLARE(void forward(const Args&));
#define FUSEFORGE_CPU_ISA_DECLARE(...)  \
  namespace cpu_default {               \
  __VA_ARGS__;                          \
  }                                     \
  namespace cpu_avx2 {                  \
  __VA_ARGS__;                          \
  }                                     \
  namespace cpu_avx512 {                \
  __VA_ARGS__;                          \
  }
