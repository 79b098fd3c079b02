// linear_jsd's CPU row kernel, baseline build (common/cpu_isa.h).
#define FUSEFORGE_CPU_NS cpu_default
#include "linear_jsd/linear_jsd_cpu_kernel.h"
