// rms_norm on the C++ side: the CPU ops through the dispatcher (as any C++ caller would use them)
// against ATen, and an input error.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <tuple>

#include "testing.h"

namespace {

using FwdOp = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const std::optional<at::Tensor>&,
                                                             const std::optional<at::Tensor>&, double, double,
                                                             std::optional<at::ScalarType>);
using BwdOp = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const std::optional<at::Tensor>&,
                                                 const at::Tensor&, const std::optional<at::Tensor>&,
                                                 const at::Tensor&, double, bool);

c10::TypedOperatorHandle<FwdOp> fwd_op() {
  return c10::Dispatcher::singleton().findSchemaOrThrow("fuseforge::rms_norm_fwd", "").typed<FwdOp>();
}

}  // namespace

TEST(RmsNorm, GemmaForwardWithResidualMatchesAten) {
  at::manual_seed(5);
  const auto x = at::randn({6, 5, 33}, at::kDouble);
  const auto r = at::randn({6, 5, 33}, at::kDouble);
  const auto w = at::randn({33}, at::kDouble);
  auto [out, h, rstd] = fwd_op().call(x, w, r, 1e-5, 1.0, std::nullopt);
  const auto h_ref = x + r;
  const auto rstd_ref = at::rsqrt(h_ref.pow(2).mean(-1, true) + 1e-5);
  EXPECT_LT((h - h_ref).abs().max().item<double>(), 1e-15);
  EXPECT_LT((rstd - rstd_ref.reshape({30})).abs().max().item<double>(), 1e-12);
  EXPECT_LT((out - h_ref * rstd_ref * (1.0 + w)).abs().max().item<double>(), 1e-12);
}

TEST(RmsNorm, ForwardWithoutRstdMatchesTrainingForward) {
  using Op = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const std::optional<at::Tensor>&,
                                                const std::optional<at::Tensor>&, double, double,
                                                std::optional<at::ScalarType>);
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow("fuseforge::rms_norm", "").typed<Op>();
  at::manual_seed(6);
  const auto x = at::randn({9, 300});
  const auto r = at::randn({9, 300});
  const auto w = at::randn({300});
  auto [out, h] = op.call(x, w, r, 1e-6, 0.0, at::kBFloat16);
  auto [out_fwd, h_fwd, rstd] = fwd_op().call(x, w, r, 1e-6, 0.0, at::kBFloat16);
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(out, out_fwd));
  EXPECT_TRUE(at::equal(h, h_fwd));
}

TEST(RmsNorm, BackwardMatchesAutograd) {
  auto bwd = c10::Dispatcher::singleton().findSchemaOrThrow("fuseforge::rms_norm_bwd", "").typed<BwdOp>();
  at::manual_seed(9);
  const auto x = at::randn({7, 19}, at::kDouble).requires_grad_();
  const auto w = at::randn({19}, at::kDouble).requires_grad_();
  const auto g = at::randn({7, 19}, at::kDouble);
  const auto ref = x * at::rsqrt(x.pow(2).mean(-1, true) + 1e-6) * w;
  ref.backward(g);
  auto [out, h, rstd] = fwd_op().call(x.detach(), w.detach(), std::nullopt, 1e-6, 0.0, std::nullopt);
  EXPECT_EQ(h.numel(), 0);  // no residual: the caller keeps x
  auto [gx, gw] = bwd.call(g, std::nullopt, x.detach(), w.detach(), rstd, 0.0, true);
  EXPECT_LT((gx - x.grad()).abs().max().item<double>(), 1e-12);
  EXPECT_LT((gw - w.grad()).abs().max().item<double>(), 1e-12);
}

TEST(RmsNorm, WrongWeightShapeNamesTheArgument) {
  const auto x = at::randn({4, 8});
  fuseforge::testing::expect_error_naming(
      [&] { fwd_op().call(x, at::randn({5}), std::nullopt, 1e-6, 0.0, std::nullopt); }, "weight must have shape (8,)");
}

TEST(LayerNorm, ForwardAndBackwardMatchAten) {
  using LnFwdOp = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
      const std::optional<at::Tensor>&, double, std::optional<at::ScalarType>);
  using LnBwdOp = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const std::optional<at::Tensor>&,
      const at::Tensor&, const at::Tensor&, bool, std::optional<at::ScalarType>);
  auto& dispatcher = c10::Dispatcher::singleton();
  auto fwd = dispatcher.findSchemaOrThrow("fuseforge::layer_norm_fwd", "").typed<LnFwdOp>();
  auto bwd = dispatcher.findSchemaOrThrow("fuseforge::layer_norm_bwd", "").typed<LnBwdOp>();
  at::manual_seed(11);
  const auto x = (at::randn({7, 37}, at::kDouble) + 3.0).requires_grad_();
  const auto w = at::randn({37}, at::kDouble).requires_grad_();
  const auto b = at::randn({37}, at::kDouble).requires_grad_();
  const auto g = at::randn({7, 37}, at::kDouble);
  const auto ref = at::layer_norm(x, {37}, w, b, 1e-5);
  ref.backward(g);
  auto [out, h, mean, rstd] = fwd.call(x.detach(), w.detach(), b.detach(), std::nullopt, 1e-5, std::nullopt);
  EXPECT_LT((out - ref.detach()).abs().max().item<double>(), 1e-12);
  EXPECT_LT((mean - x.detach().mean(-1)).abs().max().item<double>(), 1e-12);
  auto [gx, gw, gb] = bwd.call(g, std::nullopt, x.detach(), w.detach(), mean, rstd, true, at::kDouble);
  EXPECT_EQ(gb.scalar_type(), at::kDouble);
  EXPECT_LT((gx - x.grad()).abs().max().item<double>(), 1e-12);
  EXPECT_LT((gw - w.grad()).abs().max().item<double>(), 1e-12);
  EXPECT_LT((gb - b.grad()).abs().max().item<double>(), 1e-12);
  fuseforge::testing::expect_error_naming(
      [&] { fwd.call(x.detach(), w.detach(), at::randn({5}, at::kDouble), std::nullopt, 1e-5, std::nullopt); },
      "bias must have shape (37,)");
}
