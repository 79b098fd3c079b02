// The vectorized CPU kernels of glu: raw-pointer arguments and the entry points of the per-ISA builds
// (common/cpu_isa.h). Plain C++; the kernels are in glu_cpu_kernel.h.
#pragma once
#include <c10/core/ScalarType.h>

#include <cstdint>

#include "common/activation.h"
#include "common/cpu_isa.h"

namespace fuseforge::glu {

// Row r of a matrix m starts at m + r * m_row_stride (elements); columns are dense.
struct CpuForwardArgs {
  const void *gate, *up;
  int64_t gate_row_stride, up_row_stride;
  void* out;  // rows x cols, contiguous
  int64_t rows, cols;
  Activation act;  // silu, gelu_tanh or gelu
  c10::ScalarType dtype;
};

struct CpuBackwardArgs {
  const void *grad_out, *gate, *up;
  int64_t grad_out_row_stride, gate_row_stride, up_row_stride;
  void *grad_gate, *grad_up;
  int64_t grad_gate_row_stride, grad_up_row_stride;
  int64_t rows, cols;
  Activation act;
  c10::ScalarType dtype;
};

FUSEFORGE_CPU_ISA_DECLARE(void forward(const CpuForwardArgs& a))
FUSEFORGE_CPU_ISA_DECLARE(void backward(const CpuBackwardArgs& a))

}  // namespace fuseforge::glu
