// rms_norm CUDA implementation, host side: device guard, kernel parameters, the weight gradient's
// partials, launches. No host sync. Compiled by the C++ compiler, not nvcc (CONTRIBUTING.md, Layout).
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
  p.residual_out = a.residual.defined() ? o.residual_out.mutable_data_ptr<T>() : nullptr;
  p.out = o.out.mutable_data_ptr();
  p.rstd = o.rstd.defined() ? o.rstd.mutable_data_ptr<float>() : nullptr;
  p.rows = a.rows;
  p.cols = a.cols;
  p.eps = static_cast<float>(a.eps);
  p.weight_offset = static_cast<float>(a.weight_offset);
  p.weight_dtype = a.weight.defined() ? dtype_of(a.weight.scalar_type()) : Dtype::kFloat;
  p.out_dtype = dtype_of(a.out_dtype);
  const bool aligned = aligned16(a.x) && aligned16(a.residual) && aligned16(a.weight) && aligned16(o.out) &&
                       (!a.residual.defined() || aligned16(o.residual_out));
  launch_forward<T>(p, plan_forward<T>(a.rows, a.cols, aligned));
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
  p.rstd = a.rstd.const_data_ptr<float>();
  p.grad_input = g.grad_input.mutable_data_ptr<T>();
  p.rows = a.rows;
  p.cols = a.cols;
  p.weight_offset = static_cast<float>(a.weight_offset);
  p.weight_dtype = a.weight.defined() ? dtype_of(a.weight.scalar_type()) : Dtype::kFloat;
  p.out_dtype = dtype_of(a.grad_out.scalar_type());
  const bool aligned = aligned16(a.grad_out) && aligned16(a.grad_residual_out) && aligned16(a.h) &&
                       aligned16(a.weight) && aligned16(g.grad_input);
  const LaunchPlan plan = plan_backward<T>(a.rows, a.cols, aligned);
  at::Tensor partials;
  if (a.need_grad_weight) {
    // One fp32 row a block. The rows kernels write every column of theirs; the two-pass kernels add
    // into theirs.
    const auto options = a.h.options().dtype(at::kFloat);
    const int64_t blocks = plan.grid.x;
    partials = plan.row_shape >= 0 ? at::empty({blocks, a.cols}, options) : at::zeros({blocks, a.cols}, options);
    p.weight_partials = partials.mutable_data_ptr<float>();
  }
  launch_backward<T>(p, plan, a.need_grad_weight ? g.grad_weight.mutable_data_ptr() : nullptr);
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
}

}  // namespace fuseforge::rms_norm
