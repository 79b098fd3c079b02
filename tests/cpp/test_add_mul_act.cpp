// add_mul_act on the C++ side: the activation functors against finite differences, the parser's
// errors, and the CPU op through the dispatcher (as any C++ caller would use it).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>

#include "common/activation.h"
#include "testing.h"

namespace ff = fuseforge;  // the activations are shared (common/activation.h)

template <ff::Activation A>
void expect_derivative_matches_finite_difference() {
  for (double z = -4.0; z <= 4.0; z += 0.37) {
    if (A == ff::Activation::kRelu && std::abs(z) < 1e-3) continue;  // the kink
    const double h = 1e-6;
    const double numeric = (ff::Act<A>::forward(z + h) - ff::Act<A>::forward(z - h)) / (2 * h);
    EXPECT_NEAR(ff::Act<A>::derivative(z), numeric, 1e-7) << "z=" << z;
  }
}

TEST(AddMulAct, DerivativesMatchFiniteDifferences) {
  expect_derivative_matches_finite_difference<ff::Activation::kIdentity>();
  expect_derivative_matches_finite_difference<ff::Activation::kRelu>();
  expect_derivative_matches_finite_difference<ff::Activation::kGelu>();
  expect_derivative_matches_finite_difference<ff::Activation::kGeluTanh>();
  expect_derivative_matches_finite_difference<ff::Activation::kSilu>();
  expect_derivative_matches_finite_difference<ff::Activation::kSigmoid>();
}

// gelu_tanh's float form (z * sigmoid(2y), one exp) and its double form (0.5 z (1 + tanh y)) are one
// function: the float form within a few float ulps of z * sigmoid(2y) in double, forward and
// derivative; the double form within double rounding of it (absolute: 1 + tanh cancels for z << 0).
TEST(AddMulAct, GeluTanhFloatAndDoubleFormsAgree) {
  using G = ff::Act<ff::Activation::kGeluTanh>;
  for (double z = -9.0; z <= 9.0; z += 1.0 / 64) {
    const float zf = static_cast<float>(z);
    const double x = zf, y = G::inner(x);
    const double s = 1 / (1 + std::exp(-2 * y)), f = x * s, d = s + 2 * x * s * (1 - s) * G::dinner(x);
    // exp(-2y) carries y's float rounding times 2|y| (the condition number of exp), in both forms.
    EXPECT_NEAR(G::forward(zf), f, 8 * FLT_EPSILON * std::abs(f) * (1 + 2 * std::abs(y))) << "z=" << z;
    // The derivative's 1 - s loses float bits where s -> 1 (z >> 0): absolute, scaled by |z|^3.
    EXPECT_NEAR(G::derivative(zf), d, 8 * FLT_EPSILON * (std::abs(d) + std::abs(x * x * x))) << "z=" << z;
    EXPECT_NEAR(G::forward(x), f, 8 * DBL_EPSILON * (1 + std::abs(x))) << "z=" << z;
    EXPECT_NEAR(G::derivative(x), d, 8 * DBL_EPSILON * (1 + std::abs(x * x * x))) << "z=" << z;
  }
}

TEST(AddMulAct, ParsesActivationsAndNamesTheBadOne) {
  EXPECT_EQ(ff::parse_activation("gelu_tanh"), ff::Activation::kGeluTanh);
  EXPECT_EQ(ff::parse_activation("relu"), ff::Activation::kRelu);
  fuseforge::testing::expect_error_naming([] { ff::parse_activation("swish"); }, "got 'swish'");
}

TEST(AddMulAct, CpuOpThroughDispatcherMatchesAten) {
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("fuseforge::add_mul_act", "")
                .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, double,
                                  c10::string_view)>();
  at::manual_seed(7);
  const auto x = at::randn({37, 19}, at::kDouble);
  const auto y = at::randn({37, 19}, at::kDouble);
  const auto b = at::randn({19}, at::kDouble);
  const auto out = op.call(x, y, b, 0.3, "silu");
  const auto z = x + 0.3 * y + b;
  const auto expected = z * at::sigmoid(z);
  EXPECT_LT((out - expected).abs().max().item<double>(), 1e-12);
}

TEST(AddMulAct, BackwardBitMaskAndBiasSum) {
  auto fwd = c10::Dispatcher::singleton()
                 .findSchemaOrThrow("fuseforge::add_mul_act_fwd", "")
                 .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                           const std::optional<at::Tensor>&, double, c10::string_view)>();
  auto bwd = c10::Dispatcher::singleton()
                 .findSchemaOrThrow("fuseforge::add_mul_act_bwd", "")
                 .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, double,
                                                                       c10::string_view, bool, bool)>();
  at::manual_seed(11);
  const auto x = at::randn({9, 13}, at::kFloat);  // 13 columns: two mask bytes a row, the second partial
  const auto y = at::randn({9, 13}, at::kFloat);
  auto [out, mask] = fwd.call(x, y, std::nullopt, 1.0, "relu");
  EXPECT_EQ(mask.numel(), 9 * 2);
  const auto g = at::randn({9, 13}, at::kFloat);
  auto [gx, gy, gb] = bwd.call(g, mask, 2.0, "relu", true, true);
  const auto expected_gx = g * (x + y > 0).to(at::kFloat);
  EXPECT_TRUE(at::allclose(gx, expected_gx));
  EXPECT_TRUE(at::allclose(gy, 2.0 * expected_gx));
  EXPECT_TRUE(at::allclose(gb, expected_gx.sum(0), 1e-5, 1e-6));
}
