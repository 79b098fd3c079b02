// Host-side pieces of linear_cross_entropy shared by the CPU and CUDA implementations: argument
// parsing, input checks (errors name the argument) and the flattened 2-D problem every
// implementation works on.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string_view>

#include "common/reduction.h"

namespace fuseforge::linear_cross_entropy {

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

// The per-row entropy of the (capped) logits' distribution, an extra output of per-token losses.
// The forward's request: only with reduction "none".
void check_entropy_request(const Problem& p, bool entropy);

// The recomputing backward's entropy inputs, flattened: the forward's entropy rows and their upstream
// gradient (both of target's shape, in the stats dtype; grad_entropy converted to it), or undefined
// tensors when no entropy gradient is given (then the backward is the plain per-token one).
struct EntropyGrad {
  at::Tensor entropy, grad;
  bool defined() const { return grad.defined(); }
};
EntropyGrad entropy_grad_inputs(const Problem& p, const at::Tensor& x, const std::optional<at::Tensor>& entropy,
                                const std::optional<at::Tensor>& grad_entropy);

// linear_cross_entropy_rows_stats' arguments checked and flattened: prepare's problem (reduction
// "none") plus logits (N, V) contiguous in x's dtype on x's device, for its N rows and V classes.
Problem prepare_rows(const at::Tensor& logits, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& bias, int64_t ignore_index, double softcap, bool allow_double);
// linear_cross_entropy_rows_grad_'s arguments checked: logits (N, V) contiguous, stats (3, N) as
// rows_stats returned them (lse, nll = -log p(target), the exact raw target logit x . W[t]),
// row_scale (N,) in the stats dtype, target (N,), bias (V,) or none. Returns target as contiguous
// int64 and bias contiguous (or undefined).
struct RowsGradArgs {
  at::Tensor target, bias;
};
RowsGradArgs check_rows_grad(const at::Tensor& logits, const at::Tensor& stats, const at::Tensor& target,
                             const std::optional<at::Tensor>& bias, const at::Tensor& row_scale, double softcap,
                             bool allow_double);

}  // namespace fuseforge::linear_cross_entropy
