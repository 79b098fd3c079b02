// The device-side check of a varlen batch's cu_seqlens: the host cannot read them without a sync, so
// a one-block kernel ahead of the attention kernels on the same stream checks what the kernels rely on
// and, on bad input, stops with a device-side assert naming the argument (PyTorch's way for bad
// indices on CUDA; no kernel after it on the stream runs, so nothing reads out of bounds).
#include <c10/macros/Macros.h>

#include <cstdio>

#include "attention/attention_params.h"
#include "common/launch.cuh"

namespace fuseforge::attention {
namespace {

__global__ void check_cu_seqlens_kernel(const int* cu_q, const int* cu_k, int batch, int64_t total_q,
                                        int64_t total_k, int64_t max_q, int64_t max_k) {
  for (int b = threadIdx.x; b <= batch; b += blockDim.x) {
    const int q = cu_q[b], k = cu_k[b];
    bool ok = true;
    if (b == 0 && (q != 0 || k != 0)) {
      printf("fuseforge attention_varlen: cu_seqlens_q[0] and cu_seqlens_k[0] must be 0, got %d and %d\n", q, k);
      ok = false;
    }
    if (b == batch && (q != total_q || k != total_k)) {
      printf("fuseforge attention_varlen: cu_seqlens_q[-1] and cu_seqlens_k[-1] must equal the packed lengths "
             "(%lld, %lld), got %d and %d\n", static_cast<long long>(total_q), static_cast<long long>(total_k), q, k);
      ok = false;
    }
    if (b < batch) {
      const int len_q = cu_q[b + 1] - q, len_k = cu_k[b + 1] - k;
      if (len_q < 0 || len_k < 0) {
        printf("fuseforge attention_varlen: cu_seqlens_q and cu_seqlens_k must be non-decreasing; sequence %d has "
               "lengths %d and %d\n", b, len_q, len_k);
        ok = false;
      } else if (len_q > max_q || len_k > max_k) {
        printf("fuseforge attention_varlen: sequence %d has lengths (%d, %d), more than (max_seqlen_q, "
               "max_seqlen_k) = (%lld, %lld)\n", b, len_q, len_k, static_cast<long long>(max_q),
               static_cast<long long>(max_k));
        ok = false;
      }
    }
    CUDA_KERNEL_ASSERT_MSG(ok, "fuseforge attention_varlen: invalid cu_seqlens (see the message above)");
  }
}

}  // namespace

void check_cu_seqlens_async(const int* cu_q, const int* cu_k, int batch, int64_t total_q, int64_t total_k,
                            int64_t max_q, int64_t max_k) {
  launch_kernel(check_cu_seqlens_kernel, dim3(1), dim3(256), 0, cu_q, cu_k, batch, total_q, total_k, max_q, max_k);
}

}  // namespace fuseforge::attention
