// rms_norm's CPU kernels, baseline build (common/cpu_isa.h).
#define FUSEFORGE_CPU_NS cpu_default
#include "rms_norm/rms_norm_cpu_kernel.h"
