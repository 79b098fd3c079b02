// The forward's tile shape for each (element type, head dim) and the launcher template that the
// generated files in instantiations/ instantiate (one file per dtype x head dim x softcap x pass, so
// they compile in parallel). A forward instantiation parses no backward code. kPadHeadDim: the
// tensors' head dim is below kHeadDim (attention_kernel_traits.h); built for kHeadDim = 128 only, so
// every head dim up to 128 that is not 64 or 128 costs what 128 does.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "attention/sm90/attention_fwd_warpspec.cuh"

namespace fuseforge::attention {

// The launchers take c10's element types (attention_params.h); the kernels compute on CUDA's, which
// have the same 2-byte layout.
template <typename T>
struct CudaElement;
template <>
struct CudaElement<at::Half> {
  using type = __half;
};
template <>
struct CudaElement<at::BFloat16> {
  using type = __nv_bfloat16;
};

// Forward: 128 query rows a block, 8 warps of 16 rows (two warpgroups of 64 on sm_90a), key tiles of
// 128. (The mma.sync-only kernel measures best at 4 warps of 32 rows and 64-key tiles on the H100;
// the wgmma body needs 64-row warpgroups and both share one launch shape.)
// Head dim 256: 64-key tiles (Q 64 KB + 2 stages of K and V 128 KB of shared memory; O is 128 floats a
// consumer thread).
template <typename T, int kHeadDim, bool kPadHeadDim>
struct FwdConfig {
  using Traits = FwdTraits<T, kHeadDim, 128, kHeadDim == 256 ? 64 : 128, 8, kPadHeadDim>;
};

template <typename T, int kHeadDim, bool kSoftcap, bool kPadHeadDim>
void run_attention_fwd(const FwdParams& params, bool local) {
  launch_attention_fwd<typename FwdConfig<typename CudaElement<T>::type, kHeadDim, kPadHeadDim>::Traits, kSoftcap>(
      params, local);
}

}  // namespace fuseforge::attention
