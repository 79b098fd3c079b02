// Host-side pieces of linear_jsd shared by the CPU and CUDA implementations: argument parsing, input
// checks (errors name the argument) and the flattened 2-D problem every implementation works on.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string_view>

#include "common/reduction.h"

namespace fuseforge::linear_jsd {

// Which divergence a row computes. beta 0 and 1 are Liger-Kernel's special cases (its generalised
// JSD is 0 there): the forward and the reverse KL divergence.
enum class Mode { kForwardKL, kReverseKL, kJSD };

struct Config {
  double beta = 0.5, temperature = 1.0;
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::kMean;
  Mode mode = Mode::kJSD;
};

// Flattened inputs, contiguous: student_x (N, Hs), student_weight (V, Hs), teacher_x (N, Ht),
// teacher_weight (V, Ht), target (N,) int64 or undefined (no token is skipped).
struct Problem {
  at::Tensor sx, sw, tx, tw, target;
  int64_t rows = 0, vocab = 0;
  Config cfg;
  at::IntArrayRef batch_shape;  // the leading dims of student_x: the shape of an unreduced loss
};

struct GradRequest {
  bool x = false, weight = false;
  bool any() const { return x || weight; }
};

// Checks every argument and returns the flattened problem. allow_double: the CPU implementation.
Problem prepare(const at::Tensor& student_x, const at::Tensor& student_weight, const at::Tensor& teacher_x,
                const at::Tensor& teacher_weight, const std::optional<at::Tensor>& target, double beta,
                double temperature, int64_t ignore_index, std::string_view reduction, bool allow_double);

// The dtype of losses: float64 for float64 inputs, else float32.
inline at::ScalarType stats_dtype(at::ScalarType input) { return input == at::kDouble ? at::kDouble : at::kFloat; }

// 1 / max(1, number of tokens not skipped), a device scalar (no host sync).
at::Tensor inverse_valid_count(const Problem& p);

// Shapes the loss as the reduction asks: a 0-dim tensor, or batch_shape for "none".
at::Tensor shape_loss(const at::Tensor& row_losses, const at::Tensor& inv_count, const Problem& p);

// The forward's and the backward's checks of grad_loss against the reduction.
void check_grad_loss(const at::Tensor& grad_loss, const Problem& p);

}  // namespace fuseforge::linear_jsd
