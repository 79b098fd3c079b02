// add_mul_act on the C++ side: the activation functors against finite differences, the parser's
// errors, and the CPU op through the dispatcher (as any C++ caller would use it).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include <cmath>

#include "common/activation.h"

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

TEST(AddMulAct, ParsesActivationsAndNamesTheBadOne) {
  EXPECT_EQ(ff::parse_activation("gelu_tanh"), ff::Activation::kGeluTanh);
  EXPECT_EQ(ff::parse_activation("relu"), ff::Activation::kRelu);
  try {
    ff::parse_activation("swish");
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("got 'swish'"), std::string::npos) << e.what();
  }
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
