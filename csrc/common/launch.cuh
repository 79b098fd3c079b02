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

template <typename... KernelArgs>
inline void allow_dynamic_smem(void (*kernel)(KernelArgs...), size_t smem_bytes) {
  if (smem_bytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem_bytes)));
  }
}

// cluster_x > 1: thread block clusters of cluster_x consecutive blocks along x (grid.x a multiple of it;
// the kernel reads its rank with cluster_ctarank, common/tma.cuh).
template <typename... KernelArgs, typename... Args>
inline void launch_kernel_in_clusters(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                                      unsigned cluster_x, Args&&... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;  // nothing to do (empty tensors)
  allow_dynamic_smem(kernel, smem_bytes);
  if (cluster_x <= 1) {
    kernel<<<grid, block, smem_bytes, at::cuda::getCurrentCUDAStream()>>>(std::forward<Args>(args)...);
  } else {
    TORCH_CHECK(grid.x % cluster_x == 0, "launch: grid.x ", grid.x, " is not a multiple of the cluster size ",
                cluster_x);
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem_bytes;
    config.stream = at::cuda::getCurrentCUDAStream();
    cudaLaunchAttribute cluster = {};
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = cluster_x;
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = 1;
    C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename... KernelArgs, typename... Args>
inline void launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes, Args&&... args) {
  launch_kernel_in_clusters(kernel, grid, block, smem_bytes, 1u, std::forward<Args>(args)...);
}

// How many clusters of cluster_x blocks of this shape can be resident at once on the current device
// (0 where none fits: the caller launches without clusters then).
template <typename... KernelArgs>
inline int max_active_clusters(void (*kernel)(KernelArgs...), dim3 block, size_t smem_bytes, unsigned cluster_x) {
  allow_dynamic_smem(kernel, smem_bytes);
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(cluster_x);
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  cudaLaunchAttribute cluster = {};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = cluster_x;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    cudaGetLastError();  // leave no sticky error for the next launch check
    return 0;
  }
  return clusters;
}

}  // namespace fuseforge
