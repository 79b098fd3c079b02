// Host-side CUDA helpers that plain C++ (g++-compiled) files may include.
#pragma once
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace fuseforge {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int num_sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

// A per-device answer asked once: compute() (> 0, e.g. the occupancy calculator's) for the current
// device, cached in cache[device] (0: not asked yet; devices beyond the table are asked every call).
constexpr int kMaxCachedDevices = 64;
template <typename Compute>
int cached_per_device(std::atomic<int> (&cache)[kMaxCachedDevices], Compute&& compute) {
  const int device = c10::cuda::current_device();
  std::atomic<int>* slot = device < kMaxCachedDevices ? &cache[device] : nullptr;
  if (slot) {
    const int cached = slot->load(std::memory_order_relaxed);
    if (cached > 0) return cached;
  }
  const int value = std::max(compute(), 1);
  if (slot) slot->store(value, std::memory_order_relaxed);
  return value;
}

// Dynamic shared memory (never used) that leaves room for exactly `blocks_per_sm` resident blocks
// of a kernel with `static_smem` bytes of static shared memory a block; 0 when blocks_per_sm <= 0.
// For streaming kernels whose DRAM efficiency falls with the number of blocks in flight (measured
// for add_mul_act's backward, docs/design/add_mul_act.md): registers alone would allow more.
inline size_t smem_capping_blocks_per_sm(int64_t blocks_per_sm, size_t static_smem) {
  if (blocks_per_sm <= 0) return 0;
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  const int64_t per_block = static_cast<int64_t>(prop->sharedMemPerMultiprocessor) / (blocks_per_sm + 1) + 1;
  const int64_t taken = static_cast<int64_t>(prop->reservedSharedMemPerBlock + static_smem);
  return static_cast<size_t>(std::max<int64_t>(0, per_block - taken));
}

}  // namespace fuseforge
