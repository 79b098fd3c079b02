// Instantiates the add_mul_act backward kernels: 3 dtypes x 6 activations x {vector, scalar}.
#include "add_mul_act/add_mul_act_kernel.cuh"
#include "common/dispatch.h"

namespace fuseforge::add_mul_act {

template <typename T>
void launch_backward(BackwardParams<T> params, Activation act, const LaunchPlan& plan, bool vectorized) {
  params.rows_per_block = plan.rows_per_block;
  FUSEFORGE_ACTIVATION_SWITCH(act, kAct, [&] {
    FUSEFORGE_BOOL_SWITCH(vectorized, kVec, [&] {
      launch_kernel(backward_kernel<T, kAct, kVec>, plan.grid, plan.block, 0, params);
    });
  });
}

template void launch_backward<float>(BackwardParams<float>, Activation, const LaunchPlan&, bool);
template void launch_backward<at::Half>(BackwardParams<at::Half>, Activation, const LaunchPlan&, bool);
template void launch_backward<at::BFloat16>(BackwardParams<at::BFloat16>, Activation, const LaunchPlan&, bool);

}  // namespace fuseforge::add_mul_act
