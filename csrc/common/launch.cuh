// The one way fuseforge launches a kernel (include only from .cu files; host logic that can throw,
// like input checks and allocation, lives in g++-compiled <op>_cuda.cpp files, see
// CONTRIBUTING.md): on the current stream of the current device (callers
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

// overlap_previous: programmatic dependent launch (compute capability 9.0 and up; a plain launch
// below). The kernel's blocks may start once every block of the kernel before it on the stream has
// called grid_dependents_may_launch() (or exited), so its prologue runs under that kernel's tail and
// the launch latency is hidden. Such a kernel must call grid_dependency_wait() in every thread before
// it touches memory the kernels before it write, and before it exits in at least one thread of every
// block, or of one block (grid_dependency_wait_on_early_exit): a kernel launched after it then also
// finds the ones before it complete.
template <typename... KernelArgs, typename... Args>
inline void launch_kernel_ex(bool overlap_previous, void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
                             size_t smem_bytes, Args&&... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;  // nothing to do (empty tensors)
  if (smem_bytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem_bytes)));
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (overlap_previous && at::cuda::getCurrentDeviceProperties()->major >= 9) {
    cudaLaunchAttribute attribute;
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem_bytes;
    config.stream = stream;
    config.attrs = &attribute;
    config.numAttrs = 1;
    C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
  } else {
    kernel<<<grid, block, smem_bytes, stream>>>(std::forward<Args>(args)...);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename... KernelArgs, typename... Args>
inline void launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                          Args&&... args) {
  launch_kernel_ex(false, kernel, grid, block, smem_bytes, std::forward<Args>(args)...);
}

// The kernel side of overlap_previous (no-ops in a plain launch and below compute capability 9.0).
// Waits until the kernels before this one on the stream are complete, their writes visible.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
// For a block that leaves without touching the earlier kernels' memory (past its sequence, say):
// only the grid's first block waits, so that the grid's completion still implies theirs even where
// every block leaves early, and the others leave at once.
__device__ __forceinline__ void grid_dependency_wait_on_early_exit() {
  if (blockIdx.x + blockIdx.y + blockIdx.z == 0) grid_dependency_wait();
}
// This block lets the next kernel (launched with overlap_previous) start its blocks as SMs free up.
__device__ __forceinline__ void grid_dependents_may_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace fuseforge
