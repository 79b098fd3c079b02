// Hopper (sm_90a) warpgroup matrix products for the attention backward, in raw PTX: wgmma.mma_async
// reads its operands from shared memory through 64-bit matrix descriptors (A may come from
// registers), a warpgroup of 4 warps computes a 64 x N tile, and the accumulator layout is the
// mma.sync C fragment of each warp's 16 rows (attention_mma.cuh), so the softmax code of the mma.sync
// kernels applies unchanged. One instruction replaces 4 x N/8 mma.sync and their ldmatrix loads.
//
// Shared-memory tiles for wgmma (PanelTile): 128-byte swizzle. A kRows x kCols tile of 16-bit
// elements is stored as kCols / 64 panels of kRows rows x 128 bytes; 16-byte chunk c of row r sits at
// chunk c ^ (r % 8), the pattern the hardware applies to address bits [4, 7) from bits [7, 10), so a
// tile must start on a 1024-byte boundary. The same tile serves as a K-major operand (rows = M or N,
// 64-element panels along K) and as an MN-major one (rows = K, panels along M or N).
#pragma once
#include <cstdint>

#include "attention/sm80/attention_mma.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FUSEFORGE_ATTENTION_WGMMA 1
#else
#define FUSEFORGE_ATTENTION_WGMMA 0
#endif

namespace fuseforge::attention {

template <int kRows>
struct PanelTile {
  static_assert(kRows % 8 == 0, "whole 8-row swizzle atoms");
  static constexpr int kPanelBytes = kRows * 128;
  // Byte offset of element (row, col), col a multiple of 8.
  __device__ __forceinline__ static uint32_t offset(int row, int col) {
    return static_cast<uint32_t>((col >> 6) * kPanelBytes + row * 128 + ((((col >> 3) & 7) ^ (row & 7)) << 4));
  }
};

// Matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address, leading and stride byte
// offsets (all >> 4), swizzle mode 1 = 128 bytes in bits 62-63.
//   K-major operand (rows of M/N, K along the 128-byte row): leading offset unused (1), stride offset
//     1024 = one 8-row atom to the next. Start = row 0 of the operand + 2 bytes x k0 (k0 % 64).
//   MN-major operand (rows of K, M/N along the row): leading offset = from one 64-element panel to
//     the next, stride offset 1024 = 8 K rows to the next 8. Start = K row k0 of the first panel.
__host__ __device__ __forceinline__ constexpr uint64_t wgmma_desc(uint32_t smem_address, uint32_t leading_bytes) {
  return static_cast<uint64_t>((smem_address & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16) | (static_cast<uint64_t>(1024 >> 4) << 32) |
         (static_cast<uint64_t>(1) << 62);
}
__device__ __forceinline__ uint64_t wgmma_desc_k_major(uint32_t smem_address) { return wgmma_desc(smem_address, 16); }

// The thread's warp in the block, shuffled from lane 0: ptxas then knows it is warp-uniform and keeps
// what is derived from it (the warpgroup's tile offsets, so the wgmma descriptors) in uniform
// registers, without a move from the vector registers before every wgmma (R2UR: 59 -> 10 in the
// dk/dv warp-specialized kernel). Call it where every lane of the warp is active.
__device__ __forceinline__ int uniform_warp_index() {
  return __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x >> 5), 0);
}

