// Instantiates the rms_norm forward kernels (3 dtypes x (8 row shapes + 2 two-pass)) and their
// planner and launcher.
#include "common/dispatch.h"
#include "rms_norm/rms_norm_kernel.cuh"

namespace fuseforge::rms_norm {

template <typename T>
LaunchPlan plan_forward(int64_t rows, int64_t cols, bool aligned) {
  return make_plan<T, ForwardRow>(
      rows, cols, aligned, /*one_wave=*/false, [](auto shape) { return forward_rows_kernel<T, decltype(shape)::value>; },
      [](bool vectorized) {
        return vectorized ? forward_two_pass_kernel<T, kVecElems<T>> : forward_two_pass_kernel<T, 1>;
      });
}

template <typename T>
void launch_forward(const ForwardParams<T>& params, const LaunchPlan& plan) {
  if (plan.row_shape >= 0) {
    with_row_shape(plan.row_shape, [&](auto shape) {
      launch_kernel(forward_rows_kernel<T, decltype(shape)::value>, plan.grid, plan.block, 0, params);
    });
  } else {
    FUSEFORGE_BOOL_SWITCH(plan.vectorized, kVec, [&] {
      launch_kernel(forward_two_pass_kernel<T, kVec ? kVecElems<T> : 1>, plan.grid, plan.block, 0, params);
    });
  }
}

template LaunchPlan plan_forward<float>(int64_t, int64_t, bool);
template LaunchPlan plan_forward<at::Half>(int64_t, int64_t, bool);
template LaunchPlan plan_forward<at::BFloat16>(int64_t, int64_t, bool);
template void launch_forward<float>(const ForwardParams<float>&, const LaunchPlan&);
template void launch_forward<at::Half>(const ForwardParams<at::Half>&, const LaunchPlan&);
template void launch_forward<at::BFloat16>(const ForwardParams<at::BFloat16>&, const LaunchPlan&);

}  // namespace fuseforge::rms_norm
