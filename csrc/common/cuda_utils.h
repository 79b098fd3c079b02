// Host-side CUDA helpers that plain C++ (g++-compiled) files may include.
#pragma once
#include <ATen/cuda/CUDAContext.h>

#include <algorithm>
#include <cstdint>

namespace fuseforge {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int num_sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

// Dynamic shared memory (never used) that leaves room for exactly `blocks_per_sm` resident blocks
// of a kernel with `static_smem` bytes of static shared memory a block; 0 when blocks_per_sm <= 0.
// For streaming kernels whose DRAM efficiency falls with the number of blocks in flight (measured
// for add_mul_act's backward, docs/notes_add_mul_act.md): registers alone would allow more.
inline size_t smem_capping_blocks_per_sm(int64_t blocks_per_sm, size_t static_smem) {
  if (blocks_per_sm <= 0) return 0;
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  const int64_t per_block = static_cast<int64_t>(prop->sharedMemPerMultiprocessor) / (blocks_per_sm + 1) + 1;
  const int64_t taken = static_cast<int64_t>(prop->reservedSharedMemPerBlock + static_smem);
  return static_cast<size_t>(std::max<int64_t>(0, per_block - taken));
}

}  // namespace fuseforge
