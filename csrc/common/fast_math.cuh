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

// tanh on the SFU's tanh.approx.f32 (one SFU op; FlashAttention-2/3's softcap uses it as well).
// Its ~2^-11 relative error stays under the bf16 output's rounding: at Gemma 2's cap of 50 (scores
// up to 4x past it) bench_attention_varlen's rel_err is 0.00179, and the tests' float64 checks at
// cap 50 pass, as they do with the two-op 1 - 2 / (2^(2 x log2 e) + 1), whose second SFU op makes the
// softcap forward SFU-bound (H100: D128 softcap forward 0.81 ms against 0.64 with tanh.approx).
__device__ __forceinline__ float fast_tanh(float x) {
  float t;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(t) : "f"(x));
  return t;
}

}  // namespace fuseforge
