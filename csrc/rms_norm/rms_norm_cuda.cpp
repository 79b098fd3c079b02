// rms_norm and layer_norm CUDA implementation, host side: device guard, kernel parameters, the weight
// (and bias) gradient's partials, launches. No host sync. Compiled by the C++ compiler, not nvcc (CONTRIBUTING.md, Layout).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common/dispatch.h"
#include "common/vec.cuh"
#include "rms_norm/rms_norm.h"
#include "rms_norm/rms_norm_launch.h"

namespace fuseforge::rms_norm {
namespace {

bool aligned16(const at::Tensor& t) { return !t.defined() || is_aligned(t.const_data_ptr(), 16); }

const void* data_or_null(const at::Tensor& t) { return t.defined() ? t.const_data_ptr() : nullptr; }

template <typename T>
const T* typed_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

template <typename T>
void forward_cuda(const ForwardArgs& a, ForwardOutputs& o) {
  ForwardParams<T> p{};
  p.x = a.x.const_data_ptr<T>();
  p.residual = typed_or_null<T>(a.residual);
  p.weight = data_or_null(a.weight);
  p.bias = data_or_null(a.bias);
  p.residual_out = a.residual.defined() ? o.residual_out.mutable_data_ptr<T>() : nullptr;
  p.out = o.out.mutable_data_ptr();
  p.mean = o.mean.defined() ? o.mean.mutable_data_ptr<float>() : nullptr;
  p.rstd = o.rstd.defined() ? o.rstd.mutable_data_ptr<float>() : nullptr;
  p.rows = a.rows;
  p.cols = a.cols;
  p.eps = static_cast<float>(a.eps);
  p.weight_offset = static_cast<float>(a.weight_offset);
  p.weight_dtype = a.weight.defined() ? dtype_of(a.weight.scalar_type()) : Dtype::kFloat;
  p.bias_dtype = a.bias.defined() ? dtype_of(a.bias.scalar_type()) : Dtype::kFloat;
  p.out_dtype = dtype_of(a.out_dtype);
  const bool aligned = aligned16(a.x) && aligned16(a.residual) && aligned16(a.weight) && aligned16(a.bias) &&
                       aligned16(o.out) && (!a.residual.defined() || aligned16(o.residual_out));
  if (a.centered) {
    launch_forward<T, true>(p, plan_forward<T, true>(a.rows, a.cols, aligned, a.residual.defined()));
  } else {
    launch_forward<T, false>(p, plan_forward<T, false>(a.rows, a.cols, aligned, a.residual.defined()));
  }
}

void forward_dispatch(const ForwardArgs& a, ForwardOutputs& o) {
  const c10::cuda::CUDAGuard guard(a.x.device());
  FUSEFORGE_DISPATCH_HALF_FLOAT(a.x.scalar_type(), "rms_norm_fwd_cuda", [&] { forward_cuda<scalar_t>(a, o); });
}

template <typename T>
void backward_cuda(const BackwardArgs& a, Gradients& g) {
  BackwardParams<T> p{};
  p.grad_out = a.grad_out.const_data_ptr();
  p.grad_residual_out = typed_or_null<T>(a.grad_residual_out);
  p.h = a.h.const_data_ptr<T>();
  p.weight = data_or_null(a.weight);
  p.mean = a.centered ? a.mean.const_data_ptr<float>() : nullptr;
  p.rstd = a.rstd.const_data_ptr<float>();
  p.grad_input = g.grad_input.mutable_data_ptr<T>();
  p.rows = a.rows;
  p.cols = a.cols;
  p.weight_offset = static_cast<float>(a.weight_offset);
  p.weight_dtype = a.weight.defined() ? dtype_of(a.weight.scalar_type()) : Dtype::kFloat;
  p.out_dtype = dtype_of(a.grad_out.scalar_type());
  const bool aligned = aligned16(a.grad_out) && aligned16(a.grad_residual_out) && aligned16(a.h) &&
                       aligned16(a.weight) && aligned16(g.grad_input);
  const LaunchPlan plan =
      a.centered ? plan_backward<T, true>(a.rows, a.cols, aligned) : plan_backward<T, false>(a.rows, a.cols, aligned);
  // One fp32 row a block for each sum wanted (the weight's, then the bias's), in one allocation. The rows
  // kernels write every column of theirs; the two-pass kernels add into theirs.
  const int64_t blocks = plan.grid.x;
  const int64_t sums = static_cast<int64_t>(a.need_grad_weight) + static_cast<int64_t>(a.need_grad_bias());
  at::Tensor partials;
  if (sums > 0) {
    const auto options = a.h.options().dtype(at::kFloat);
    partials = plan.row_shape >= 0 ? at::empty({sums * blocks, a.cols}, options)
                                   : at::zeros({sums * blocks, a.cols}, options);
    float* next = partials.mutable_data_ptr<float>();
    if (a.need_grad_weight) {
      p.weight_partials = next;
      next += blocks * a.cols;
    }
    if (a.need_grad_bias()) p.bias_partials = next;
  }
  void* grad_weight = a.need_grad_weight ? g.grad_weight.mutable_data_ptr() : nullptr;
  void* grad_bias = a.need_grad_bias() ? g.grad_bias.mutable_data_ptr() : nullptr;
  p.bias_dtype = dtype_of(a.grad_bias_dtype.value_or(at::kFloat));
  if (a.centered) {
    launch_backward<T, true>(p, plan, grad_weight, grad_bias);
  } else {
    launch_backward<T, false>(p, plan, grad_weight, grad_bias);
  }
}

void backward_dispatch(const BackwardArgs& a, Gradients& g) {
  const c10::cuda::CUDAGuard guard(a.h.device());
  FUSEFORGE_DISPATCH_HALF_FLOAT(a.h.scalar_type(), "rms_norm_bwd_cuda", [&] { backward_cuda<scalar_t>(a, g); });
}

}  // namespace

TORCH_LIBRARY_IMPL(fuseforge, CUDA, m) {
  // No float64 kernels on the GPU (the error says it is CPU-only).
  m.impl("rms_norm_fwd", &rms_norm_fwd_op<forward_dispatch, false>);
  m.impl("rms_norm", &rms_norm_op<forward_dispatch, false>);
  m.impl("rms_norm_bwd", &rms_norm_bwd_op<backward_dispatch, false>);
  m.impl("layer_norm_fwd", &layer_norm_fwd_op<forward_dispatch, false>);
  m.impl("layer_norm", &layer_norm_op<forward_dispatch, false>);
  m.impl("layer_norm_bwd", &layer_norm_bwd_op<backward_dispatch, false>);
}

}  // namespace fuseforge::rms_norm
