// Instantiates the glu backward kernels: 3 dtypes x 3 activations x {vector, scalar}.
#include "common/dispatch.h"
#include "glu/glu_kernel.cuh"

namespace fuseforge::glu {

int backward_rows_per_trip() { return FUSEFORGE_GLU_BWD_ROWS; }

template <typename T>
void launch_backward(const BackwardParams<T>& params, Activation act, const LaunchPlan& plan, bool vectorized) {
  FUSEFORGE_GLU_ACTIVATION_SWITCH(act, kAct, [&] {
    FUSEFORGE_BOOL_SWITCH(vectorized, kVec, [&] {
      launch_kernel(backward_kernel<T, kAct, kVec>, plan.grid, plan.block, 0, params);
    });
  });
}

template void launch_backward<float>(const BackwardParams<float>&, Activation, const LaunchPlan&, bool);
template void launch_backward<at::Half>(const BackwardParams<at::Half>&, Activation, const LaunchPlan&, bool);
template void launch_backward<at::BFloat16>(const BackwardParams<at::BFloat16>&, Activation, const LaunchPlan&,
                                            bool);

}  // namespace fuseforge::glu
