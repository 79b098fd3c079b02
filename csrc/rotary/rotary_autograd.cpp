// rotary's autograd, registered in C++ rather than with torch.library.register_autograd: the op's
// kernels run for tens of microseconds at model shapes, and the Python autograd path adds more than
// that to every forward + backward (argument re-binding, two Python redispatches, a Python backward),
// so a training step's rotary would be paced by the host. The backward is the same op rotating the
// other way (the rotation is orthogonal up to attention_scaling); nothing but inv_freq and
// position_ids is saved.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace fuseforge::rotary {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using RotaryResult = std::tuple<at::Tensor, at::Tensor>;

RotaryResult call_rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& inv_freq,
                         const at::Tensor& position_ids, double attention_scaling, bool interleaved, bool inverse,
                         std::optional<at::ScalarType> out_dtype) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fuseforge::rotary", "")
          .typed<RotaryResult(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                              bool, bool, std::optional<at::ScalarType>)>();
  return op.call(q, k, inv_freq, position_ids, attention_scaling, interleaved, inverse, out_dtype);
}

class RotaryFunction : public torch::autograd::Function<RotaryFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& inv_freq, const at::Tensor& position_ids, double attention_scaling,
                               bool interleaved, bool inverse, std::optional<at::ScalarType> out_dtype) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [q_out, k_out] =
        call_rotary(q, k, inv_freq, position_ids, attention_scaling, interleaved, inverse, out_dtype);
    ctx->save_for_backward({inv_freq, position_ids});
    // A gradient that reaches only one of q_out and k_out is not filled with zeros for the other.
    ctx->set_materialize_grads(false);
    ctx->saved_data["attention_scaling"] = attention_scaling;
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["inverse"] = inverse;
    ctx->saved_data["input_dtype"] = static_cast<int64_t>(q.scalar_type());
    ctx->saved_data["q_shape"] = q.sizes().vec();
    ctx->saved_data["k_shape"] = k.sizes().vec();
    return {q_out, k_out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(8);  // one per forward argument; only q's and k's are defined
    at::Tensor grad_q = grads[0], grad_k = grads[1];
    if (!grad_q.defined() && !grad_k.defined()) return result;
    if (!grad_q.defined()) grad_q = at::zeros(ctx->saved_data["q_shape"].toIntVector(), grad_k.options());
    if (!grad_k.defined()) grad_k = at::zeros(ctx->saved_data["k_shape"].toIntVector(), grad_q.options());
    const auto saved = ctx->get_saved_variables();
    const auto input_dtype = static_cast<at::ScalarType>(ctx->saved_data["input_dtype"].toInt());
    auto [dq, dk] = call_rotary(grad_q, grad_k, saved[0], saved[1], ctx->saved_data["attention_scaling"].toDouble(),
                                ctx->saved_data["interleaved"].toBool(), !ctx->saved_data["inverse"].toBool(),
                                input_dtype);
    if (ctx->needs_input_grad(0)) result[0] = dq;
    if (ctx->needs_input_grad(1)) result[1] = dk;
    return result;
  }
};

RotaryResult rotary_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& inv_freq,
                             const at::Tensor& position_ids, double attention_scaling, bool interleaved, bool inverse,
                             std::optional<at::ScalarType> out_dtype) {
  auto outs = RotaryFunction::apply(q, k, inv_freq, position_ids, attention_scaling, interleaved, inverse, out_dtype);
  return {outs[0], outs[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(fuseforge, Autograd, m) { m.impl("rotary", &rotary_autograd); }

}  // namespace fuseforge::rotary
