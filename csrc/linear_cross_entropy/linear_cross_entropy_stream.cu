// Instantiations of the streaming row-softmax kernel, the target-residual kernels (16-bit types) and
// the gradient scaling kernel.
#include "linear_cross_entropy/linear_cross_entropy_kernel.cuh"

namespace fuseforge::linear_cross_entropy {

namespace {
template <typename T, typename L, bool kEntropy>
void launch_stream_kernel(const StreamParams<T>& p, const L* logits) {
  const auto aligned4 = [](const void* ptr, size_t elem) { return reinterpret_cast<uintptr_t>(ptr) % (4 * elem) == 0; };
  const bool vec = p.cols % 4 == 0 && p.ld_logits % 4 == 0 && aligned4(logits, sizeof(L)) &&
                   (!p.dz || (p.ld_dz % 4 == 0 && aligned4(p.dz, sizeof(T))));
  const dim3 grid(static_cast<unsigned>(p.rows));
  if (vec) {
    launch_kernel(row_softmax_stream_kernel<T, L, true, kEntropy>, grid, dim3(kStreamThreads), 0, p);
  } else {
    launch_kernel(row_softmax_stream_kernel<T, L, false, kEntropy>, grid, dim3(kStreamThreads), 0, p);
  }
}

// The entropy variant only where an entropy is written or its gradient taken: the plain per-token
// kernel otherwise (nothing added to it).
template <typename T, typename L>
void launch_stream(const StreamParams<T>& p, const L* logits) {
  if (p.entropy_out != nullptr || p.entropy_scale != nullptr) return launch_stream_kernel<T, L, true>(p, logits);
  launch_stream_kernel<T, L, false>(p, logits);
}
}  // namespace

template <typename T>
void launch_row_softmax_stream(const StreamParams<T>& p) {
  if constexpr (!std::is_same_v<T, float>) {
    if (p.logits_lowp != nullptr) return launch_stream<T, T>(p, p.logits_lowp);
  }
  launch_stream<T, float>(p, p.logits);
}

template <typename T>
void launch_scale(T* data, int64_t n, const float* a, const float* b) {
  if (n == 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>(ceil_div(n, kThreads), int64_t{num_sms()} * 8);
  launch_kernel(scale_kernel<T>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0, data, n, a, b);
}

template <typename T>
void launch_target_logits(const T* x, const T* weight, const int64_t* target, int64_t rows, int64_t hidden,
                          int64_t vocab, int64_t ignore_index, float* out) {
  constexpr int64_t kRowsPerBlock = kTargetLogitThreads / 32;
  launch_kernel(target_logit_kernel<T>, dim3(static_cast<unsigned>(ceil_div(rows, kRowsPerBlock))),
                dim3(kTargetLogitThreads), 0, x, weight, target, rows, hidden, vocab, ignore_index, out);
}

template <typename T>
void launch_add_target_rows(const float* acc, const T* weight, const int64_t* target, const float* residual,
                            int64_t rows, int64_t hidden, int64_t vocab, T* grad_x) {
  if (rows == 0) return;
  launch_kernel(add_target_rows_kernel<T>, dim3(static_cast<unsigned>(rows)), dim3(256), 0, acc, weight, target,
                residual, hidden, vocab, grad_x);
}

template <typename T>
void launch_scatter_target_rows(const int64_t* sorted_target, const int64_t* order, const float* residual,
                                const T* x, int64_t rows, int64_t hidden, int64_t vocab, float* w_acc, float* b_acc) {
  if (rows == 0) return;
  launch_kernel(scatter_target_rows_kernel<T>, dim3(static_cast<unsigned>(rows)), dim3(256), 0, sorted_target, order,
                residual, x, rows, hidden, vocab, w_acc, b_acc);
}

template void launch_row_softmax_stream<float>(const StreamParams<float>&);
template void launch_row_softmax_stream<at::Half>(const StreamParams<at::Half>&);
template void launch_row_softmax_stream<at::BFloat16>(const StreamParams<at::BFloat16>&);
template void launch_target_logits<float>(const float*, const float*, const int64_t*, int64_t, int64_t, int64_t,
                                          int64_t, float*);
template void launch_target_logits<at::Half>(const at::Half*, const at::Half*, const int64_t*, int64_t, int64_t,
                                             int64_t, int64_t, float*);
template void launch_target_logits<at::BFloat16>(const at::BFloat16*, const at::BFloat16*, const int64_t*, int64_t,
                                                 int64_t, int64_t, int64_t, float*);
template void launch_add_target_rows<at::Half>(const float*, const at::Half*, const int64_t*, const float*, int64_t,
                                               int64_t, int64_t, at::Half*);
template void launch_add_target_rows<at::BFloat16>(const float*, const at::BFloat16*, const int64_t*, const float*,
                                                   int64_t, int64_t, int64_t, at::BFloat16*);
template void launch_scatter_target_rows<at::Half>(const int64_t*, const int64_t*, const float*, const at::Half*,
                                                   int64_t, int64_t, int64_t, float*, float*);
template void launch_scatter_target_rows<at::BFloat16>(const int64_t*, const int64_t*, const float*,
                                                       const at::BFloat16*, int64_t, int64_t, int64_t, float*, float*);
template void launch_scale<float>(float*, int64_t, const float*, const float*);
template void launch_scale<at::Half>(at::Half*, int64_t, const float*, const float*);
template void launch_scale<at::BFloat16>(at::BFloat16*, int64_t, const float*, const float*);

}  // namespace fuseforge::linear_cross_entropy
