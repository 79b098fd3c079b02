// linear_cross_entropy's CPU row kernel, baseline build (common/cpu_isa.h).
#define FUSEFORGE_CPU_NS cpu_default
#include "linear_cross_entropy/linear_cross_entropy_cpu_kernel.h"
