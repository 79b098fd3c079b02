// Warp-level building blocks of the attention kernels, in raw PTX (cp.async: common/async_copy.cuh):
// ldmatrix, mma.sync m16n8k16 (fp16/bf16 in, fp32 accumulate), and the XOR swizzle of the shared
// memory tiles. Fragment layouts are PTX's (m16n8k16, .row.col):
//   A (16x16): a0 = (row g, k 2t..2t+1), a1 = (row g+8, same k), a2 = (row g, k 8+2t..), a3 = (row g+8, k 8+2t..)
//   B (16x8):  b0 = (k 2t..2t+1, col g), b1 = (k 8+2t.., col g)
//   C (16x8):  c0,c1 = (row g, cols 2t, 2t+1), c2,c3 = (row g+8, cols 2t, 2t+1)
// with g = lane / 4, t = lane % 4.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/async_copy.cuh"
#include "common/fast_math.cuh"

namespace fuseforge::attention {

template <typename T>
struct MmaType;
template <>
struct MmaType<__half> {
  static constexpr bool kIsBf16 = false;
};
template <>
struct MmaType<__nv_bfloat16> {
  static constexpr bool kIsBf16 = true;
};

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Stores four 8x8 matrices of 16-bit elements, each held in C-fragment order (register i of lane l: row
// l / 4, columns 2 (l % 4), +1 of matrix i), transposed: row r of stored matrix i (column r of the
// held one, 16 bytes) goes to the address lane 8 i + r gives.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// c += a * b, m16n8k16, fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (MmaType<T>::kIsBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats -> one register of two fp16/bf16 (lo = first).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (MmaType<T>::kIsBf16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// One register of two fp16/bf16 -> two floats (first = lo).
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  if constexpr (MmaType<T>::kIsBf16) return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  else return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

// The A fragment of one k16 step from the two C fragments (16 x 8 each) of the same rows that cover
// its 16 columns: how a product's fp32 result (P, dS) feeds the next product from registers.
template <typename T>
__device__ __forceinline__ void c_to_a_fragment(const float (&lo)[4], const float (&hi)[4], uint32_t (&a)[4]) {
  a[0] = pack2<T>(lo[0], lo[1]);
  a[1] = pack2<T>(lo[2], lo[3]);
  a[2] = pack2<T>(hi[0], hi[1]);
  a[3] = pack2<T>(hi[2], hi[3]);
}

// Shared-memory tiles are rows of kCols 16-bit elements stored as 16-byte chunks; chunk c of row r
// lives at chunk c ^ (r % 8), so the 8 rows an ldmatrix phase reads hit 8 different bank groups
// (no conflicts), for both ldmatrix and ldmatrix.trans, and cp.async writes whole chunks.
template <int kCols>
struct SwizzledTile {
  static_assert(kCols % 64 == 0, "rows must span at least 8 chunks of 16 bytes for the swizzle");
  static constexpr int kChunks = kCols / 8;
  // Byte offset of element (row, col), col a multiple of 8.
  __device__ __forceinline__ static uint32_t offset(int row, int col) {
    const int chunk = (col >> 3) ^ (row & 7);
    return static_cast<uint32_t>((row * kChunks + chunk) * 16);
  }
};

// A thread's ldmatrix addresses into a SwizzledTile<kCols>, as 4 registers + compile-time offsets:
// the thread reads row `row` (+ multiples of 8) at chunk 2 * ks + x (16-column step ks). Since
// (2ks + x) ^ (row % 8) = 8 (ks / 4) + ((2 (ks % 4)) ^ c) with c = x ^ (row % 8), only ks % 4 needs
// a register; row steps and ks / 4 fold into the instruction's immediate offset (no per-address
// registers hoisted out of the key loop).
template <int kCols>
struct SwizzledBases {
  static constexpr int kRowBytes = kCols * 2;
  uint32_t base[4];
  __device__ __forceinline__ SwizzledBases(uint32_t tile, int row, int x) {
    const int c = x ^ (row & 7);
#pragma unroll
    for (int j = 0; j < 4; ++j) base[j] = tile + row * kRowBytes + (((2 * j) ^ c) * 16);
  }
  // Address for row + row_off (row_off a multiple of 8) at 16-column step ks.
  __device__ __forceinline__ uint32_t at(int row_off, int ks) const {
    return base[ks & 3] + row_off * kRowBytes + (ks >> 2) * 128;
  }
};

// Rows [row0, row0 + kRows) x kCols of a global matrix (row stride in elements) into a swizzled
// shared tile (Tile::offset: SwizzledTile, or the wgmma kernels' PanelTile) with cp.async,
// zero-filling rows at or past `rows_valid` and columns at or past `cols_valid` (a multiple of 8: the
// head dim, FwdParams::head_dim). All kThreads threads take part.
template <int kRows, int kCols, int kThreads, typename T, class Tile = SwizzledTile<kCols>>
__device__ __forceinline__ void load_tile_async(uint32_t smem_base, const T* gmem, int64_t row_stride,
                                                int rows_valid, int cols_valid, int tid) {
  constexpr int kChunks = kCols / 8;
  constexpr int kTotal = kRows * kChunks;
  static_assert(kTotal % kThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int i = 0; i < kTotal / kThreads; ++i) {
    const int idx = i * kThreads + tid;
    const int row = idx / kChunks, chunk = idx % kChunks;
    const bool row_ok = row < rows_valid, col_ok = chunk * 8 < cols_valid;
    // Invalid chunks point into the tile's first row (always mapped), with a zero-byte read.
    const T* src = gmem + (row_ok ? row : 0) * row_stride + (col_ok ? chunk * 8 : 0);
    const bool valid = row_ok && col_ok;
    cp_async_16(smem_base + Tile::offset(row, chunk * 8), src, valid);
  }
}

__device__ __forceinline__ float warp_max4(float x) {  // over the 4 threads (t) sharing a row
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float warp_sum4(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

}  // namespace fuseforge::attention
