// Device math on the SFU, shared by the kernels whose inner loops are exp-bound.
#pragma once
#include <cuda_runtime.h>

namespace fuseforge {

constexpr float kLog2e = 1.4426950408889634f;

// 2^x with the SFU's ex2.approx (relative error ~2^-22; -inf -> +0): what exp2f becomes under
// --use_fast_math, without that flag's effect on the rest of the build.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace fuseforge
