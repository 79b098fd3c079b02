// glu CUDA implementation, host side: device guard, the vector-path decision, the grid, launches.
// No host sync. Compiled by the C++ compiler, not nvcc (CONTRIBUTING.md, Layout).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common/dispatch.h"
#include "common/env.h"
#include "common/vec.cuh"
#include "glu/glu.h"
#include "glu/glu_launch.h"

namespace fuseforge::glu {
namespace {

// Whether a row matrix takes 16-byte accesses: its pointer aligned and its row stride a whole
// number of vectors (cols is checked by the caller).
template <typename T>
bool vector_ready(const void* data, int64_t row_stride) {
  return is_aligned(data, 16) && row_stride % elems_per_thread<T>() == 0;
}

// Row trips a block makes: one, for every activation (H200, 16384 x 8192 bf16 tanh-GELU: forward
// 0.1855 ms against 0.1874 at two, forward+backward 0.4955 against 0.5006; docs/design/glu.md,
// Tried). Development knob FUSEFORGE_GLU_TRIPS_PER_BLOCK.
int64_t trips_per_block() {
  static const int64_t forced = dev_positive_int("FUSEFORGE_GLU_TRIPS_PER_BLOCK", 0);
  return forced > 0 ? forced : 1;
}

template <typename T>
void forward_cuda(const ForwardArgs& a, at::Tensor& out) {
  ForwardParams<T> p{};
  p.gate = static_cast<const T*>(a.gate.data);
  p.up = static_cast<const T*>(a.up.data);
  p.out = out.mutable_data_ptr<T>();
  p.gate_row_stride = a.gate.row_stride;
  p.up_row_stride = a.up.row_stride;
  p.rows = a.rows;
  p.cols = a.cols;
  const bool vec = a.cols % elems_per_thread<T>() == 0 && vector_ready<T>(p.gate, p.gate_row_stride) &&
                   vector_ready<T>(p.up, p.up_row_stride) && vector_ready<T>(p.out, p.cols);
  const LaunchPlan plan =
      plan_launch(a.rows, a.cols, elems_per_thread<T>(), forward_rows_per_trip(), trips_per_block());
  p.rows_per_block = plan.rows_per_block;
  launch_forward<T>(p, a.act, plan, vec);
}

void forward_dispatch(const ForwardArgs& a, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(out.device());
  FUSEFORGE_DISPATCH_HALF_FLOAT(out.scalar_type(), "glu_fwd_cuda", [&] { forward_cuda<scalar_t>(a, out); });
}

template <typename T>
void backward_cuda(const BackwardArgs& a, Gradients& g) {
  BackwardParams<T> p{};
  p.grad_out = static_cast<const T*>(a.grad_out.data);
  p.gate = static_cast<const T*>(a.gate.data);
  p.up = static_cast<const T*>(a.up.data);
  p.grad_gate = static_cast<T*>(g.gate_data);
  p.grad_up = static_cast<T*>(g.up_data);
  p.grad_out_row_stride = a.grad_out.row_stride;
  p.gate_row_stride = a.gate.row_stride;
  p.up_row_stride = a.up.row_stride;
  p.grad_gate_row_stride = g.gate_row_stride;
  p.grad_up_row_stride = g.up_row_stride;
  p.rows = a.rows;
  p.cols = a.cols;
  const bool vec = a.cols % elems_per_thread<T>() == 0 && vector_ready<T>(p.grad_out, p.grad_out_row_stride) &&
                   vector_ready<T>(p.gate, p.gate_row_stride) && vector_ready<T>(p.up, p.up_row_stride) &&
                   vector_ready<T>(p.grad_gate, p.grad_gate_row_stride) &&
                   vector_ready<T>(p.grad_up, p.grad_up_row_stride);
  const LaunchPlan plan =
      plan_launch(a.rows, a.cols, elems_per_thread<T>(), backward_rows_per_trip(), trips_per_block());
  p.rows_per_block = plan.rows_per_block;
  launch_backward<T>(p, a.act, plan, vec);
}

void backward_dispatch(const BackwardArgs& a, Gradients& g) {
  const c10::cuda::CUDAGuard guard(g.grad_gate.device());
  FUSEFORGE_DISPATCH_HALF_FLOAT(g.grad_gate.scalar_type(), "glu_bwd_cuda", [&] { backward_cuda<scalar_t>(a, g); });
}

}  // namespace

TORCH_LIBRARY_IMPL(fuseforge, CUDA, m) {
  // No float64 kernels on the GPU (the error says it is CPU-only).
  m.impl("glu_fwd", &glu_fwd_op<forward_dispatch, false>);
  m.impl("glu_bwd", &glu_bwd_op<backward_dispatch, false>);
}

}  // namespace fuseforge::glu
