// add_mul_act's CPU kernels, baseline build (common/cpu_isa.h).
#define FUSEFORGE_CPU_NS cpu_default
#include "add_mul_act/add_mul_act_cpu_kernel.h"
