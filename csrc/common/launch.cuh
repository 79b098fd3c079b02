// The one way fuseforge launches a kernel (include only from .cu files; host logic that can throw,
// like input checks and allocation, lives in g++-compiled <op>_cuda.cpp files, see
// docs/DEVELOPING.md): on the current stream of the current device (callers
// hold a c10::cuda::CUDAGuard for their tensors' device), raising the dynamic shared-memory limit
// when a kernel needs more than the default 48 KB, checking the launch, never synchronizing.
#pragma once
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_utils.h"

namespace fuseforge {

template <typename... KernelArgs, typename... Args>
inline void launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                          Args&&... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;  // nothing to do (empty tensors)
  if (smem_bytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem_bytes)));
  }
  kernel<<<grid, block, smem_bytes, at::cuda::getCurrentCUDAStream()>>>(std::forward<Args>(args)...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fuseforge
