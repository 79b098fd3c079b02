// glu on the C++ side: the CPU ops through the dispatcher (as any C++ caller would use them) against
// ATen, in the separate and fused forms, and the errors of a bad activation and an odd fused dim.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <tuple>

#include "testing.h"

namespace {

auto glu_fwd() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("fuseforge::glu_fwd", "")
      .typed<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view)>();
}

auto glu_bwd() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("fuseforge::glu_bwd", "")
      .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                const std::optional<at::Tensor>&, c10::string_view)>();
}

}  // namespace

TEST(Glu, SwiGluForwardAndBackwardMatchAten) {
  at::manual_seed(3);
  const auto gate = at::randn({5, 7, 19}, at::kDouble);
  const auto up = at::randn({5, 7, 19}, at::kDouble);
  const auto g = at::randn({5, 7, 19}, at::kDouble);
  const auto out = glu_fwd().call(gate, up, "silu");
  const auto sig = at::sigmoid(gate);
  EXPECT_LT((out - gate * sig * up).abs().max().item<double>(), 1e-12);
  auto [grad_gate, grad_up] = glu_bwd().call(g, gate, up, "silu");
  EXPECT_LT((grad_gate - g * up * sig * (1 + gate * (1 - sig))).abs().max().item<double>(), 1e-12);
  EXPECT_LT((grad_up - g * gate * sig).abs().max().item<double>(), 1e-12);
}

TEST(Glu, FusedFormIsTheSeparateFormSideBySide) {
  at::manual_seed(5);
  const auto gate_up = at::randn({9, 2 * 33}, at::kFloat);  // 33: an odd I
  const auto gate = gate_up.slice(1, 0, 33), up = gate_up.slice(1, 33);
  const auto g = at::randn({9, 33}, at::kFloat);
  EXPECT_TRUE(at::equal(glu_fwd().call(gate_up, std::nullopt, "gelu_tanh"), glu_fwd().call(gate, up, "gelu_tanh")));
  auto [grad_fused, empty] = glu_bwd().call(g, gate_up, std::nullopt, "gelu_tanh");
  auto [grad_gate, grad_up] = glu_bwd().call(g, gate, up, "gelu_tanh");
  EXPECT_EQ(grad_fused.sizes(), gate_up.sizes());
  EXPECT_EQ(empty.numel(), 0);
  EXPECT_TRUE(at::equal(grad_fused, at::cat({grad_gate, grad_up}, 1)));
}

TEST(Glu, ErrorsNameTheProblem) {
  const auto t = at::randn({4, 7}, at::kFloat);
  fuseforge::testing::expect_error_naming([&] { glu_fwd().call(t, std::nullopt, "silu"); }, "even last dim");
  fuseforge::testing::expect_error_naming([&] { glu_fwd().call(t, t, "relu"); },
                                          "activation must be one of silu, gelu_tanh, gelu; got 'relu'");
}
