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

// FUSEFORGE_TANH_MODE (A/B knob, 2026-11-26): 0 ex2 + rcp (two SFU ops), 1 tanh.approx.f32 (one),
// 3 mode 0 on even elements and one SFU op with the reciprocal by Newton steps on the FMA pipe on
// odd ones (the same precision as 0, the SFU and issue slots balanced).
#ifndef FUSEFORGE_TANH_MODE
#define FUSEFORGE_TANH_MODE 0
#endif

// tanh(x) = 1 - 2 / (2^(2 x log2 e) + 1) on the SFU (ex2 and rcp): absolute error ~1e-7 over the
// whole range (+-1 exactly at the ends, inf -> 1), unlike tanh.approx's ~5e-4 relative, which a
// softcap of 50 would turn into 0.02 on a logit.
__device__ __forceinline__ float sfu_tanh(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(fast_exp2(2.f * kLog2e * x) + 1.f));
  return fmaf(-2.f, r, 1.f);
}

// The same with 1 / y by the FMA pipe: 2 x log2 e clamped at 40 (tanh is 1.0f from x = 9.1 on;
// min.NaN keeps a NaN), y = 2^u + 1 in [1, 2^40 + 1]; 1 / y from the exponent-flip estimate (5%
// off), one cubic and one Newton step (5e-2 -> 1.3e-4 -> 2e-8): |error| < 3e-7.
__device__ __forceinline__ float fma_rcp_tanh(float x) {
  float u;
  asm("min.NaN.f32 %0, %1, 0f42200000;\n" : "=f"(u) : "f"(2.f * kLog2e * x));
  const float y = fast_exp2(u) + 1.f;
  float r = __int_as_float(0x7EF311C7 - __float_as_int(y));
  float e = fmaf(-y, r, 1.f);
  r = fmaf(r, fmaf(e, e, e), r);
  e = fmaf(-y, r, 1.f);
  r = fmaf(r, e, r);
  return fmaf(-2.f, r, 1.f);
}

// tanh of element i of an unrolled loop (i a compile-time constant there).
__device__ __forceinline__ float fast_tanh(float x, int i) {
#if FUSEFORGE_TANH_MODE == 1
  float t;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(t) : "f"(x));
  return t;
#elif FUSEFORGE_TANH_MODE == 3
  return (i & 1) ? fma_rcp_tanh(x) : sfu_tanh(x);
#else
  return sfu_tanh(x);
#endif
}

}  // namespace fuseforge
