// Host-side pieces of linear_cross_entropy shared by the CPU and CUDA implementations: argument
// parsing, input checks (errors name the argument) and the flattened 2-D problem every
// implementation works on.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string_view>

namespace fuseforge::linear_cross_entropy {

enum class Reduction { kNone, kMean, kSum };

Reduction parse_reduction(std::string_view reduction);

// The loss settings every kernel needs.
struct LossConfig {
  int64_t ignore_index = -100;
  Reduction reduction = Reduction::kMean;
  double label_smoothing = 0.0;
  double z_loss = 0.0;
  double softcap = 0.0;  // 0: no soft-capping
};

// Flattened inputs: x2d (N, H) contiguous, weight (V, H) contiguous, target (N,) int64 contiguous,
// bias (V,) contiguous or undefined.
struct Problem {
  at::Tensor x2d, weight, target, bias;
  int64_t rows = 0, hidden = 0, vocab = 0;
  LossConfig cfg;
  at::IntArrayRef batch_shape;  // target's shape: the shape of an unreduced loss
};

// Which gradients to produce.
struct GradRequest {
  bool x = false, weight = false, bias = false;
  bool any() const { return x || weight || bias; }
};

// Checks every argument and returns the flattened problem. allow_double: the CPU implementation.
Problem prepare(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& target,
                const std::optional<at::Tensor>& bias, int64_t ignore_index, std::string_view reduction,
                double label_smoothing, double z_loss, double softcap, bool allow_double);

// The dtype of losses and log-sum-exps: float64 for float64 inputs, else float32.
inline at::ScalarType stats_dtype(at::ScalarType input) {
  return input == at::kDouble ? at::kDouble : at::kFloat;
}

// Shapes the loss as the reduction asks: a 0-dim tensor, or batch_shape for "none".
at::Tensor shape_loss(const at::Tensor& row_losses, const at::Tensor& inv_count, const Problem& p);

// 1 / max(1, number of targets that are not ignore_index), a device scalar (no host sync).
at::Tensor inverse_valid_count(const Problem& p);

}  // namespace fuseforge::linear_cross_entropy
