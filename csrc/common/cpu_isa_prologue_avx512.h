// First include of an `<op>_cpu_avx512.cpp` file (see common/cpu_isa.h): compiles the rest of the
// translation unit for AVX-512 (F, BW, VL, DQ: torch's AVX512 capability) and selects at::vec's
// AVX-512 implementation. FUSEFORGE_CPU_ISA_TU is 1 where these builds exist, else 0.
#pragma once
#include "common/cpu_isa.h"

#if FUSEFORGE_CPU_HAS_ISA_BUILDS
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
// The ISA macros -mavx512f would define (sleef.h and at::vec test them).
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __AVX512F__
#define __AVX512F__ 1
#endif
#ifndef __AVX512BW__
#define __AVX512BW__ 1
#endif
#ifndef __AVX512VL__
#define __AVX512VL__ 1
#endif
#ifndef __AVX512DQ__
#define __AVX512DQ__ 1
#endif
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#define FUSEFORGE_CPU_NS cpu_avx512
#define FUSEFORGE_CPU_ISA_TU 1
#else
#define FUSEFORGE_CPU_ISA_TU 0
#endif
