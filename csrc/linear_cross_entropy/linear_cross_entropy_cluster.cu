// Instantiations of the cluster row-softmax kernel (fp32 / fp16 / bf16 gradients x 4 row sizes; bf16
// reads bf16 logits, the others float32).
#include "linear_cross_entropy/linear_cross_entropy_kernel.cuh"

namespace fuseforge::linear_cross_entropy {

template <typename T>
void launch_row_softmax_cluster(const RowParams<T>& p) {
  TORCH_CHECK(p.rows <= 65535, "linear_cross_entropy: the cluster kernel takes at most 65535 rows a launch");
  TORCH_CHECK(p.cols % 4 == 0 && p.ld_logits % 4 == 0 && (!p.dz || p.ld_dz % 4 == 0) && p.col_begin == 0 &&
                  p.cols == p.vocab && p.cols <= kClusterMaxVocab,
              "linear_cross_entropy: internal error: cluster kernel called on an unsupported layout");
  // Each CTA of the cluster owns `span` columns (a multiple of 4); each thread keeps kVec4 float4s.
  const int64_t span = ceil_div(ceil_div(p.cols, kClusterSize), 4) * 4;
  const int64_t float4_per_thread = ceil_div(span, int64_t{kClusterThreads} * 4);
  const dim3 grid(kClusterSize, static_cast<unsigned>(p.rows));
  const dim3 block(kClusterThreads);
  auto launch_for = [&](auto logit_type) {
    using L = decltype(logit_type);
    if (float4_per_thread <= 2) {
      launch_kernel(row_softmax_cluster_kernel<T, L, 2>, grid, block, 0, p, span);
    } else if (float4_per_thread <= 4) {
      launch_kernel(row_softmax_cluster_kernel<T, L, 4>, grid, block, 0, p, span);
    } else if (float4_per_thread <= 8) {
      launch_kernel(row_softmax_cluster_kernel<T, L, 8>, grid, block, 0, p, span);
    } else {
      launch_kernel(row_softmax_cluster_kernel<T, L, 16>, grid, block, 0, p, span);
    }
  };
  // 16-bit logits only for bf16 (fp16's range is too small for raw logits); one logit type a dtype.
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    TORCH_CHECK(p.logits_lowp != nullptr && p.logits == nullptr,
                "linear_cross_entropy: internal error: the bf16 cluster kernel reads bf16 logits");
    launch_for(T{});
  } else {
    TORCH_CHECK(p.logits != nullptr && p.logits_lowp == nullptr,
                "linear_cross_entropy: internal error: the cluster kernel reads float32 logits");
    launch_for(float{});
  }
}

template void launch_row_softmax_cluster<float>(const RowParams<float>&);
template void launch_row_softmax_cluster<at::Half>(const RowParams<at::Half>&);
template void launch_row_softmax_cluster<at::BFloat16>(const RowParams<at::BFloat16>&);

}  // namespace fuseforge::linear_cross_entropy
