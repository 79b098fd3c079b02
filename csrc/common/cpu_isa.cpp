#include "common/cpu_isa.h"

#include <ATen/Version.h>

#include <string>

namespace fuseforge {

CpuIsa cpu_isa() {
  static const CpuIsa isa = [] {
    if (!FUSEFORGE_CPU_HAS_ISA_BUILDS) return CpuIsa::kDefault;
    const std::string cap = at::get_cpu_capability();
    if (cap == "AVX512") return CpuIsa::kAvx512;
    if (cap == "AVX2") return CpuIsa::kAvx2;
    return CpuIsa::kDefault;
  }();
  return isa;
}

}  // namespace fuseforge
