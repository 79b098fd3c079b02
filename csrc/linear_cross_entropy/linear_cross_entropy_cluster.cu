// Instantiations of the cluster row-softmax kernel (fp32 / fp16 / bf16 gradients x 4 row sizes; bf16
// reads bf16 logits, the others float32).
#include <algorithm>
#include <atomic>
#include <type_traits>

#include "common/cuda_utils.h"
#include "linear_cross_entropy/linear_cross_entropy_kernel.cuh"

namespace fuseforge::linear_cross_entropy {

// How many clusters of kKernel (smem_bytes of dynamic shared memory) the device holds at once: the
// occupancy calculator, cached per device (one cache per kernel: this function's instantiation).
template <auto kKernel>
int resident_clusters(size_t smem_bytes) {
  static std::atomic<int> cache[kMaxCachedDevices];
  return cached_per_device(cache, [&] {
    if (smem_bytes > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem_bytes)));
    }
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(kClusterSize, 1024);
    config.blockDim = dim3(kClusterThreads);
    config.dynamicSmemBytes = smem_bytes;
    int clusters = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kKernel, &config));
    return clusters;
  });
}

// One instantiation of the cluster kernel and the dynamic shared memory it takes.
template <typename T, typename L, int kVec4, bool kPlain>
struct ClusterKernel {
  static constexpr auto kernel = row_softmax_cluster_kernel<T, L, kVec4, kPlain>;
  static constexpr size_t smem_bytes = cluster_prefetch_bytes<L, kVec4>();
};

// Thread block clusters need compute capability 9.0, and this file's kernels have cluster code only
// where compiled for sm_90 and up (a trap below, linear_cross_entropy_kernel.cuh): the device must be
// 9.0 or later and the code loaded for it too (a build of 8.0+PTX alone would JIT the trap for an
// H100). The kernels' virtual architecture, cudaFuncAttributes::ptxVersion, is the same for all of
// them (one file, one list of targets). Asked once a device.
bool cluster_kernel_runnable() {
  static std::atomic<int> cache[kMaxCachedDevices];
  return cached_per_device(cache, [] {
    if (at::cuda::getCurrentDeviceProperties()->major < 9) return 1;
    cudaFuncAttributes attributes;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, row_softmax_cluster_kernel<float, float, 2, true>));
    return attributes.ptxVersion >= 90 ? 2 : 1;
  }) == 2;
}

template <typename T>
void launch_row_softmax_cluster(const RowParams<T>& p, bool persistent) {
  TORCH_CHECK(p.rows <= 65535, "linear_cross_entropy: the cluster kernel takes at most 65535 rows a launch");
  TORCH_CHECK(p.cols % 4 == 0 && p.ld_logits % 4 == 0 && (!p.dz || p.ld_dz % 4 == 0) && p.col_begin == 0 &&
                  p.cols == p.vocab && p.cols <= kClusterMaxVocab,
              "linear_cross_entropy: internal error: cluster kernel called on an unsupported layout");
  const void* logits = p.logits ? static_cast<const void*>(p.logits) : static_cast<const void*>(p.logits_lowp);
  TORCH_CHECK(p.target_logit != nullptr || static_cast<const void*>(p.dz) != logits,
              "linear_cross_entropy: internal error: dz in place of the logits needs the exact target logits");
  // Each CTA of the cluster owns `span` columns (a multiple of 4); each thread keeps kVec4 groups of 4.
  const int64_t span = ceil_div(ceil_div(p.cols, kClusterSize), 4) * 4;
  const int64_t float4_per_thread = ceil_div(span, int64_t{kClusterThreads} * 4);
  const dim3 block(kClusterThreads);
  auto launch = [&](auto kernel_tag) {
    constexpr auto kKernel = decltype(kernel_tag)::kernel;
    constexpr size_t kSmem = decltype(kernel_tag)::smem_bytes;
    // Persistent: as many clusters as are resident, each looping over rows; else one a row.
    const int64_t clusters = persistent ? std::min<int64_t>(p.rows, resident_clusters<kKernel>(kSmem)) : p.rows;
    launch_kernel(kKernel, dim3(kClusterSize, static_cast<unsigned>(clusters)), block, kSmem, p, span);
  };
  // The plain kernel for the usual training loss (no bias, softcap, z-loss or label smoothing).
  const bool plain = p.bias == nullptr && !(p.softcap > 0.f) && p.z_loss == 0.f && p.label_smoothing == 0.f;
  auto launch_for = [&](auto logit_type, auto plain_tag) {
    using L = decltype(logit_type);
    constexpr bool kPlain = decltype(plain_tag)::value;
    if (float4_per_thread <= 2) {
      launch(ClusterKernel<T, L, 2, kPlain>{});
    } else if (float4_per_thread <= 4) {
      launch(ClusterKernel<T, L, 4, kPlain>{});
    } else if (float4_per_thread <= 8) {
      launch(ClusterKernel<T, L, 8, kPlain>{});
    } else {
      launch(ClusterKernel<T, L, 16, kPlain>{});
    }
  };
  auto launch_typed = [&](auto logit_type) {
    if (plain) {
      launch_for(logit_type, std::true_type{});
    } else {
      launch_for(logit_type, std::false_type{});
    }
  };
  // 16-bit logits only for bf16 (fp16's range is too small for raw logits); one logit type a dtype.
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    TORCH_CHECK(p.logits_lowp != nullptr && p.logits == nullptr,
                "linear_cross_entropy: internal error: the bf16 cluster kernel reads bf16 logits");
    launch_typed(T{});
  } else {
    TORCH_CHECK(p.logits != nullptr && p.logits_lowp == nullptr,
                "linear_cross_entropy: internal error: the cluster kernel reads float32 logits");
    launch_typed(float{});
  }
}

template void launch_row_softmax_cluster<float>(const RowParams<float>&, bool);
template void launch_row_softmax_cluster<at::Half>(const RowParams<at::Half>&, bool);
template void launch_row_softmax_cluster<at::BFloat16>(const RowParams<at::BFloat16>&, bool);

}  // namespace fuseforge::linear_cross_entropy
