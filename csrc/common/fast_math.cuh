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

// tanh(x) = 1 - 2 / (2^(2 x log2 e) + 1) on the SFU (ex2 and rcp): absolute error ~1e-7 over the
// whole range (+-1 exactly at the ends, inf -> 1), unlike tanh.approx's ~5e-4 relative, which a
// softcap of 50 would turn into 0.02 on a logit.
__device__ __forceinline__ float fast_tanh(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(fast_exp2(2.f * kLog2e * x) + 1.f));
  return fmaf(-2.f, r, 1.f);
}

}  // namespace fuseforge
