// glu's CPU kernels, baseline build (common/cpu_isa.h).
#define FUSEFORGE_CPU_NS cpu_default
#include "glu/glu_cpu_kernel.h"
