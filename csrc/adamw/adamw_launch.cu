// fused AdamW launchers: the update kernel (with its shape picked here, where the
// -DFUSEFORGE_ADAMW_TUNING nvcc flag reaches) and the metadata patch kernel. The host side that
// decides what to launch is adamw_cuda.cpp.
#include <cstdlib>
#include <cstring>
#include <string>

#include "adamw/adamw_kernel.cuh"
#include "adamw/adamw_launch.h"
#include "common/launch.cuh"

namespace fuseforge::adamw {
namespace {

constexpr int kSmallPatchWords = 256;  // 2 KB of parameters
constexpr int kLargePatchWords = static_cast<int>(kMaxPatchWords);

template <int kWords>
void patch_launch(uint64_t* dst, const uint64_t* words, int64_t count) {
  PatchArgs<kWords> args;
  args.dst = dst;
  args.count = count;
  std::memcpy(args.words, words, static_cast<size_t>(count) * sizeof(uint64_t));
  launch_kernel(patch_words_kernel<kWords>, dim3(1), dim3(kThreads), 0, args);
}

using UpdateKernel = void (*)(KernelArgs);

// The update kernel's shape (adamw_kernel.cuh). A tuning build (-DFUSEFORGE_ADAMW_TUNING) carries
// several, picked by FUSEFORGE_ADAMW_VARIANT=u<unroll>b<min blocks per SM> (u0b4: the default), for side-by-side timing
// in one process; a normal build compiles the default only.
UpdateKernel update_kernel() {
#ifdef FUSEFORGE_ADAMW_TUNING
  static const UpdateKernel chosen = [] {
    const char* env = std::getenv("FUSEFORGE_ADAMW_VARIANT");
    const std::string v = env ? env : "";
    if (v == "u1b4") return &adamw_multi_tensor_kernel<1, 4>;
    if (v == "u2b4") return &adamw_multi_tensor_kernel<2, 4>;
    if (v == "u2b3") return &adamw_multi_tensor_kernel<2, 3>;
    if (v == "u4b2") return &adamw_multi_tensor_kernel<4, 2>;
    if (v == "u2b2") return &adamw_multi_tensor_kernel<2, 2>;
    TORCH_CHECK(v.empty() || v == "u0b4", "FUSEFORGE_ADAMW_VARIANT: unknown variant '", v,
                "' (u0b4, u1b4, u2b4, u2b3, u4b2, u2b2)");
    return &adamw_multi_tensor_kernel<kDefaultShape.unroll, kDefaultShape.min_blocks_per_sm>;
  }();
  return chosen;
#else
  return &adamw_multi_tensor_kernel<kDefaultShape.unroll, kDefaultShape.min_blocks_per_sm>;
#endif
}

}  // namespace

void launch_update(const KernelArgs& args, int64_t num_blocks) {
  launch_kernel(update_kernel(), dim3(static_cast<unsigned>(num_blocks)), dim3(kThreads), 0, args);
}

// The smaller kernel when the words fit it: a launch copies its whole parameter block.
void launch_patch_words(uint64_t* dst, const uint64_t* words, int64_t count) {
  if (count <= kSmallPatchWords) {
    patch_launch<kSmallPatchWords>(dst, words, count);
  } else {
    patch_launch<kLargePatchWords>(dst, words, count);
  }
}

}  // namespace fuseforge::adamw
