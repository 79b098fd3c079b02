// Instantiates the add_mul_act backward kernels (3 dtypes x 6 activations x {vector, scalar}) and the
// grad_bias reduction.
#include <atomic>

#include "add_mul_act/add_mul_act_kernel.cuh"
#include "common/dispatch.h"

namespace fuseforge::add_mul_act {

template <typename T>
void launch_backward(BackwardParams<T> params, Activation act, const LaunchPlan& plan, bool vectorized,
                     T* grad_bias) {
  params.rows_per_block = plan.rows_per_block;
  FUSEFORGE_ACTIVATION_SWITCH(act, kAct, [&] {
    FUSEFORGE_BOOL_SWITCH(vectorized, kVec, [&] {
      launch_kernel(backward_kernel<T, kAct, kVec>, plan.grid, plan.block, plan.smem_bytes, params);
    });
  });
  if (params.bias_partials != nullptr && plan.grid.y > 0) {
    launch_kernel(bias_grad_finalize_kernel<T>, dim3(ceil_div(params.cols, kFinalizeCols)),
                  dim3(kFinalizeCols, kFinalizeSlices), 0, params.bias_partials, static_cast<int64_t>(plan.grid.y),
                  params.cols, grad_bias);
  }
}

template <typename T>
int backward_resident_blocks(Activation act, bool vectorized) {
  // (activation, vectorized) -> blocks; one device type per process is assumed.
  static std::atomic<int> cache[kNumActivations][2] = {};
  std::atomic<int>& cached = cache[static_cast<int>(act)][vectorized ? 1 : 0];
  int blocks = cached.load(std::memory_order_relaxed);
  if (blocks == 0) {
    FUSEFORGE_ACTIVATION_SWITCH(act, kAct, [&] {
      FUSEFORGE_BOOL_SWITCH(vectorized, kVec, [&] {
        C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, backward_kernel<T, kAct, kVec>,
                                                                     kThreads, 0));
      });
    });
    blocks = blocks > 0 ? blocks : 1;
    cached.store(blocks, std::memory_order_relaxed);
  }
  return blocks;
}

template void launch_backward<float>(BackwardParams<float>, Activation, const LaunchPlan&, bool, float*);
template void launch_backward<at::Half>(BackwardParams<at::Half>, Activation, const LaunchPlan&, bool, at::Half*);
template void launch_backward<at::BFloat16>(BackwardParams<at::BFloat16>, Activation, const LaunchPlan&, bool,
                                            at::BFloat16*);
template int backward_resident_blocks<float>(Activation, bool);
template int backward_resident_blocks<at::Half>(Activation, bool);
template int backward_resident_blocks<at::BFloat16>(Activation, bool);

}  // namespace fuseforge::add_mul_act
