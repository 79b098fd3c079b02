// attention's CPU kernels, AVX-512 build (common/cpu_isa.h).
#include "common/cpu_isa_prologue_avx512.h"
#if FUSEFORGE_CPU_ISA_TU
#include "attention/cpu/attention_cpu_kernel.h"
#endif
