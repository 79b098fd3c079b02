// The vectorized CPU kernel of rotary: raw-pointer arguments and the entry points of the per-ISA
// builds (common/cpu_isa.h). Plain C++; the kernel is in rotary_cpu_kernel.h.
#pragma once
#include <c10/core/ScalarType.h>

#include <cstdint>

#include "common/cpu_isa.h"

namespace fuseforge::rotary {

struct CpuArgs {
  const void *q, *k;               // (B, H, S, D), the last dim dense; strides in elements
  int64_t q_stride[3], k_stride[3];  // over B, H, S
  const float* inv_freq;           // (rot_half,)
  const void* positions;           // (B or 1, S)
  bool positions_int64;            // else int32
  int64_t pos_stride_b, pos_stride_s;
  void *q_out, *k_out;  // (B, S, Hq, D) and (B, S, Hk, D), contiguous
  int64_t batch, seq, heads_q, heads_k, head_dim, rot_half;
  double scaling;
  bool interleaved, inverse;
  c10::ScalarType dtype, out_dtype;
};

FUSEFORGE_CPU_ISA_DECLARE(void rotate(const CpuArgs& a))

}  // namespace fuseforge::rotary
