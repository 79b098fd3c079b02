// Instantiates the add_mul_act backward kernels (3 dtypes x 6 activations x {vector, scalar}) and the
// grad_bias reduction.
#include <atomic>

#include "add_mul_act/add_mul_act_kernel.cuh"
#include "common/cuda_utils.h"
#include "common/dispatch.h"

namespace fuseforge::add_mul_act {

template <typename T>
void launch_backward(BackwardParams<T> params, Activation act, const LaunchPlan& plan, bool vectorized,
                     T* grad_bias) {
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
int backward_blocks_per_sm(Activation act, bool vectorized, size_t smem_bytes) {
  // The dynamic shared memory is a function of the device (its cap), so the device index and the
  // kernel are the key.
  static std::atomic<int> cache[kNumActivations][2][kMaxCachedDevices];
  return cached_per_device(cache[static_cast<int>(act)][vectorized], [&] {
    int blocks = 0;
    FUSEFORGE_ACTIVATION_SWITCH(act, kAct, [&] {
      FUSEFORGE_BOOL_SWITCH(vectorized, kVec, [&] {
        C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, backward_kernel<T, kAct, kVec>,
                                                                     kThreads, smem_bytes));
      });
    });
    return blocks;
  });
}

template int backward_blocks_per_sm<float>(Activation, bool, size_t);
template int backward_blocks_per_sm<at::Half>(Activation, bool, size_t);
template int backward_blocks_per_sm<at::BFloat16>(Activation, bool, size_t);

template void launch_backward<float>(BackwardParams<float>, Activation, const LaunchPlan&, bool, float*);
template void launch_backward<at::Half>(BackwardParams<at::Half>, Activation, const LaunchPlan&, bool, at::Half*);
template void launch_backward<at::BFloat16>(BackwardParams<at::BFloat16>, Activation, const LaunchPlan&, bool,
                                            at::BFloat16*);

}  // namespace fuseforge::add_mul_act
