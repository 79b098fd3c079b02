// Instantiates the rotary kernels: 3 x 3 (input, output) types x {half-split, interleaved} x
// {token, staged, register vector, register scalar}, and the grouped-query token kernel for bf16 and
// fp16 (in and out) x 3 head ratios x {plain, L2 evict-last} loads.
#include <type_traits>

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
    if (plan.kernel == KernelKind::kTokenGqa) {
      // Only where it can be planned: 16-bit, one type in and out, half-split (rotary_cuda.cpp).
      if constexpr (sizeof(Tin) == 2 && std::is_same_v<Tin, Tout>) {
        TORCH_CHECK(vectorized && !kInterleaved,
                    "rotary: the grouped-query token kernel takes the half-split vector path only");
        constexpr int kChunk = chunk_elems<Tin>();
        const int ratio = params.heads_q / params.heads_k;
        auto launch = [&](auto k_elems) {
          const bool keep = keeps_in_l2(params.heads_q, params.heads_k, params.head_dim, sizeof(Tin));
          FUSEFORGE_BOOL_SWITCH(keep, kKeepInL2, [&] {
            launch_kernel(rotary_token_gqa_kernel<Tin, decltype(k_elems)::value, kKeepInL2>, plan.grid, plan.block,
                          plan.smem_bytes, params);
          });
        };
        if (ratio == 2) launch(std::integral_constant<int, kChunk / 2>{});
        else if (ratio == 4) launch(std::integral_constant<int, kChunk / 4>{});
        else if (ratio == 8) launch(std::integral_constant<int, kChunk / 8>{});
        else TORCH_CHECK(false, "rotary: the grouped-query token kernel takes Hq / Hk = 2, 4 or 8, not ", ratio);
      } else {
        TORCH_CHECK(false, "rotary: the grouped-query token kernel takes 16-bit inputs of the output's type");
      }
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