// The descriptor of address a + byte_offset from a's: shared-memory addresses are below 2^18 bytes,
// so the 14-bit start field (address >> 4, bits 0-13) takes the offset without a carry and the
// other fields stay. A product's k-steps add constants to one descriptor instead of rebuilding it
// from the address: ~10 instructions a wgmma in the SASS (mask, shift, or, moves between register
// files), about a fifth of the backward's instructions (ncu).
__host__ __device__ __forceinline__ constexpr uint64_t wgmma_desc_add(uint64_t desc, uint32_t byte_offset) {
  const uint32_t start = static_cast<uint32_t>(desc) + (byte_offset >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | start;
}
static_assert(wgmma_desc_add(wgmma_desc(0x400, 16), 0x60) == wgmma_desc(0x460, 16) &&
                  wgmma_desc_add(wgmma_desc(0x30400, 32768), 0x6000 + 0x380) == wgmma_desc(0x36780, 32768) &&
                  wgmma_desc_add(wgmma_desc(0x1c400, 16384), 0x1ba00) == wgmma_desc(0x37e00, 16384),
              "a descriptor plus an offset is the offset address's descriptor (addresses below 228 KB)");

#if FUSEFORGE_ATTENTION_WGMMA
// Orders this thread's earlier register writes before the next wgmma reads them (accumulators, A).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed groups of this warpgroup are still running.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared-memory writes of the generic proxy (st.shared, cp.async) before wgmma reads them.
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving accesses of an accumulator across the asynchronous products.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The register lists are written out: PTX has no loops. Scale-d is 1 (d += A B): accumulators start
// zeroed. kTransA / kTransB: 0 = K-major, 1 = MN-major (16-bit types allow both). Inline asm takes
// only literal strings, so each instruction is a macro whose TYPE ("bf16" or "f16") is pasted into
// the string by literal concatenation; the wrappers pick the type with MmaType<T>::kIsBf16.
#define FUSEFORGE_WGMMA_D32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define FUSEFORGE_WGMMA_D40 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}"
#define FUSEFORGE_WGMMA_D64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define FUSEFORGE_WGMMA_D32_OUT "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define FUSEFORGE_WGMMA_D40_OUT FUSEFORGE_WGMMA_D32_OUT, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
#define FUSEFORGE_WGMMA_D64_OUT FUSEFORGE_WGMMA_D32_OUT, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define FUSEFORGE_WGMMA_TYPED(T, ASM) \
  if constexpr (MmaType<T>::kIsBf16) { ASM("bf16"); } else { ASM("f16"); }

// d (64 x 64, fp32) += A (64 x 16, shared memory) * B (16 x 64, shared memory).
template <typename T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
#define FUSEFORGE_WGMMA_ASM(TYPE)                                                                      \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                          \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " FUSEFORGE_WGMMA_D32 ", " \
               "%32, %33, p, 1, 1, %35, %36;\n}\n"                                                     \
               : FUSEFORGE_WGMMA_D32_OUT                                                               \
               : "l"(desc_a), "l"(desc_b), "r"(1), "n"(kTransA), "n"(kTransB))
  FUSEFORGE_WGMMA_TYPED(T, FUSEFORGE_WGMMA_ASM)
#undef FUSEFORGE_WGMMA_ASM
}

// d (64 x 80, fp32) += A (64 x 16, shared memory) * B (16 x 80, shared memory): the 80-query tiles of
// head dim 128's backward (BwdConfig::FullTraits).
template <typename T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n80k16_ss(float (&d)[40], uint64_t desc_a, uint64_t desc_b) {
#define FUSEFORGE_WGMMA_ASM(TYPE)                                                                      \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"                                          \
               "wgmma.mma_async.sync.aligned.m64n80k16.f32." TYPE "." TYPE " " FUSEFORGE_WGMMA_D40 ", " \
               "%40, %41, p, 1, 1, %43, %44;\n}\n"                                                     \
               : FUSEFORGE_WGMMA_D40_OUT                                                               \
               : "l"(desc_a), "l"(desc_b), "r"(1), "n"(kTransA), "n"(kTransB))
  FUSEFORGE_WGMMA_TYPED(T, FUSEFORGE_WGMMA_ASM)
#undef FUSEFORGE_WGMMA_ASM
}

// d (64 x 128, fp32) += A (64 x 16, shared memory) * B (16 x 128, shared memory).
template <typename T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
#define FUSEFORGE_WGMMA_ASM(TYPE)                                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                           \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " FUSEFORGE_WGMMA_D64 ", " \
               "%64, %65, p, 1, 1, %67, %68;\n}\n"                                                     \
               : FUSEFORGE_WGMMA_D64_OUT                                                                \
               : "l"(desc_a), "l"(desc_b), "r"(1), "n"(kTransA), "n"(kTransB))
  FUSEFORGE_WGMMA_TYPED(T, FUSEFORGE_WGMMA_ASM)
#undef FUSEFORGE_WGMMA_ASM
}

// d (64 x 64, fp32) += A (64 x 16, registers: each warp holds its 16 rows as an mma.sync A
// fragment) * B (16 x 64, shared memory).
template <typename T, int kTransB>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
#define FUSEFORGE_WGMMA_ASM(TYPE)                                                                      \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                          \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " FUSEFORGE_WGMMA_D32 ", " \
               "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"                                       \
               : FUSEFORGE_WGMMA_D32_OUT                                                               \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1), "n"(kTransB))
  FUSEFORGE_WGMMA_TYPED(T, FUSEFORGE_WGMMA_ASM)
#undef FUSEFORGE_WGMMA_ASM
}

// d (64 x 128, fp32) += A (64 x 16, registers: each warp holds its 16 rows as an mma.sync A
// fragment) * B (16 x 128, shared memory).
template <typename T, int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
#define FUSEFORGE_WGMMA_ASM(TYPE)                                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                           \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " FUSEFORGE_WGMMA_D64 ", " \
               "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"                                       \
               : FUSEFORGE_WGMMA_D64_OUT                                                                \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1), "n"(kTransB))
  FUSEFORGE_WGMMA_TYPED(T, FUSEFORGE_WGMMA_ASM)
#undef FUSEFORGE_WGMMA_ASM
}

