// add_mul_act's vectorized CPU kernels, compiled once per CPU build (common/cpu_isa.h): one pass over
// memory per call, the arithmetic in the math type M (float; double for float64) with
// at::vec::Vectorized<M>. Rows are split across threads; the bias gradient is summed in a fixed
// number of row blocks and then over the blocks in order, so it does not depend on the thread count.
#pragma once
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>

#include "add_mul_act/add_mul_act_cpu.h"
#include "common/cpu_activation.h"
#include "common/cpu_vec.h"

namespace fuseforge::add_mul_act::FUSEFORGE_CPU_NS {
namespace {

template <typename M>
using Vec = CpuVec<M>;

// Columns a step: a multiple of every vector width and of 8 (relu's mask bytes start on a tile).
constexpr int64_t kTile = kCpuTile;
// Elements a task at least: below this, threads cost more than they save.
constexpr int64_t kGrainElems = 1 << 15;
// Row blocks of the bias gradient's partial sums (a constant, so the sum's order is too).
constexpr int64_t kBiasBlocks = 64;

template <typename T, Activation A>
void forward_rows(const CpuForwardArgs& a, const typename at::opmath_type<T>* bias, int64_t r0, int64_t r1) {
  using M = at::opmath_type<T>;
  using V = Vec<M>;
  constexpr int64_t W = V::size();
  const V alpha(static_cast<M>(a.alpha));
  const int64_t cols = a.cols, mask_row_bytes = (cols + 7) / 8;
  alignas(64) M xb[kTile], yb[kTile], zb[kTile], ob[kTile];
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t row = r * cols;
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t n = std::min(kTile, cols - c0);
      const M* x = as_math(static_cast<const T*>(a.x) + row + c0, xb, n);
      const M* y = as_math(static_cast<const T*>(a.y) + row + c0, yb, n);
      M* out = math_dst(static_cast<T*>(a.out) + row + c0, ob);
      M* z_saved = a.saved_z ? math_dst(static_cast<T*>(a.saved_z) + row + c0, zb) : zb;
      for (int64_t i = 0; i < n; i += W) {
        const int64_t k = std::min(W, n - i);
        V z = at::vec::fmadd(alpha, V::loadu(y + i, k), V::loadu(x + i, k));
        if (bias) z = z + V::loadu(bias + c0 + i, k);
        z.store(z_saved + i, k);
        CpuAct<A>::template forward<T, M>(z).store(out + i, k);
      }
      store_math(out, static_cast<T*>(a.out) + row + c0, n);
      if (a.saved_z) store_math(z_saved, static_cast<T*>(a.saved_z) + row + c0, n);
      if (a.mask) {
        uint8_t* mask = a.mask + r * mask_row_bytes + c0 / 8;
        for (int64_t g = 0; g * 8 < n; ++g) {
          uint8_t bits = 0;
          for (int64_t j = 0; j < 8 && g * 8 + j < n; ++j) bits |= static_cast<uint8_t>(z_saved[g * 8 + j] > M(0)) << j;
          mask[g] = bits;
        }
      }
    }
  }
}

// Rows r0..r1 of the backward; the bias gradient's partial sums over those rows (M, cols long) written
// to bias_acc (the first row's gradient stored, the others added).
template <typename T, Activation A>
void backward_rows(const CpuBackwardArgs& a, int64_t r0, int64_t r1, typename at::opmath_type<T>* bias_acc) {
  using M = at::opmath_type<T>;
  using V = Vec<M>;
  constexpr int64_t W = V::size();
  const V alpha(static_cast<M>(a.alpha));
  const int64_t cols = a.cols, mask_row_bytes = (cols + 7) / 8;
  alignas(64) M gob[kTile], zb[kTile], db[kTile], gxb[kTile], gyb[kTile];
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t row = r * cols;
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t n = std::min(kTile, cols - c0);
      const M* go = as_math(static_cast<const T*>(a.grad_out) + row + c0, gob, n);
      const M* d = nullptr;
      if (a.mask) {
        const uint8_t* mask = a.mask + r * mask_row_bytes + c0 / 8;
        for (int64_t i = 0; i < n; ++i) db[i] = static_cast<M>((mask[i / 8] >> (i % 8)) & 1);
        d = db;
      } else {
        d = as_math(static_cast<const T*>(a.saved_z) + row + c0, zb, n);
      }
      M* gx = math_dst(static_cast<T*>(a.grad_x) + row + c0, gxb);
      M* gy = a.grad_y ? math_dst(static_cast<T*>(a.grad_y) + row + c0, gyb) : nullptr;
      for (int64_t i = 0; i < n; i += W) {
        const int64_t k = std::min(W, n - i);
        const V dv = a.mask ? V::loadu(d + i, k) : CpuAct<A>::template derivative<T, M>(V::loadu(d + i, k));
        const V g = V::loadu(go + i, k) * dv;
        g.store(gx + i, k);
        if (gy) (alpha * g).store(gy + i, k);
        if (bias_acc) (r == r0 ? g : V::loadu(bias_acc + c0 + i, k) + g).store(bias_acc + c0 + i, k);
      }
      store_math(gx, static_cast<T*>(a.grad_x) + row + c0, n);
      if (gy) store_math(gy, static_cast<T*>(a.grad_y) + row + c0, n);
    }
  }
}

