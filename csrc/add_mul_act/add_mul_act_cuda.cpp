// add_mul_act CUDA implementation, host side: checks, device guard, allocation, launches. No host
// sync. Compiled by the C++ compiler, not nvcc (errors thrown from here unwind through C++ frames
// only; CONTRIBUTING.md, Layout).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "add_mul_act/add_mul_act_launch.h"
#include "add_mul_act/add_mul_act_ops.h"
#include "common/checks.h"
#include "common/dispatch.h"
#include "common/env.h"
#include "common/vec.cuh"

namespace fuseforge::add_mul_act {
namespace {

bool aligned16(const void* p) { return p == nullptr || is_aligned(p, 16); }

// Resident blocks an SM (0: as many as registers allow). float32 kernels run at 1 block (8 warps) an
// SM: at 3 blocks the backward (two tensors written for each one read) stalled at 2.2 TB/s, warps
// waiting on the load/store queue (ncu). On the H100 the cap took fp32 fwdbwd relu 1.297 -> 1.151 ms,
// gelu 1.81 -> 1.671, silu 1.74 -> 1.665 (the forward's cap adds gelu's 1.742 -> 1.671 when it saves z);
// for bf16 it cost 3-18%, so 16-bit types run uncapped (docs/design/add_mul_act.md). The one
// exception: erf-GELU's float32 forward that saves nothing (inference, or no grad) is bound by its
// arithmetic and runs at 2 blocks an SM (H200, 16384 x 8192: 0.376 against 0.424 ms; ReLU and SiLU
// lost 1-4% at 2, and with z saved 2 blocks cost forward+backward 7%). Development knobs
// FUSEFORGE_AMA_{FWD,BWD}_BLOCKS_PER_SM override it (a large value: no cap).
int64_t blocks_per_sm_cap(bool backward, size_t type_bytes, Activation act, bool saves) {
  static const int64_t fwd_knob = dev_positive_int("FUSEFORGE_AMA_FWD_BLOCKS_PER_SM", 0);
  static const int64_t bwd_knob = dev_positive_int("FUSEFORGE_AMA_BWD_BLOCKS_PER_SM", 0);
  const int64_t knob = backward ? bwd_knob : fwd_knob;
  if (knob > 0) return knob;
  if (type_bytes < 4) return 0;
  return !backward && !saves && act == Activation::kGelu ? 2 : 1;
}

template <typename T>
void forward_cuda(const ForwardArgs& a, double alpha, at::Tensor& out, at::Tensor* saved) {
  ForwardParams<T> p{};
  p.x = a.x.const_data_ptr<T>();
  p.y = a.y.const_data_ptr<T>();
  p.bias = a.bias.defined() ? a.bias.const_data_ptr<T>() : nullptr;
  p.out = out.mutable_data_ptr<T>();
  p.saved_z = (saved && !saves_mask(a.act)) ? saved->mutable_data_ptr<T>() : nullptr;
  p.saved_mask = (saved && saves_mask(a.act)) ? saved->mutable_data_ptr<uint8_t>() : nullptr;
  p.alpha = static_cast<float>(alpha);
  p.rows = a.shape.rows;
  p.cols = a.shape.cols;
  p.groups_per_row = a.shape.mask_row_bytes();
  const bool vec = a.shape.cols % kGroup == 0 && aligned16(p.x) && aligned16(p.y) && aligned16(p.bias) &&
                   aligned16(p.out) && aligned16(p.saved_z);
  LaunchPlan plan = plan_launch(a.shape, /*bias_blocks_per_sm=*/0);
  plan.smem_bytes = smem_capping_blocks_per_sm(blocks_per_sm_cap(false, sizeof(T), a.act, saved != nullptr), 0);
  launch_forward<T>(p, a.act, plan, vec);
}

void forward_dispatch(const ForwardArgs& a, double alpha, at::Tensor& out, at::Tensor* saved) {
  const c10::cuda::CUDAGuard guard(a.x.device());
  FUSEFORGE_DISPATCH_HALF_FLOAT(a.x.scalar_type(), "add_mul_act_cuda",
                                [&] { forward_cuda<scalar_t>(a, alpha, out, saved); });
}

template <typename T>
void backward_cuda(const BackwardArgs& a, double alpha, Gradients& g) {
  BackwardParams<T> p{};
  p.grad_out = a.grad_out.const_data_ptr<T>();
  p.saved_z = saves_mask(a.act) ? nullptr : a.saved.const_data_ptr<T>();
  p.saved_mask = saves_mask(a.act) ? a.saved.const_data_ptr<uint8_t>() : nullptr;
  p.grad_x = g.grad_x.mutable_data_ptr<T>();
  p.grad_y = g.grad_y.numel() ? g.grad_y.mutable_data_ptr<T>() : nullptr;
  p.alpha = static_cast<float>(alpha);
  p.rows = a.shape.rows;
  p.cols = a.shape.cols;
  p.groups_per_row = a.shape.mask_row_bytes();
  const bool vec = a.shape.cols % kGroup == 0 && aligned16(p.grad_out) && aligned16(p.saved_z) &&
                   aligned16(p.grad_x) && aligned16(p.grad_y);
  const bool reduce_bias = g.grad_bias.numel() > 0;
  const size_t smem = smem_capping_blocks_per_sm(blocks_per_sm_cap(true, sizeof(T), a.act, false), kBackwardStaticSmem);
  // One wave (measured against the former plan of 8 blocks an SM, i.e. 2-3 waves: bf16 relu fwd+bwd
  // 0.5929 -> 0.5846 ms, gelu 0.7684 -> 0.7561, fp32 relu 1.139 -> 1.128).
  const int64_t resident = reduce_bias ? backward_blocks_per_sm<T>(a.act, vec, smem) : 0;
  LaunchPlan plan = plan_launch(a.shape, resident);
  plan.smem_bytes = smem;
  at::Tensor partials;
  if (reduce_bias) {
    partials = at::empty({static_cast<int64_t>(plan.grid.y), a.shape.cols}, a.grad_out.options().dtype(at::kFloat));
    p.bias_partials = partials.mutable_data_ptr<float>();
  }
  launch_backward<T>(p, a.act, plan, vec, reduce_bias ? g.grad_bias.mutable_data_ptr<T>() : nullptr);
  if (reduce_bias && a.shape.rows == 0) g.grad_bias.zero_();
}

void backward_dispatch(const BackwardArgs& a, double alpha, Gradients& g) {
  const c10::cuda::CUDAGuard guard(a.grad_out.device());
  FUSEFORGE_DISPATCH_HALF_FLOAT(a.grad_out.scalar_type(), "add_mul_act_bwd_cuda",
                                [&] { backward_cuda<scalar_t>(a, alpha, g); });
}

}  // namespace

TORCH_LIBRARY_IMPL(fuseforge, CUDA, m) {
  // No float64 kernels on the GPU (the error says it is CPU-only).
  m.impl("add_mul_act", &add_mul_act_op<forward_dispatch, false>);
  m.impl("add_mul_act_fwd", &add_mul_act_fwd_op<forward_dispatch, false>);
  m.impl("add_mul_act_bwd", &add_mul_act_bwd_op<backward_dispatch, false>);
  m.impl("add_mul_act_", &add_mul_act_inplace_op<forward_dispatch, false>);
}

}  // namespace fuseforge::add_mul_act
