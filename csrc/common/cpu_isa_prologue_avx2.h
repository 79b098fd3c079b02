// First include of an `<op>_cpu_avx2.cpp` file (see common/cpu_isa.h). The build compiles these
// files with -mavx2 -mfma ... -DCPU_CAPABILITY=AVX2 -DCPU_CAPABILITY_AVX2 (setup.py ISA_FLAGS,
// CMakeLists.txt), on x86-64 only; FUSEFORGE_CPU_ISA_TU says whether this is such a build.
#pragma once
#include "common/cpu_isa.h"

#if FUSEFORGE_CPU_HAS_ISA_BUILDS
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(CPU_CAPABILITY_AVX2)
#error "compile *_cpu_avx2.cpp with setup.py's ISA_FLAGS['avx2'] (-mavx2 -mfma ... -DCPU_CAPABILITY_AVX2)"
#endif
#define FUSEFORGE_CPU_NS cpu_avx2
#define FUSEFORGE_CPU_ISA_TU 1
#else
#define FUSEFORGE_CPU_ISA_TU 0
#endif
