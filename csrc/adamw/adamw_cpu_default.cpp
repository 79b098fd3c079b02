// AdamW's CPU update, baseline build (common/cpu_isa.h).
#define FUSEFORGE_CPU_NS cpu_default
#include "adamw/adamw_cpu_kernel.h"
