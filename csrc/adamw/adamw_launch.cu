// fused AdamW launchers: the update kernel and the metadata patch kernel. The host side that
// decides what to launch is adamw_cuda.cpp.
#include <cstring>

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

}  // namespace

void launch_update(const KernelArgs& args, int64_t num_blocks, size_t smem_bytes, bool int8_states) {
  const auto kernel = int8_states ? adamw_multi_tensor_kernel<true> : adamw_multi_tensor_kernel<false>;
  launch_kernel(kernel, dim3(static_cast<unsigned>(num_blocks)), dim3(kThreads), smem_bytes, args);
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
