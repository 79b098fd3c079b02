// The vectorized CPU kernels of rms_norm: raw-pointer arguments and the entry points of the per-ISA
// builds (common/cpu_isa.h). Plain C++; the kernels are in rms_norm_cpu_kernel.h.
#pragma once
#include <c10/core/ScalarType.h>

#include <cstdint>

#include "common/cpu_isa.h"

namespace fuseforge::rms_norm {

// Every tensor rows x cols and contiguous; mean and rstd (rows,) float (double for float64).
struct CpuForwardArgs {
  const void *x, *residual;  // residual nullptr when absent
  const void* weight;        // nullptr when absent; weight_dtype: dtype's or float32
  c10::ScalarType weight_dtype;
  const void* bias;  // LayerNorm's, nullptr when absent; bias_dtype: dtype's or float32
  c10::ScalarType bias_dtype;
  bool centered;     // LayerNorm: (h - mean) * rstd * w + b, rstd from the variance
  double weight_offset, eps;
  void* out;           // out_dtype
  void* residual_out;  // h = x + residual (dtype), nullptr without a residual
  void* mean;          // LayerNorm's row means; nullptr: not stored (RMSNorm, or no gradient wanted)
  void* rstd;          // nullptr: not stored (no gradient wanted)
  int64_t rows, cols;
  c10::ScalarType dtype, out_dtype;
};

struct CpuBackwardArgs {
  const void* grad_out;           // grad_out_dtype (the forward's out dtype)
  const void* grad_residual_out;  // nullptr when absent
  const void* h;
  const void* weight;  // nullptr when absent
  c10::ScalarType weight_dtype;
  double weight_offset;
  const void* rstd;
  const void* mean;  // LayerNorm's (then the backward is LayerNorm's); nullptr for RMSNorm
  void* grad_input;
  void* grad_weight;  // weight_dtype, nullptr when not wanted
  void* grad_bias;    // bias_dtype (the input's or float), nullptr when not wanted
  c10::ScalarType bias_dtype;
  int64_t rows, cols;
  c10::ScalarType dtype, grad_out_dtype;
};

FUSEFORGE_CPU_ISA_DECLARE(void forward(const CpuForwardArgs& a))
FUSEFORGE_CPU_ISA_DECLARE(void backward(const CpuBackwardArgs& a))

}  // namespace fuseforge::rms_norm
