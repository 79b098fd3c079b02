// Instantiates the add_mul_act forward kernels: 3 dtypes x 6 activations x {vector, scalar}, and the
// 16-bit SiLU forward that saves no z at its own rows a trip (rows_unroll).
#include "add_mul_act/add_mul_act_kernel.cuh"
#include "common/dispatch.h"

namespace fuseforge::add_mul_act {

template <typename T>
void launch_forward(ForwardParams<T> params, Activation act, const LaunchPlan& plan, bool vectorized) {
  params.rows_per_block = plan.rows_per_block;
  const bool saves = params.saved_z != nullptr || params.saved_mask != nullptr;
  FUSEFORGE_ACTIVATION_SWITCH(act, kAct, [&] {
    FUSEFORGE_BOOL_SWITCH(vectorized, kVec, [&] {
      FUSEFORGE_BOOL_SWITCH(saves, kSaves, [&] {
        launch_kernel(forward_kernel<T, kAct, kVec, rows_unroll<T, kAct, kSaves>()>, plan.grid, plan.block,
                      plan.smem_bytes, params);
      });
    });
  });
}

template void launch_forward<float>(ForwardParams<float>, Activation, const LaunchPlan&, bool);
template void launch_forward<at::Half>(ForwardParams<at::Half>, Activation, const LaunchPlan&, bool);
template void launch_forward<at::BFloat16>(ForwardParams<at::BFloat16>, Activation, const LaunchPlan&, bool);

}  // namespace fuseforge::add_mul_act
