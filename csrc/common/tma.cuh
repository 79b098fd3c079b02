// Hopper (sm_90) asynchronous-copy machinery in raw PTX, for warp-specialized kernels: mbarriers
// (a producer announces the bytes a stage will receive, TMA completes them, consumers wait on the
// phase), TMA tile loads (cp.async.bulk.tensor with a host-built CUtensorMap), bulk float32
// reductions into global memory (cp.reduce.async.bulk), named barriers
// between subsets of warps, and setmaxnreg (producer warps give registers to consumer warps).
// Host side: encode_tma_tile_map builds a tensor map through the driver entry point (no -lcuda).
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>

namespace fuseforge {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialized barriers visible to the async proxy (TMA) before any copy signals them.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrives and announces `bytes` of transactions for the current phase (the producer, one thread).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Announces `bytes` of transactions without arriving (the arrivals come from elsewhere).
__device__ __forceinline__ void mbarrier_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase with the given parity has completed. A fresh barrier counts as having
// completed the phase of parity 1, so a producer's first wait on an "empty" barrier passes.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void prefetch_tma_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// Box at coordinates (c0 innermost, .., c3) of a 4-d tensor map into shared memory at dst; the bytes
// complete_tx on `bar`. Out-of-range elements are written as zeros.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, "
      "%6}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// Box at coordinates (c0 innermost, .., c3) of a 4-d tensor map from shared memory at src to global
// memory, as one bulk-async group of the issuing thread (bulk_commit_group after its stores); elements
// outside the tensor are not written. The issuing thread waits (bulk_wait_group_read_all) before src
// is written again and (bulk_wait_group_all) before the block leaves.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// Bulk reduction: global[dst .. + bytes) += shared[src .. + bytes) elementwise in float32, done by the
// TMA unit (addresses 16-byte aligned, bytes a multiple of 16), issued and committed as one bulk-async
// group by the threads where `issue` holds. Those threads wait_group_read before the source is written
// again and wait_group before the block may leave (the shared source must outlive the read); for the
// others both waits return at once. A predicate, not a branch: consumer warps call this between wgmmas,
// and a divergent branch there (with the __syncwarp around it) made ptxas serialize them (C7512).
__device__ __forceinline__ void bulk_reduce_add_f32(bool issue, float* dst, uint32_t src, uint32_t bytes) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %0, 0;\n"
      " @p cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%1], [%2], %3;\n"
      " @p cp.async.bulk.commit_group;\n}\n" ::"r"(int(issue)),
      "l"(dst), "r"(src), "r"(bytes)
      : "memory");
}
__device__ __forceinline__ void bulk_wait_group_read_all() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_group_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// This thread's generic-proxy writes to global memory, ordered before later async-proxy (TMA)
// accesses of it, its own or (through a release / acquire chain) another block's.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;\n" ::: "memory"); }
// An acquire load at GPU scope (a flag another block releases).
__device__ __forceinline__ int load_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Named barriers (ids 1..15; 0 is __syncthreads): `threads` = every thread that syncs or arrives.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Register budget of the executing warpgroup (all its threads execute it; a multiple of 8 in [24, 256]).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
#endif  // __CUDA_ARCH__ >= 900

// Host: a tiled tensor map over a 4-d tensor of 2-byte elements (dims innermost first, strides in
// bytes for dims 1..3), boxes of box0 x box1 x 1 x 1 elements, 128-byte swizzle (box0 * 2 <= 128),
// zeros outside the tensor. Returns false (map unusable, take another path) when the driver refuses
// the shape: strides or the address not multiples of 16 bytes, or no driver entry point.
inline bool encode_tma_tile_map(CUtensorMap* map, bool bf16, const void* base, const uint64_t (&dims)[4],
                                const uint64_t (&byte_strides)[3], uint32_t box0, uint32_t box1) {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // leave no sticky error for the next launch check
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  cuuint64_t global_dims[4], global_strides[3];
  for (int i = 0; i < 4; ++i) global_dims[i] = dims[i];
  for (int i = 0; i < 3; ++i) {
    // A dim of size 1 is never stepped over: give it a stride the driver accepts.
    global_strides[i] = dims[i + 1] == 1 && byte_strides[i] % 16 != 0 ? 16 : byte_strides[i];
    if (global_strides[i] == 0) global_strides[i] = dims[i + 1] == 1 ? 16 : 0;
    if (global_strides[i] == 0 || global_strides[i] % 16 != 0) return false;
  }
  const cuuint32_t box[4] = {box0, box1, 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  return encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                const_cast<void*>(base), global_dims, global_strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace fuseforge
