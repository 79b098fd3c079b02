// glu: input checks and the CPU implementation (the reference the CUDA kernels must match; float64
// serves gradcheck). Each element is one act(gate) * up in the math type (float; double for
// float64), rounded once, the same formula and order as the CUDA kernels; the CPU kernels are
// vectorized per ISA in glu_cpu_kernel.h.
#include "glu/glu.h"
#include "glu/glu_cpu.h"

#include <torch/library.h>

#include <string>

#include "common/checks.h"
#include "common/cpu_isa.h"
#include "common/not_differentiable.h"

namespace fuseforge::glu {

Activation parse_glu_activation(c10::string_view name) {
  const std::optional<Activation> act = activation_from_name(name);
  const bool built = act == Activation::kSilu || act == Activation::kGeluTanh || act == Activation::kGelu;
  TORCH_CHECK(built, "activation must be one of silu, gelu_tanh, gelu; got '", std::string(name.data(), name.size()),
              "'");
  return *act;
}

namespace {

// t's rows (every dim but the last) as one stride when they are equally spaced, else a
// contiguous copy: views such as gate_up[..., :I] are read in place.
RowMatrix as_row_matrix(const at::Tensor& t) {
  const int64_t cols = t.size(-1);
  bool uniform = cols <= 1 || t.stride(-1) == 1;
  int64_t row_stride = -1, next_stride = 0;  // next_stride: what the next outer dim's stride must be
  for (int64_t d = t.dim() - 2; uniform && d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (row_stride < 0) {
      row_stride = t.stride(d);
    } else if (t.stride(d) != next_stride) {
      uniform = false;
    }
    next_stride = t.stride(d) * t.size(d);
  }
  RowMatrix m;
  m.owner = uniform ? t : t.contiguous();
  m.data = m.owner.const_data_ptr();
  m.row_stride = uniform && row_stride >= 0 ? row_stride : cols;
  return m;
}

RowMatrix offset_columns(const RowMatrix& m, int64_t cols) {
  RowMatrix shifted = m;
  shifted.data = static_cast<const char*>(m.data) + cols * m.owner.element_size();
  return shifted;
}

struct Problem {
  int64_t rows = 0, cols = 0;
  std::vector<int64_t> out_shape;
};

// The checks of both schemas on gate and up, and the problem they describe.
Problem check_gate_up(const at::Tensor& gate, const std::optional<at::Tensor>& up, bool allow_double) {
  check_dtype_supported(gate, "gate", allow_double);
  TORCH_CHECK(gate.dim() >= 1, "gate must have at least one dimension, got a 0-dim tensor");
  Problem p;
  p.out_shape = gate.sizes().vec();
  if (up.has_value()) {
    check_same_device(gate, "gate", *up, "up");
    check_same_dtype(gate, "gate", *up, "up");
    check_same_shape(gate, "gate", *up, "up");
    p.cols = gate.size(-1);
  } else {
    TORCH_CHECK(gate.size(-1) % 2 == 0,
                "gate without up must be the fused projection (..., 2 * I) = [gate | up] with an even last dim, "
                "got shape ",
                gate.sizes());
    p.cols = gate.size(-1) / 2;
    p.out_shape.back() = p.cols;
  }
  p.rows = 1;
  for (int64_t d = 0; d + 1 < gate.dim(); ++d) p.rows *= gate.size(d);
  return p;
}

}  // namespace

ForwardArgs prepare_forward(const at::Tensor& gate, const std::optional<at::Tensor>& up, c10::string_view activation,
                            bool allow_double) {
  ForwardArgs a;
  a.act = parse_glu_activation(activation);
  Problem p = check_gate_up(gate, up, allow_double);
  a.rows = p.rows;
  a.cols = p.cols;
  a.out_shape = std::move(p.out_shape);
  a.options = gate.options();
  a.gate = as_row_matrix(gate);
  a.up = up.has_value() ? as_row_matrix(*up) : offset_columns(a.gate, a.cols);
  return a;
}

BackwardArgs prepare_backward(const at::Tensor& grad_out, const at::Tensor& gate, const std::optional<at::Tensor>& up,
                              c10::string_view activation, bool allow_double) {
  BackwardArgs a;
  a.act = parse_glu_activation(activation);
  const Problem p = check_gate_up(gate, up, allow_double);
  check_same_device(gate, "gate", grad_out, "grad_out");
  check_same_dtype(gate, "gate", grad_out, "grad_out");
  TORCH_CHECK(grad_out.sizes() == at::IntArrayRef(p.out_shape), "grad_out must have the output's shape ",
              at::IntArrayRef(p.out_shape), ", got ", grad_out.sizes());
  a.rows = p.rows;
  a.cols = p.cols;
  a.fused = !up.has_value();
  a.grad_out = as_row_matrix(grad_out);
  a.gate = as_row_matrix(gate);
  a.up = up.has_value() ? as_row_matrix(*up) : offset_columns(a.gate, a.cols);
  return a;
}

Gradients allocate_gradients(const BackwardArgs& a, const at::Tensor& gate, const std::optional<at::Tensor>& up) {
  Gradients g;
  g.grad_gate = at::empty(gate.sizes(), gate.options());
  g.gate_data = g.grad_gate.mutable_data_ptr();
  if (a.fused) {  // one (..., 2I) tensor: [grad_gate | grad_up] a row
    g.grad_up = at::empty({0}, gate.options());
    g.up_data = static_cast<char*>(g.gate_data) + a.cols * gate.element_size();
    g.gate_row_stride = g.up_row_stride = 2 * a.cols;
  } else {
    g.grad_up = at::empty(up->sizes(), up->options());
    g.up_data = g.grad_up.mutable_data_ptr();
    g.gate_row_stride = g.up_row_stride = a.cols;
  }
  return g;
}

namespace {

// The kernels are vectorized and built per CPU ISA (glu_cpu_kernel.h, common/cpu_isa.h).
void forward_cpu(const ForwardArgs& a, at::Tensor& out) {
  CpuForwardArgs k{};
  k.gate = a.gate.data;
  k.up = a.up.data;
  k.gate_row_stride = a.gate.row_stride;
  k.up_row_stride = a.up.row_stride;
  k.out = out.mutable_data_ptr();
  k.rows = a.rows;
  k.cols = a.cols;
  k.act = a.act;
  k.dtype = out.scalar_type();
  FUSEFORGE_CPU_ISA_CALL(forward, k);
}

void backward_cpu(const BackwardArgs& a, Gradients& g) {
  CpuBackwardArgs k{};
  k.grad_out = a.grad_out.data;
  k.gate = a.gate.data;
  k.up = a.up.data;
  k.grad_out_row_stride = a.grad_out.row_stride;
  k.gate_row_stride = a.gate.row_stride;
  k.up_row_stride = a.up.row_stride;
  k.grad_gate = g.gate_data;
  k.grad_up = g.up_data;
  k.grad_gate_row_stride = g.gate_row_stride;
  k.grad_up_row_stride = g.up_row_stride;
  k.rows = a.rows;
  k.cols = a.cols;
  k.act = a.act;
  k.dtype = g.grad_gate.scalar_type();
  FUSEFORGE_CPU_ISA_CALL(backward, k);
}

}  // namespace

TORCH_LIBRARY_IMPL(fuseforge, CPU, m) {
  // float64 is allowed on the CPU (gradcheck).
  m.impl("glu_fwd", &glu_fwd_op<forward_cpu, true>);
  m.impl("glu_bwd", &glu_bwd_op<backward_cpu, true>);
}

// The backward ops have no backward of their own (common/not_differentiable.h).
TORCH_LIBRARY_IMPL(fuseforge, Autograd, m) {
  m.impl("glu_bwd", fuseforge::not_differentiable());
}

}  // namespace fuseforge::glu
