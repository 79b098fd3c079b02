// Instantiates the rms_norm backward kernels (3 dtypes x (8 row shapes + 2 two-pass)), their
// planner and launcher, and the weight gradient's column sum.
#include "common/column_sum.cuh"
#include "common/dispatch.h"
#include "rms_norm/rms_norm_kernel.cuh"

namespace fuseforge::rms_norm {

template <typename T>
LaunchPlan plan_backward(int64_t rows, int64_t cols, bool aligned) {
  return make_plan<T, BackwardRow>(
      rows, cols, aligned, /*one_wave=*/true, [](auto shape) { return backward_rows_kernel<T, decltype(shape)::value>; },
      [](bool vectorized) {
        return vectorized ? backward_two_pass_kernel<T, kVecElems<T>> : backward_two_pass_kernel<T, 1>;
      });
}

template <typename T>
void launch_backward(const BackwardParams<T>& params, const LaunchPlan& plan, void* grad_weight) {
  if (plan.row_shape >= 0) {
    with_row_shape(plan.row_shape, [&](auto shape) {
      launch_kernel(backward_rows_kernel<T, decltype(shape)::value>, plan.grid, plan.block, 0, params);
    });
  } else {
    FUSEFORGE_BOOL_SWITCH(plan.vectorized, kVec, [&] {
      launch_kernel(backward_two_pass_kernel<T, kVec ? kVecElems<T> : 1>, plan.grid, plan.block, 0, params);
    });
  }
  if (params.weight_partials == nullptr) return;
  // The weight is T or float32.
  if (params.weight_dtype == Dtype::kFloat) {
    launch_column_sum(params.weight_partials, plan.grid.x, params.cols, static_cast<float*>(grad_weight));
  } else {
    launch_column_sum(params.weight_partials, plan.grid.x, params.cols, static_cast<T*>(grad_weight));
  }
}

template LaunchPlan plan_backward<float>(int64_t, int64_t, bool);
template LaunchPlan plan_backward<at::Half>(int64_t, int64_t, bool);
template LaunchPlan plan_backward<at::BFloat16>(int64_t, int64_t, bool);
template void launch_backward<float>(const BackwardParams<float>&, const LaunchPlan&, void*);
template void launch_backward<at::Half>(const BackwardParams<at::Half>&, const LaunchPlan&, void*);
template void launch_backward<at::BFloat16>(const BackwardParams<at::BFloat16>&, const LaunchPlan&, void*);

}  // namespace fuseforge::rms_norm
