// AdamW's vectorized CPU update of float32, float16 and bfloat16 parameters (float32 states), built
// per CPU ISA (common/cpu_isa.h); float64 parameters stay on the scalar path in adamw.cpp.
#pragma once
#include <cstdint>

#include "adamw/adamw_math.h"
#include "adamw/adamw_meta.h"
#include "common/cpu_isa.h"

namespace fuseforge::adamw {

// Elements [begin, begin + n) of tensor t; grad is the param's grad (its type), written back
// unscaled when s.unscale. The same rounding as adamw_element's CPU form, element for element.
FUSEFORGE_CPU_ISA_DECLARE(void update_chunk(const TensorMeta& t, void* grad, int64_t begin, int64_t n,
                                            const StepScalars<float>& s))

}  // namespace fuseforge::adamw
