// First include of an `<op>_cpu_avx512.cpp` file (see common/cpu_isa.h). The build compiles these
// files with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma ... -DCPU_CAPABILITY=AVX512
// -DCPU_CAPABILITY_AVX512 (torch's AVX512 capability; setup.py ISA_FLAGS, CMakeLists.txt), on x86-64
// only; FUSEFORGE_CPU_ISA_TU says whether this is such a build.
#pragma once
#include "common/cpu_isa.h"

#if FUSEFORGE_CPU_HAS_ISA_BUILDS
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(CPU_CAPABILITY_AVX512)
#error "compile *_cpu_avx512.cpp with setup.py's ISA_FLAGS['avx512'] (-mavx512f ... -DCPU_CAPABILITY_AVX512)"
#endif
#define FUSEFORGE_CPU_NS cpu_avx512
#define FUSEFORGE_CPU_ISA_TU 1
#else
#define FUSEFORGE_CPU_ISA_TU 0
#endif
