// The device-side check of a varlen batch's cu_seqlens: the host cannot read them without a sync, so
// a one-block kernel ahead of the attention kernels on the same stream checks what the kernels rely on
// and, on bad input, stops with a device-side assert naming the argument (PyTorch's way for bad
// indices on CUDA; no kernel after it on the stream runs, so nothing reads out of bounds). The same
// block writes the order the kernels take the sequences in (FwdParams::seq_order): longest first, and
// for the backward the prefix sums of its key blocks in that order (BwdParams::key_block_prefix).
#include <c10/macros/Macros.h>

#include <cstdio>
#include <cub/block/block_scan.cuh>

#include "attention/attention_params.h"
#include "common/launch.cuh"

namespace fuseforge::attention {
namespace {

constexpr int kThreads = 256;
constexpr int kOrderBuckets = 1024;  // of len_q + len_k >> order_shift, a counting sort's keys

__global__ void check_and_order_sequences_kernel(const int* cu_q, const int* cu_k, int batch, int64_t total_q,
                                                 int64_t total_k, int64_t max_q, int64_t max_k, int order_shift,
                                                 int* seq_order, int* key_block_prefix, int key_block_rows) {
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
  // The order: a tile's work grows with its sequence's lengths, so longest sequences first (LPT) keeps
  // the heaviest tiles out of the last wave: the benchmark's documents put their two longest last,
  // and a simulation of the H100's 132 SMs had the tail at 3-4% of both passes. A counting sort by
  // len_q + len_k (its top bucket the longest); ties in any order (the order never changes a result:
  // every tile's work is its own, dQ's sums are unordered anyway outside deterministic mode, and
  // deterministic mode sums nothing across blocks). order_shift < 0: the given order.
  __shared__ typename cub::BlockScan<int, kThreads>::TempStorage scan_storage;
  if (order_shift < 0) {
    for (int b = threadIdx.x; b < batch; b += blockDim.x) seq_order[b] = b;
  } else {
    __shared__ int bucket_next[kOrderBuckets];
    for (int i = threadIdx.x; i < kOrderBuckets; i += blockDim.x) bucket_next[i] = 0;
    __syncthreads();
    auto bucket = [&](int b) {  // decreasing length: bucket 0 holds the longest
      const int len = max(0, cu_q[b + 1] - cu_q[b]) + max(0, cu_k[b + 1] - cu_k[b]);
      return kOrderBuckets - 1 - min(kOrderBuckets - 1, len >> order_shift);
    };
    for (int b = threadIdx.x; b < batch; b += blockDim.x) atomicAdd(&bucket_next[bucket(b)], 1);
    __syncthreads();
    constexpr int kPerThread = kOrderBuckets / kThreads;
    int counts[kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) counts[i] = bucket_next[threadIdx.x * kPerThread + i];
    cub::BlockScan<int, kThreads>(scan_storage).ExclusiveSum(counts, counts);
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) bucket_next[threadIdx.x * kPerThread + i] = counts[i];
    __syncthreads();
    for (int b = threadIdx.x; b < batch; b += blockDim.x) seq_order[atomicAdd(&bucket_next[bucket(b)], 1)] = b;
  }
  if (key_block_prefix == nullptr) return;
  // The backward's key blocks in that order (BwdParams::key_block_prefix): entry z counts the blocks
  // of key_block_rows keys of sequences seq_order[0, z). The block's global writes above are visible
  // to all of its threads after the barrier.
  __syncthreads();
  int carry = 0;
  for (int z0 = 0; z0 <= batch; z0 += kThreads) {
    const int z = z0 + threadIdx.x;
    int blocks = 0;
    if (z < batch) {
      const int b = seq_order[z];
      blocks = (max(0, cu_k[b + 1] - cu_k[b]) + key_block_rows - 1) / key_block_rows;
    }
    int before, chunk;
    cub::BlockScan<int, kThreads>(scan_storage).ExclusiveSum(blocks, before, chunk);
    if (z <= batch) key_block_prefix[z] = carry + before;
    carry += chunk;
    __syncthreads();  // scan_storage is reused
  }
}

}  // namespace

void check_and_order_sequences_async(const int* cu_q, const int* cu_k, int batch, int64_t total_q, int64_t total_k,
                                     int64_t max_q, int64_t max_k, bool longest_first, int* seq_order,
                                     int* key_block_prefix, int key_block_rows) {
  int order_shift = -1;
  if (longest_first) {
    order_shift = 0;
    while (((max_q + max_k) >> order_shift) >= kOrderBuckets) ++order_shift;
  }
  launch_kernel(check_and_order_sequences_kernel, dim3(1), dim3(kThreads), 0, cu_q, cu_k, batch, total_q, total_k,
                max_q, max_k, order_shift, seq_order, key_block_prefix, key_block_rows);
}

}  // namespace fuseforge::attention
