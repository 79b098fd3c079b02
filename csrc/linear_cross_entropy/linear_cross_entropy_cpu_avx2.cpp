// linear_cross_entropy's CPU row kernel, AVX2 + FMA build (common/cpu_isa.h).
#include "common/cpu_isa_prologue_avx2.h"
#if FUSEFORGE_CPU_ISA_TU
#include "linear_cross_entropy/linear_cross_entropy_cpu_kernel.h"
#endif
