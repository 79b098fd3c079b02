// attention's CPU kernels, baseline build (common/cpu_isa.h).
#define FUSEFORGE_CPU_NS cpu_default
#include "attention/cpu/attention_cpu_kernel.h"
