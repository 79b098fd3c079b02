// The vectorized CPU kernels of add_mul_act: raw-pointer arguments and the entry points of the two
// builds (common/cpu_isa.h). Plain C++; the kernels are in add_mul_act_cpu_kernel.h.
#pragma once
#include <c10/core/ScalarType.h>

#include <cstdint>

#include "common/activation.h"
#include "common/cpu_isa.h"

namespace fuseforge::add_mul_act {

struct CpuForwardArgs {
  const void *x, *y, *bias;  // bias nullptr when absent
  void* out;
  void* saved_z;       // the pre-activation (non-relu training forward), else nullptr
  uint8_t* mask;       // relu's bit mask (relu training forward), else nullptr
  int64_t rows, cols;
  double alpha;
  Activation act;
  c10::ScalarType dtype;
};

struct CpuBackwardArgs {
  const void* grad_out;
  const void* saved_z;        // non-relu
  const uint8_t* mask;        // relu
  void *grad_x, *grad_y, *grad_bias;  // grad_y, grad_bias nullptr when not wanted
  int64_t rows, cols;
  double alpha;
  Activation act;
  c10::ScalarType dtype;
};

FUSEFORGE_CPU_ISA_DECLARE(void forward(const CpuForwardArgs& a))
FUSEFORGE_CPU_ISA_DECLARE(void backward(const CpuBackwardArgs& a))

}  // namespace fuseforge::add_mul_act