// d (64 x kN) += A (64 x 16 kKSteps, registers: one A fragment a k-step) * B (16 kKSteps x kN, an
// MN-major PanelTile from its row 0 at sB, panels panel_bytes apart), committed as one group: the
// O += P V, dV += P^T dO and dK += dS^T Q products. kN = head dim, 64, 128 or 256; 256 runs as two
// m64n128k16 products a k-step, columns [0, 128) from panels 0-1 and [128, 256) from panels 2-3 (the
// accumulator of an n128 product is 4 floats an 8-column block, so d[64, 128) is the upper half's).
template <typename T, int kN, int kKSteps>
__device__ __forceinline__ void wgmma_rs_mn_major(float (&d)[kN / 2], const uint32_t (&a)[kKSteps][4], uint32_t sB,
                                                  uint32_t panel_bytes) {
  static_assert(kN == 64 || kN == 128 || kN == 256, "m64n64k16 or m64n128k16 (twice for 256)");
  wgmma_fence();
  const uint64_t desc_b0 = wgmma_desc(sB, panel_bytes);
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    const uint64_t desc_b = wgmma_desc_add(desc_b0, kk * 16 * 128);
    if constexpr (kN == 256) {
      wgmma_m64n128k16_rs<T, 1>(reinterpret_cast<float(&)[64]>(d[0]), a[kk], desc_b);
      wgmma_m64n128k16_rs<T, 1>(reinterpret_cast<float(&)[64]>(d[64]), a[kk],
                                wgmma_desc_add(desc_b0, 2 * panel_bytes + kk * 16 * 128));
    } else if constexpr (kN == 128) {
      wgmma_m64n128k16_rs<T, 1>(d, a[kk], desc_b);
    } else {
      wgmma_m64n64k16_rs<T, 1>(d, a[kk], desc_b);
    }
  }
  wgmma_commit();
}

// d (64 x kN) += A (64 x 16 kKSteps) * B^T (kN x 16 kKSteps), both K-major PanelTiles (64-element
// panels along K: A's from sA, a_panel_bytes apart; B's from sB, b_panel_bytes apart), committed as
// one group: the S = Q K^T, S^T = K Q^T and dP^T = V dO^T products. kN = 64, 80 or 128. Unlike
// wgmma_rs_mn_major it does not fence: the caller fences once before one or more of these groups.
template <typename T, int kN, int kKSteps>
__device__ __forceinline__ void wgmma_ss_k_major(float (&d)[kN / 2], uint32_t sA, uint32_t a_panel_bytes, uint32_t sB,
                                                 uint32_t b_panel_bytes) {
  static_assert(kN == 64 || kN == 80 || kN == 128, "m64n64k16, m64n80k16 or m64n128k16");
  const uint64_t desc_a0 = wgmma_desc_k_major(sA), desc_b0 = wgmma_desc_k_major(sB);
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    const uint64_t desc_a = wgmma_desc_add(desc_a0, (ks >> 2) * a_panel_bytes + (ks & 3) * 32);
    const uint64_t desc_b = wgmma_desc_add(desc_b0, (ks >> 2) * b_panel_bytes + (ks & 3) * 32);
    if constexpr (kN == 128) wgmma_m64n128k16_ss<T, 0, 0>(d, desc_a, desc_b);
    else if constexpr (kN == 80) wgmma_m64n80k16_ss<T, 0, 0>(d, desc_a, desc_b);
    else wgmma_m64n64k16_ss<T, 0, 0>(d, desc_a, desc_b);
  }
  wgmma_commit();
}

// d (64 x kN) += A (64 x 16 kKSteps, registers: one A fragment a k-step) * B^T (kN x 16 kKSteps, a
// K-major PanelTile from sB, b_panel_bytes apart), committed as one group: S = Q K^T with Q held in
// registers. kN = 128. Like wgmma_ss_k_major it does not fence.
template <typename T, int kN, int kKSteps>
__device__ __forceinline__ void wgmma_rs_k_major(float (&d)[kN / 2], const uint32_t (&a)[kKSteps][4], uint32_t sB,
                                                 uint32_t b_panel_bytes) {
  static_assert(kN == 128, "m64n128k16");
  const uint64_t desc_b0 = wgmma_desc_k_major(sB);
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks)
    wgmma_m64n128k16_rs<T, 0>(d, a[ks], wgmma_desc_add(desc_b0, (ks >> 2) * b_panel_bytes + (ks & 3) * 32));
  wgmma_commit();
}
#undef FUSEFORGE_WGMMA_TYPED
#undef FUSEFORGE_WGMMA_D64_OUT
#undef FUSEFORGE_WGMMA_D40_OUT
#undef FUSEFORGE_WGMMA_D32_OUT
#undef FUSEFORGE_WGMMA_D64
#undef FUSEFORGE_WGMMA_D40
#undef FUSEFORGE_WGMMA_D32
#endif  // FUSEFORGE_ATTENTION_WGMMA

}  // namespace fuseforge::attention
