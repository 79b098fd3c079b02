// The fused row kernel of linear_cross_entropy's CPU implementation: raw-pointer arguments and the
// entry points of the per-ISA builds (common/cpu_isa.h). Plain C++; the kernel is in
// linear_cross_entropy_cpu_kernel.h, the GEMMs around it in linear_cross_entropy.cpp.
#pragma once
#include <c10/core/ScalarType.h>

#include <cstdint>

#include "common/cpu_isa.h"

namespace fuseforge::linear_cross_entropy {

// One chunk of rows whose logits x_c @ W^T (rows x vocab, row stride vocab) are in `logits`, in the
// math type (float; double for float64 inputs). Everything between the GEMMs happens here, row by
// row, in place: bias, softcap, max, log-sum-exp, target logit, label smoothing, z-loss, the entropy
// (when asked for), and (when grad_rows is set) the logit gradients, which overwrite the logits.
struct CpuRowArgs {
  void* logits;                 // rows x vocab, in: x_c @ W^T; out: capped logits or (grad_rows) dz
  const void* bias;             // vocab, math type, or nullptr
  const int64_t* target;        // rows (checked: in [0, vocab) or ignore_index)
  void* row_loss;               // rows, or nullptr (not wanted: the recomputing backward)
  void *lse, *nll;              // rows each: written (stats_in false) or read (stats_in true)
  bool stats_in;                // lse/nll come from the forward (the recomputing backward)
  // Rows' entropies (-sum p log p of the capped logits), or nullptr: written with lse (stats_in false)
  // or read (stats_in true) for entropy_grad_rows.
  void* entropy;
  const void* entropy_grad_rows;  // per-row weights of the entropy in the gradient, or nullptr
  const void* grad_rows;        // per-row weights of the loss (1/count for mean), or nullptr: no gradient
  int64_t grad_rows_stride;     // 0: one weight for every row
  int64_t rows, vocab;
  int64_t ignore_index;
  double label_smoothing, z_loss, softcap;  // softcap 0: none
  c10::ScalarType dtype;        // the math type: kFloat or kDouble
};

FUSEFORGE_CPU_ISA_DECLARE(void rows(const CpuRowArgs& a))

}  // namespace fuseforge::linear_cross_entropy
