// glu's vectorized CPU kernels, compiled once per CPU build (common/cpu_isa.h): one pass over memory
// per call, each element act(gate) * up in the math type M (float; double for float64) with
// at::vec::Vectorized<M>, the activations of common/cpu_activation.h, 16-bit types converted a
// 256-column tile at a time. Rows are split across threads.
#pragma once
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>

#include "common/cpu_activation.h"
#include "common/cpu_vec.h"
#include "common/cpu_vec_tile.h"
#include "glu/glu_cpu.h"

namespace fuseforge::glu::FUSEFORGE_CPU_NS {
namespace {

template <typename M>
using Vec = CpuVec<M>;

constexpr int64_t kTile = kCpuTile;
// Elements a task at least: below this, threads cost more than they save.
constexpr int64_t kGrainElems = 1 << 15;

int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, cols)); }

template <typename T, Activation A>
void forward_typed(const CpuForwardArgs& a) {
  using M = at::opmath_type<T>;
  using V = Vec<M>;
  constexpr int64_t W = V::size();
  const T* gate = static_cast<const T*>(a.gate);
  const T* up = static_cast<const T*>(a.up);
  T* out = static_cast<T*>(a.out);
  const int64_t cols = a.cols;
  at::parallel_for(0, a.rows, grain_rows(cols), [&](int64_t r0, int64_t r1) {
    alignas(64) M gb[kTile], ub[kTile], ob[kTile];
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
        const int64_t n = std::min(kTile, cols - c0);
        const M* g = tile_to_math(gate + r * a.gate_row_stride + c0, gb, n);
        const M* u = tile_to_math(up + r * a.up_row_stride + c0, ub, n);
        T* o_dst = out + r * cols + c0;
        M* o = math_dst(o_dst, ob);
        int64_t i = 0;
        for (; i + W <= n; i += W) (CpuAct<A>::template forward<T, M>(V::loadu(g + i)) * V::loadu(u + i)).store(o + i);
        if (i < n) {
          const int64_t k = n - i;
          (CpuAct<A>::template forward<T, M>(V::loadu(g + i, k)) * V::loadu(u + i, k)).store(o + i, k);
        }
        tile_from_math(o, o_dst, n);
      }
    }
  });
}

template <typename T, Activation A>
void backward_typed(const CpuBackwardArgs& a) {
  using M = at::opmath_type<T>;
  using V = Vec<M>;
  constexpr int64_t W = V::size();
  const T* grad_out = static_cast<const T*>(a.grad_out);
  const T* gate = static_cast<const T*>(a.gate);
  const T* up = static_cast<const T*>(a.up);
  T* grad_gate = static_cast<T*>(a.grad_gate);
  T* grad_up = static_cast<T*>(a.grad_up);
  const int64_t cols = a.cols;
  at::parallel_for(0, a.rows, grain_rows(cols), [&](int64_t r0, int64_t r1) {
    alignas(64) M gob[kTile], gb[kTile], ub[kTile], ggb[kTile], gub[kTile];
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
        const int64_t n = std::min(kTile, cols - c0);
        const M* go = tile_to_math(grad_out + r * a.grad_out_row_stride + c0, gob, n);
        const M* g = tile_to_math(gate + r * a.gate_row_stride + c0, gb, n);
        const M* u = tile_to_math(up + r * a.up_row_stride + c0, ub, n);
        T* gg_dst = grad_gate + r * a.grad_gate_row_stride + c0;
        T* gu_dst = grad_up + r * a.grad_up_row_stride + c0;
        M* gg = math_dst(gg_dst, ggb);
        M* gu = math_dst(gu_dst, gub);
        for (int64_t i = 0; i < n; i += W) {
          const int64_t k = std::min<int64_t>(V::size(), n - i);
          const V grad = V::loadu(go + i, k);
          V f, d;
          CpuAct<A>::template both<T, M>(V::loadu(g + i, k), f, d);
          (grad * V::loadu(u + i, k) * d).store(gg + i, k);
          (grad * f).store(gu + i, k);
        }
        tile_from_math(gg, gg_dst, n);
        tile_from_math(gu, gu_dst, n);
      }
    }
  });
}

// glu's activations only (glu.h's FUSEFORGE_GLU_ACTIVATION_SWITCH; glu.h itself brings all of ATen,
// which the per-ISA builds keep out).
template <typename F>
void activation_switch(Activation act, F&& f) {
  switch (act) {
    case Activation::kGelu: return f(std::integral_constant<Activation, Activation::kGelu>{});
    case Activation::kGeluTanh: return f(std::integral_constant<Activation, Activation::kGeluTanh>{});
    default: return f(std::integral_constant<Activation, Activation::kSilu>{});
  }
}

}  // namespace

void forward(const CpuForwardArgs& a) {
  if (a.rows == 0 || a.cols == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.dtype, "glu_fwd_cpu", [&] {
    activation_switch(a.act, [&](auto act) { forward_typed<scalar_t, decltype(act)::value>(a); });
  });
}

void backward(const CpuBackwardArgs& a) {
  if (a.rows == 0 || a.cols == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.dtype, "glu_bwd_cpu", [&] {
    activation_switch(a.act, [&](auto act) { backward_typed<scalar_t, decltype(act)::value>(a); });
  });
}

}  // namespace fuseforge::glu::FUSEFORGE_CPU_NS
