// rotary's CPU kernels, baseline build (common/cpu_isa.h).
#define FUSEFORGE_CPU_NS cpu_default
#include "rotary/rotary_cpu_kernel.h"
