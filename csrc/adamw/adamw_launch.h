// AdamW's launch interface, shared by the host code (adamw_cuda.cpp, compiled by the C++ compiler)
// and the kernels (adamw_launch.cu): the update kernel's arguments and the launchers. No CUDA here.
#pragma once
#include <cstdint>

#include "adamw/adamw_meta.h"

namespace fuseforge::adamw {

// The update kernel's arguments (adamw_kernel.cuh), passed by value.
struct KernelArgs {
  const TensorMeta* table;
  const BlockWork* blocks;
  const GroupHyper* groups;
  const void* const* grads;  // per tensor; nullptr: no grad this step (skipped, step not advanced)
  int32_t* done;             // per tensor arrival counters, zero between launches
  const float* grad_scale;   // nullable
  const float* found_inf;    // nullable: nonzero skips the whole step
  int64_t chunk_elems;
  int64_t first_block;
};

// The most 8-byte words one launch_patch_words call carries (they travel in the kernel's
// parameters: just under the 32 KB parameter limit).
constexpr int64_t kMaxPatchWords = 4000;

// Launchers (adamw_launch.cu), on the current stream of the current device; they never synchronize.
// launch_update runs blocks [args.first_block, args.first_block + num_blocks) of the block map with
// the update kernel (smem_bytes: dynamic shared memory, only to cap its resident blocks an SM;
// int8_states: the table holds int8 states, so the kernel with that path runs).
// launch_patch_words writes count <= kMaxPatchWords words to dst.
void launch_update(const KernelArgs& args, int64_t num_blocks, size_t smem_bytes, bool int8_states);
void launch_patch_words(uint64_t* dst, const uint64_t* words, int64_t count);

}  // namespace fuseforge::adamw