template <typename T, Activation A>
void forward_typed(const CpuForwardArgs& a) {
  using M = at::opmath_type<T>;
  Buffer<M> bias(a.bias ? a.cols : 0);
  for (int64_t c = 0; a.bias && c < a.cols; ++c) bias.data()[c] = static_cast<M>(static_cast<const T*>(a.bias)[c]);
  const M* b = a.bias ? bias.data() : nullptr;
  const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, a.cols));
  at::parallel_for(0, a.rows, grain, [&](int64_t r0, int64_t r1) { forward_rows<T, A>(a, b, r0, r1); });
}

template <typename T, Activation A>
void backward_typed(const CpuBackwardArgs& a) {
  using M = at::opmath_type<T>;
  if (!a.grad_bias) {
    const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, a.cols));
    at::parallel_for(0, a.rows, grain, [&](int64_t r0, int64_t r1) { backward_rows<T, A>(a, r0, r1, nullptr); });
    return;
  }
  const int64_t blocks = std::min(a.rows, kBiasBlocks);
  const int64_t rows_per_block = blocks ? (a.rows + blocks - 1) / blocks : 0;
  // Blocks that hold rows (ceil(rows / rows_per_block) <= blocks); each writes its whole partial row.
  const int64_t used = rows_per_block ? (a.rows + rows_per_block - 1) / rows_per_block : 0;
  M* partial = thread_scratch<M>(blocks * a.cols);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * rows_per_block, r1 = std::min(a.rows, r0 + rows_per_block);
      if (r0 < r1) backward_rows<T, A>(a, r0, r1, partial + b * a.cols);
    }
  });
  // Over the blocks in order, a vector of columns at a time (a column at a time was a chain of
  // dependent scalar adds: 40 us at 512 columns). The same sum, element for element.
  T* gb = static_cast<T*>(a.grad_bias);
  at::parallel_for(0, a.cols, 1024, [&](int64_t c0, int64_t c1) {
    using V = Vec<M>;
    constexpr int64_t W = V::size();
    alignas(64) M buf[W];
    for (int64_t c = c0; c < c1; c += W) {
      const int64_t k = std::min(W, c1 - c);
      V s(M(0));
      for (int64_t b = 0; b < used; ++b) s = s + V::loadu(partial + b * a.cols + c, k);
      s.store(buf, k);
      for (int64_t j = 0; j < k; ++j) gb[c + j] = static_cast<T>(buf[j]);
    }
  });
}

}  // namespace

void forward(const CpuForwardArgs& a) {
  if (a.rows == 0 || a.cols == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.dtype, "add_mul_act_cpu", [&] {
    FUSEFORGE_ACTIVATION_SWITCH(a.act, kAct, [&] { forward_typed<scalar_t, kAct>(a); });
  });
}

void backward(const CpuBackwardArgs& a) {
  if (a.cols == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.dtype, "add_mul_act_bwd_cpu", [&] {
    FUSEFORGE_ACTIVATION_SWITCH(a.act, kAct, [&] { backward_typed<scalar_t, kAct>(a); });
  });
}

}  // namespace fuseforge::add_mul_act::FUSEFORGE_CPU_NS
