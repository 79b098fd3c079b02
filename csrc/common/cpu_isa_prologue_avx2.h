// First include of an `<op>_cpu_avx2.cpp` file (see common/cpu_isa.h): compiles the rest of the
// translation unit for AVX2 + FMA and selects at::vec's AVX2 implementation. FUSEFORGE_CPU_ISA_TU is
// 1 where these builds exist (x86-64 GCC), else 0 and the file compiles to nothing.
#pragma once
#include "common/cpu_isa.h"

#if FUSEFORGE_CPU_HAS_ISA_BUILDS
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")
// The pragma does not define the ISA macros -mavx2 would; sleef.h (at::vec's exp, erf, tanh)
// declares its 8-wide functions only under them.
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#define FUSEFORGE_CPU_NS cpu_avx2
#define FUSEFORGE_CPU_ISA_TU 1
#else
#define FUSEFORGE_CPU_ISA_TU 0
#endif
