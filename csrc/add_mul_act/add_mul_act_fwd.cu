// Instantiates the add_mul_act forward kernels: 3 dtypes x 6 activations x {vector, scalar}.
#include "add_mul_act/add_mul_act_kernel.cuh"
#include "common/dispatch.h"

namespace fuseforge::add_mul_act {

template <typename T>
void launch_forward(ForwardParams<T> params, Activation act, const LaunchPlan& plan, bool vectorized) {
  params.rows_per_block = plan.rows_per_block;
  FUSEFORGE_ACTIVATION_SWITCH(act, kAct, [&] {
    FUSEFORGE_BOOL_SWITCH(vectorized, kVec, [&] {
      launch_kernel(forward_kernel<T, kAct, kVec>, plan.grid, plan.block, plan.smem_bytes, params);
    });
  });
}

template void launch_forward<float>(ForwardParams<float>, Activation, const LaunchPlan&, bool);
template void launch_forward<at::Half>(ForwardParams<at::Half>, Activation, const LaunchPlan&, bool);
template void launch_forward<at::BFloat16>(ForwardParams<at::BFloat16>, Activation, const LaunchPlan&, bool);

}  // namespace fuseforge::add_mul_act
