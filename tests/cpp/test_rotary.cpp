// rotary on the C++ side: the CPU op through the dispatcher (as any C++ caller would use it) against
// a reference written with ATen ops, and an argument error.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <tuple>

#include "testing.h"

namespace {

using RotaryFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&, double, bool, bool,
                                                      std::optional<at::ScalarType>);

c10::TypedOperatorHandle<RotaryFn> rotary_op() {
  return c10::Dispatcher::singleton().findSchemaOrThrow("fuseforge::rotary", "").typed<RotaryFn>();
}

// Hugging Face's rotate_half form on (B, H, S, D) x with cos/sin (B, 1, S, R / 2), in float64.
at::Tensor reference(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t half) {
  const auto x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  const auto rest = x.narrow(-1, 2 * half, x.size(-1) - 2 * half);
  return at::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest}, -1);
}

}  // namespace

TEST(Rotary, CpuOpThroughDispatcherMatchesAten) {
  at::manual_seed(5);
  const int64_t half = 3;  // R = 6 of D = 10: partial rotary
  const auto q = at::randn({2, 4, 5, 10}, at::kDouble);
  const auto k = at::randn({2, 5, 2, 10}, at::kDouble).transpose(1, 2);  // (B, S, H, D) memory
  const auto inv_freq = at::pow(10000.0, -at::arange(0, 2 * half, 2, at::kFloat) / (2 * half));
  const auto positions = at::tensor({0, 1, 2, 0, 1, 7, 8, 9, 10, 11}, at::kLong).view({2, 5});
  const double scaling = 0.75;
  auto [q_out, k_out] = rotary_op().call(q, k, inv_freq, positions, scaling, false, false, std::nullopt);
  EXPECT_TRUE(q_out.transpose(1, 2).is_contiguous());
  const auto angle = (positions.to(at::kFloat).unsqueeze(-1) * inv_freq).to(at::kDouble).unsqueeze(1);
  const auto cos = angle.cos() * scaling, sin = angle.sin() * scaling;
  EXPECT_LT((q_out - reference(q, cos, sin, half)).abs().max().item<double>(), 1e-12);
  EXPECT_LT((k_out - reference(k, cos, sin, half)).abs().max().item<double>(), 1e-12);
  // inverse=True rotates back (up to scaling^2).
  auto [q_back, k_back] = rotary_op().call(q_out, k_out, inv_freq, positions, 1.0 / scaling, false, true, std::nullopt);
  EXPECT_LT((q_back - q).abs().max().item<double>(), 1e-12);
}

TEST(Rotary, RotaryDimsLargerThanHeadDimAreRejected) {
  const auto q = at::randn({1, 2, 3, 4});
  const auto inv_freq = at::ones({3});
  const auto positions = at::arange(3, at::kLong).view({1, 3});
  fuseforge::testing::expect_error_naming(
      [&] { rotary_op().call(q, q, inv_freq, positions, 1.0, false, false, std::nullopt); },
      "R = 6 rotary dims exceed the head dim D = 4");
}
