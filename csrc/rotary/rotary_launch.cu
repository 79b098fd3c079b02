// Instantiates the rotary kernels: 3 x 3 (input, output) types x {half-split, interleaved} x
// {token, staged, register vector, register scalar}.
#include "common/dispatch.h"
#include "rotary/rotary_kernel.cuh"

namespace fuseforge::rotary {

template <typename Tin, typename Tout>
void launch_rotary(const RotaryParams<Tin, Tout>& params, const LaunchPlan& plan, bool interleaved, bool vectorized) {
  FUSEFORGE_BOOL_SWITCH(interleaved, kInterleaved, [&] {
    if (plan.kernel == KernelKind::kToken) {
      TORCH_CHECK(vectorized, "rotary: the token kernel takes the vector path only");
      launch_kernel(rotary_token_kernel<Tin, Tout, kInterleaved>, plan.grid, plan.block, plan.smem_bytes, params);
      return;
    }
    if (plan.kernel == KernelKind::kStaged) {
      TORCH_CHECK(vectorized, "rotary: the staged kernel takes the vector path only");
      launch_kernel(rotary_staged_kernel<Tin, Tout, kInterleaved>, plan.grid, plan.block, plan.smem_bytes, params,
                    plan.tokens_per_block);
      return;
    }
    FUSEFORGE_BOOL_SWITCH(vectorized, kVec, [&] {
      launch_kernel(rotary_kernel<Tin, Tout, kInterleaved, kVec>, plan.grid, plan.block, plan.smem_bytes, params);
    });
  });
}

#define FUSEFORGE_ROTARY_INSTANTIATE(TIN, TOUT) \
  template void launch_rotary<TIN, TOUT>(const RotaryParams<TIN, TOUT>&, const LaunchPlan&, bool, bool);
#define FUSEFORGE_ROTARY_INSTANTIATE_OUTPUTS(TIN)        \
  FUSEFORGE_ROTARY_INSTANTIATE(TIN, float)               \
  FUSEFORGE_ROTARY_INSTANTIATE(TIN, at::Half)            \
  FUSEFORGE_ROTARY_INSTANTIATE(TIN, at::BFloat16)
FUSEFORGE_ROTARY_INSTANTIATE_OUTPUTS(float)
FUSEFORGE_ROTARY_INSTANTIATE_OUTPUTS(at::Half)
FUSEFORGE_ROTARY_INSTANTIATE_OUTPUTS(at::BFloat16)

}  // namespace fuseforge::rotary
