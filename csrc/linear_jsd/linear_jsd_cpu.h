// The row kernel of linear_jsd's CPU implementation: raw-pointer arguments and the entry points of
// the per-ISA builds (common/cpu_isa.h). Plain C++; the kernel is in linear_jsd_cpu_kernel.h, the
// GEMMs around it in linear_jsd.cpp.
#pragma once
#include <c10/core/ScalarType.h>

#include <cstdint>

#include "common/cpu_isa.h"

namespace fuseforge::linear_jsd {

// One chunk of rows whose student and teacher logits (rows x vocab each, row stride vocab, not yet
// divided by the temperature) are in the math type (float; double for float64 inputs). Row by row:
// both log-sum-exps, the row's divergence and, when grad_rows is set, d loss / d student logits,
// which overwrite the student logits.
struct CpuRowArgs {
  void* student;                // in: x_s W_s^T; out (grad_rows set): dz
  void* teacher;                // in: x_t W_t^T; scratch when grad_rows is set
  const int64_t* target;        // rows, or nullptr: no row is skipped
  void* row_loss;               // rows, or nullptr (the recomputing backward)
  const void* grad_rows;        // per-row weights of the loss (1/count for mean), or nullptr: no gradient
  int64_t grad_rows_stride;     // 0: one weight for every row
  int64_t rows, vocab;
  int64_t ignore_index;
  int mode;                     // Mode: 0 forward KL, 1 reverse KL, 2 JSD
  double beta, inv_temperature;
  c10::ScalarType dtype;        // the math type: kFloat or kDouble
};

FUSEFORGE_CPU_ISA_DECLARE(void rows(const CpuRowArgs& a))

}  // namespace fuseforge::linear_jsd
