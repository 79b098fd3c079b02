// A loss op's outputs, shared by the ops that take `reduction="mean" | "sum" | "none"`
// (linear_cross_entropy, linear_jsd): the reduction's parsing with one error message, the loss's
// final shape, and the empty tensor a gradient not asked for is returned as.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <string>
#include <string_view>

namespace fuseforge {

enum class Reduction { kNone, kMean, kSum };

inline Reduction parse_reduction(std::string_view reduction) {
  if (reduction == "mean") return Reduction::kMean;
  if (reduction == "sum") return Reduction::kSum;
  if (reduction == "none") return Reduction::kNone;
  TORCH_CHECK(false, "reduction must be 'mean', 'sum' or 'none', got '", std::string(reduction), "'");
}

// The per-row losses as the reduction asks: batch_shape for "none", else a 0-dim sum, times
// inv_count (1 / the counted rows, a device scalar) for "mean".
inline at::Tensor reduce_rows(const at::Tensor& row_losses, const at::Tensor& inv_count, Reduction reduction,
                              at::IntArrayRef batch_shape) {
  switch (reduction) {
    case Reduction::kNone:
      return row_losses.view(batch_shape);
    case Reduction::kSum:
      return row_losses.sum();
    case Reduction::kMean:
      return row_losses.sum() * inv_count;
  }
  return row_losses;
}

// t, or an empty tensor with like's options where t is undefined (a gradient not asked for: the
// ops' schemas return Tensor, not Tensor?).
inline at::Tensor or_empty(const at::Tensor& t, const at::Tensor& like) {
  return t.defined() ? t : at::empty({0}, like.options());
}

}  // namespace fuseforge
