// The CPU kernels of attention: raw-pointer arguments and the entry points of the three builds
// (common/cpu_isa.h). Plain C++; the kernels are in attention_cpu_kernel.h. They take float32 or
// float64 (the host converts float16/bfloat16 to float32 first) and compute in that type.
#pragma once
#include <c10/core/ScalarType.h>

#include <cstdint>

#include "common/cpu_isa.h"

namespace fuseforge::attention {

// A (B, H, S, D) operand: element (b, h, s, d) at ptr[b * sb + h * sh + s * ss + d] (the last dim
// contiguous; D == 1 may have any last stride, it is never used).
struct CpuOperand {
  const void* ptr = nullptr;
  int64_t sb = 0, sh = 0, ss = 0;
};

struct CpuOutput {
  void* ptr = nullptr;
  int64_t sb = 0, sh = 0, ss = 0;
};

struct CpuShape {
  int64_t batch = 0, heads_q = 0, heads_kv = 0, seqlen_q = 0, seqlen_k = 0, head_dim = 0;
};

// The mask, aligned bottom-right (off = Sk - Sq): query row i sees key j iff
//   (window_left < 0 || j >= i + off - window_left) && (window_right < 0 || j <= i + off + window_right),
// -1 meaning no bound on that side (causal is window_left = -1, window_right = 0; either bound may
// exceed the sequence lengths). The score is z = scale * q.k, or softcap * tanh(scale * q.k / softcap)
// when softcap > 0; softmax over z, lse = log sum exp z. A row that sees no key has a zero output,
// lse = -inf and no gradient.

// out (B, Hq, Sq, D); lse (B, Hq, Sq) of the math type, element (b, h, s) at
// lse[b * lse_sb + h * lse_sh + s * lse_ss] (any strides). Needs Sk > 0. Writes every element of out
// and lse.
struct CpuForwardArgs {
  CpuOperand q, k, v;
  CpuOutput out;
  void* lse = nullptr;
  int64_t lse_sb = 0, lse_sh = 0, lse_ss = 0;
  CpuShape shape;
  int64_t window_left = -1, window_right = -1;  // the mask above
  double softcap = 0.0;                         // > 0: z = softcap * tanh(scale * q.k / softcap)
  double scale = 1.0;
  c10::ScalarType dtype = c10::ScalarType::Float;  // float32 or float64
};

// Needs Sk > 0; lse (B, Hq, Sq) of the math type, any strides, as the forward wrote it (same mask,
// softcap and scale). Writes every element of grad_q, grad_k, grad_v.
struct CpuBackwardArgs {
  CpuOperand grad_out, q, k, v, out;
  const void* lse = nullptr;
  int64_t lse_sb = 0, lse_sh = 0, lse_ss = 0;
  CpuOutput grad_q, grad_k, grad_v;
  CpuShape shape;
  int64_t window_left = -1, window_right = -1;  // the mask above
  double softcap = 0.0;                         // > 0: z = softcap * tanh(scale * q.k / softcap)
  double scale = 1.0;
  c10::ScalarType dtype = c10::ScalarType::Float;
};

FUSEFORGE_CPU_ISA_DECLARE(void forward(const CpuForwardArgs& a))
FUSEFORGE_CPU_ISA_DECLARE(void backward(const CpuBackwardArgs& a))

}  // namespace fuseforge::attention
