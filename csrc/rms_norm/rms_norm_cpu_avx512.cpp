// rms_norm's CPU kernels, AVX-512 build (common/cpu_isa.h).
#include "common/cpu_isa_prologue_avx512.h"
#if FUSEFORGE_CPU_ISA_TU
#include "rms_norm/rms_norm_cpu_kernel.h"
#endif
