// Instantiates the glu forward kernels: 3 dtypes x 3 activations x {vector, scalar}.
#include "common/dispatch.h"
#include "glu/glu_kernel.cuh"

namespace fuseforge::glu {

int forward_rows_per_trip() { return FUSEFORGE_GLU_FWD_ROWS; }

template <typename T>
void launch_forward(const ForwardParams<T>& params, Activation act, const LaunchPlan& plan, bool vectorized) {
  FUSEFORGE_GLU_ACTIVATION_SWITCH(act, kAct, [&] {
    FUSEFORGE_BOOL_SWITCH(vectorized, kVec, [&] {
      launch_kernel(forward_kernel<T, kAct, kVec>, plan.grid, plan.block, 0, params);
    });
  });
}

template void launch_forward<float>(const ForwardParams<float>&, Activation, const LaunchPlan&, bool);
template void launch_forward<at::Half>(const ForwardParams<at::Half>&, Activation, const LaunchPlan&, bool);
template void launch_forward<at::BFloat16>(const ForwardParams<at::BFloat16>&, Activation, const LaunchPlan&, bool);

}  // namespace fuseforge::glu
