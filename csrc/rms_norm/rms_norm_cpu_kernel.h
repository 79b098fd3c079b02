// rms_norm's (and layer_norm's: kCentered) vectorized CPU kernels, compiled once per CPU build
// (common/cpu_isa.h). A row's sum of squares (and the backward's dot product; LayerNorm's row sum, then
// its sum of squared deviations) goes into 256 bytes of lanes (64 floats, 32 doubles)
// by element index, whatever the vector width, and the lanes are added in a fixed tree: the same
// result in every build, and far closer to the exact sum than one sequential float sum. Elementwise
// arithmetic in the math type M (float; double for float64), 16-bit types converted a 256-column
// tile at a time. Rows are split across threads; the weight gradient is summed in a fixed number of
// row blocks and then over the blocks in order, so it does not depend on the thread count.
#pragma once
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "common/cpu_vec.h"
#include "common/cpu_vec_tile.h"
#include "rms_norm/rms_norm_cpu.h"

namespace fuseforge::rms_norm::FUSEFORGE_CPU_NS {
namespace {

template <typename M>
using Vec = CpuVec<M>;

constexpr int64_t kTile = kCpuTile;
static_assert(kTile % LaneSum<float>::kLanes == 0 && kTile % LaneSum<double>::kLanes == 0,
              "a tile must hold whole sets of lanes");
// Elements a task at least: below this, threads cost more than they save.
constexpr int64_t kGrainElems = 1 << 15;
// Row blocks of the weight gradient's partial sums (a constant, so the sum's order is too).
constexpr int64_t kWeightGradBlocks = 64;

int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, cols)); }

// Rows of up to kBatchedCols columns go kRowBatch at a time, each step over all of them before the
// next (sums, statistics, outputs): a row's reduction ends in a chain of dependent operations (the
// lanes' tree, a division, a square root) that would otherwise hold up the row's output pass, and
// the batch's chains overlap.
constexpr int64_t kRowBatch = 4;
constexpr int64_t kBatchedCols = 1024;
int64_t row_batch(int64_t cols) { return cols <= kBatchedCols ? kRowBatch : 1; }

// weight_offset + weight in M (cols of them), or nullptr without a weight.
template <typename T, typename M>
const M* scale_of(const void* weight, c10::ScalarType weight_dtype, double weight_offset, int64_t cols, M* buf) {
  if (!weight) return nullptr;
  const M offset = static_cast<M>(weight_offset);
  if (weight_dtype == c10::ScalarType::Float) {
    const float* w = static_cast<const float*>(weight);
    for (int64_t c = 0; c < cols; ++c) buf[c] = offset + static_cast<M>(w[c]);
  } else {
    const T* w = static_cast<const T*>(weight);
    for (int64_t c = 0; c < cols; ++c) buf[c] = offset + static_cast<M>(w[c]);
  }
  return buf;
}

// LayerNorm's bias in M (cols of them), or nullptr without one.
template <typename T, typename M>
const M* bias_of(const void* bias, c10::ScalarType bias_dtype, int64_t cols, M* buf) {
  return scale_of<T, M>(bias, bias_dtype, 0.0, cols, buf);
}

// 1 / sqrt(mean + eps), the mean of the row's squares from their sum (as the scalar reference did).
template <typename M>
M rstd_of(M sumsq, int64_t cols, M eps) {
  return M(1) / std::sqrt(static_cast<M>(static_cast<double>(sumsq) / static_cast<double>(cols)) + eps);
}

template <typename T, typename To, bool kCentered>
void forward_typed(const CpuForwardArgs& a) {
  using M = at::opmath_type<T>;
  using V = Vec<M>;
  using Lanes = LaneSum<M>;
  constexpr int64_t W = V::size();
  const int64_t cols = a.cols;
  Buffer<M> scale_buf(a.weight ? cols : 0), bias_buf(a.bias ? cols : 0);
  const M* scale = scale_of<T, M>(a.weight, a.weight_dtype, a.weight_offset, cols, scale_buf.data());
  const M* bias = bias_of<T, M>(a.bias, a.bias_dtype, cols, bias_buf.data());
  M* mean_out = static_cast<M*>(a.mean);
  const T* x = static_cast<const T*>(a.x);
  const T* res = static_cast<const T*>(a.residual);
  T* h_out = static_cast<T*>(a.residual_out);
  To* out = static_cast<To*>(a.out);
  M* rstd = static_cast<M*>(a.rstd);
  const M eps = static_cast<M>(a.eps);
  at::parallel_for(0, a.rows, grain_rows(cols), [&](int64_t r0, int64_t r1) {
    alignas(64) M xb[kTile], rb[kTile], ob[kTile];
    const int64_t batch = row_batch(cols);
    // 16-bit types: the batch's rows of h in M, converted once for every pass.
    M* hbatch_math = std::is_same_v<T, M> ? nullptr : thread_scratch<M>(batch * cols);
    for (int64_t b0 = r0; b0 < r1; b0 += batch) {
      const int64_t batch_rows = std::min(batch, r1 - b0);
      M total[kRowBatch], mu[kRowBatch] = {}, rs[kRowBatch];
      // Each row's h and its first sum: of squares (RMSNorm), or of h (LayerNorm).
      for (int64_t j = 0; j < batch_rows; ++j) {
        const int64_t base = (b0 + j) * cols;
        M* hrow_math = hbatch_math ? hbatch_math + j * cols : nullptr;
        Lanes acc;
        for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
          const int64_t n = std::min(kTile, cols - c0);
          const M* h;
          if (res) {
            // h rounded to T, as the unfused `residual + x` is, before it is squared.
            const M* xv = tile_to_math(x + base + c0, xb, n);
            const M* rv = tile_to_math(res + base + c0, rb, n);
            M* hv = math_dst(h_out + base + c0, hrow_math + c0);
            for (int64_t i = 0; i < n; i += W) {
              const int64_t k = std::min<int64_t>(V::size(), n - i);
              (V::loadu(xv + i, k) + V::loadu(rv + i, k)).store(hv + i, k);
            }
            tile_from_math(hv, h_out + base + c0, n);
            h = tile_to_math(h_out + base + c0, hrow_math + c0, n);
          } else {
            h = tile_to_math(x + base + c0, hrow_math + c0, n);
          }
          acc.add_tile(n, [&](int64_t i, int64_t k) {
            const V v = V::loadu(h + i, k);
            return kCentered ? v : v * v;
          });
        }
        total[j] = acc.total();
      }
      if constexpr (kCentered) {
        // The variance from the deviations (a second pass over the row: exact where mean >> std).
        for (int64_t j = 0; j < batch_rows; ++j) {
          const int64_t base = (b0 + j) * cols;
          const M* hrow_math = hbatch_math ? hbatch_math + j * cols : nullptr;
          const T* hrow = h_out ? h_out + base : x + base;
          mu[j] = static_cast<M>(static_cast<double>(total[j]) / static_cast<double>(cols));
          const V muv(mu[j]), zero(M(0));
          Lanes sumsq;
          for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
            const int64_t n = std::min(kTile, cols - c0);
            const M* h = hrow_math ? hrow_math + c0 : tile_to_math(hrow + c0, xb, n);
            sumsq.add_tile(n, [&](int64_t i, int64_t k) {
              const V d = V::set(zero, V::loadu(h + i, k) - muv, k);  // lanes past k: 0, not -mean
              return d * d;
            });
          }
          total[j] = sumsq.total();
          if (mean_out) mean_out[b0 + j] = mu[j];
        }
      }
      for (int64_t j = 0; j < batch_rows; ++j) {
        rs[j] = rstd_of(total[j], cols, eps);
        if (rstd) rstd[b0 + j] = rs[j];
      }
      for (int64_t j = 0; j < batch_rows; ++j) {
        const int64_t base = (b0 + j) * cols;
        const M* hrow_math = hbatch_math ? hbatch_math + j * cols : nullptr;
        const T* hrow = h_out ? h_out + base : x + base;
        const V rsv(rs[j]), muv(mu[j]);
        for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
          const int64_t n = std::min(kTile, cols - c0);
          const M* h = hrow_math ? hrow_math + c0 : tile_to_math(hrow + c0, xb, n);
          To* o_dst = out + base + c0;
          M* o = math_dst(o_dst, ob);
          for (int64_t i = 0; i < n; i += W) {
            const int64_t k = std::min<int64_t>(V::size(), n - i);
            const V xhat = kCentered ? (V::loadu(h + i, k) - muv) * rsv : V::loadu(h + i, k) * rsv;
            V v = scale ? xhat * V::loadu(scale + c0 + i, k) : xhat;
            if (kCentered && bias) v = v + V::loadu(bias + c0 + i, k);
            v.store(o + i, k);
          }
          tile_from_math(o, o_dst, n);
        }
      }
    }
  });
}

// Rows r0..r1 of the backward; with dw / db, their weight / bias gradient added to it (M, cols long).
// LayerNorm (kCentered): xhat = (h - mean) * rstd and grad = rstd * (g s - mean(g s) - xhat * mean(g s
// xhat)); RMSNorm: xhat = h * rstd and grad = rstd * (g s - xhat * mean(g s xhat)).
template <typename T, typename To, bool kCentered>
void backward_rows(const CpuBackwardArgs& a, const at::opmath_type<T>* scale, int64_t r0, int64_t r1,
                   at::opmath_type<T>* dw, at::opmath_type<T>* db) {
  using M = at::opmath_type<T>;
  using V = Vec<M>;
  using Lanes = LaneSum<M>;
  constexpr int64_t W = V::size();
  const int64_t cols = a.cols;
  const To* grad_out = static_cast<const To*>(a.grad_out);
  const T* grad_res = static_cast<const T*>(a.grad_residual_out);
  const T* hp = static_cast<const T*>(a.h);
  const M* rstd = static_cast<const M*>(a.rstd);
  const M* row_mean = static_cast<const M*>(a.mean);
  T* grad_input = static_cast<T*>(a.grad_input);
  alignas(64) M gob[kTile], hb[kTile], grb[kTile], gib[kTile];
  const int64_t batch = row_batch(cols);
  for (int64_t b0 = r0; b0 < r1; b0 += batch) {
    const int64_t batch_rows = std::min(batch, r1 - b0);
    M dot_mean[kRowBatch], g_mean[kRowBatch] = {};
    // Each row's mean(g s xhat) (and LayerNorm's mean(g s)); the weight and bias gradients' terms.
    for (int64_t j = 0; j < batch_rows; ++j) {
      const int64_t r = b0 + j, base = r * cols;
      const V rs(rstd[r]);
      const V mu(kCentered ? row_mean[r] : M(0));
      Lanes dot, gsum;
      for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
        const int64_t n = std::min(kTile, cols - c0);
        const M* go = tile_to_math(grad_out + base + c0, gob, n);
        const M* h = tile_to_math(hp + base + c0, hb, n);
        dot.add_tile(n, [&](int64_t i, int64_t k) {
          const V g = V::loadu(go + i, k);
          const V xhat = kCentered ? (V::loadu(h + i, k) - mu) * rs : V::loadu(h + i, k) * rs;
          if (dw) (V::loadu(dw + c0 + i, k) + g * xhat).store(dw + c0 + i, k);
          if (kCentered && db) (V::loadu(db + c0 + i, k) + g).store(db + c0 + i, k);
          const V gw = scale ? g * V::loadu(scale + c0 + i, k) : g;
          return gw * xhat;  // 0 past k (g is)
        });
        if constexpr (kCentered) {
          gsum.add_tile(n, [&](int64_t i, int64_t k) {
            const V g = V::loadu(go + i, k);
            return scale ? g * V::loadu(scale + c0 + i, k) : g;
          });
        }
      }
      dot_mean[j] = static_cast<M>(static_cast<double>(dot.total()) / static_cast<double>(cols));
      if constexpr (kCentered)
        g_mean[j] = static_cast<M>(static_cast<double>(gsum.total()) / static_cast<double>(cols));
    }
    for (int64_t j = 0; j < batch_rows; ++j) {
      const int64_t r = b0 + j, base = r * cols;
      const V rs(rstd[r]);
      const V mu(kCentered ? row_mean[r] : M(0));
      const V mean(dot_mean[j]), gmean(g_mean[j]);
      for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
        const int64_t n = std::min(kTile, cols - c0);
        const M* go = tile_to_math(grad_out + base + c0, gob, n);
        const M* h = tile_to_math(hp + base + c0, hb, n);
        const M* gr = grad_res ? tile_to_math(grad_res + base + c0, grb, n) : nullptr;
        T* gi_dst = grad_input + base + c0;
        M* gi = math_dst(gi_dst, gib);
        for (int64_t i = 0; i < n; i += W) {
          const int64_t k = std::min<int64_t>(V::size(), n - i);
          const V g = V::loadu(go + i, k);
          const V xhat = kCentered ? (V::loadu(h + i, k) - mu) * rs : V::loadu(h + i, k) * rs;
          const V gw = scale ? g * V::loadu(scale + c0 + i, k) : g;
          V v = kCentered ? rs * (gw - gmean - xhat * mean) : rs * (gw - xhat * mean);
          if (gr) v = v + V::loadu(gr + i, k);
          v.store(gi + i, k);
        }
        tile_from_math(gi, gi_dst, n);
      }
    }
  }
}

template <typename T, typename To, bool kCentered>
void backward_typed(const CpuBackwardArgs& a) {
  using M = at::opmath_type<T>;
  using V = Vec<M>;
  constexpr int64_t W = V::size();
  const int64_t cols = a.cols;
  Buffer<M> scale_buf(a.weight ? cols : 0);
  const M* scale = scale_of<T, M>(a.weight, a.weight_dtype, a.weight_offset, cols, scale_buf.data());
  const bool want_bias = kCentered && a.grad_bias;
  if (!a.grad_weight && !want_bias) {
    at::parallel_for(0, a.rows, grain_rows(cols), [&](int64_t r0, int64_t r1) {
      backward_rows<T, To, kCentered>(a, scale, r0, r1, nullptr, nullptr);
    });
    return;
  }
  const int64_t blocks = std::min(a.rows, kWeightGradBlocks);
  const int64_t rows_per_block = (a.rows + blocks - 1) / blocks;
  const int64_t used = (a.rows + rows_per_block - 1) / rows_per_block;  // blocks that hold rows
  // Each block's partial rows: the weight's (used x cols), then the bias's.
  M* partial = thread_scratch<M>(2 * used * cols);
  M* bias_partial = partial + used * cols;
  const int64_t grain_blocks = std::max<int64_t>(1, kGrainElems / (rows_per_block * cols));
  at::parallel_for(0, used, grain_blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      M* dw = a.grad_weight ? partial + b * cols : nullptr;
      M* db = want_bias ? bias_partial + b * cols : nullptr;
      if (dw) fill(dw, cols, M(0));
      if (db) fill(db, cols, M(0));
      backward_rows<T, To, kCentered>(a, scale, b * rows_per_block, std::min(a.rows, (b + 1) * rows_per_block), dw,
                                      db);
    }
  });
  // Over the blocks in order (deterministic), a vector of columns at a time; store(c, k, values).
  auto sum_blocks = [&](const M* parts, auto&& store) {
    at::parallel_for(0, cols, 1024, [&](int64_t c0, int64_t c1) {
      alignas(64) M buf[W];
      for (int64_t c = c0; c < c1; c += W) {
        const int64_t k = std::min<int64_t>(V::size(), c1 - c);
        V s(M(0));
        for (int64_t b = 0; b < used; ++b) s = s + V::loadu(parts + b * cols + c, k);
        s.store(buf, k);
        store(c, k, buf);
      }
    });
  };
  // A gradient in its parameter's dtype: T or float32.
  auto store_in = [](c10::ScalarType dtype, void* out) {
    return [dtype, out](int64_t c, int64_t k, const M* buf) {
      if (dtype == c10::ScalarType::Float) {
        float* o = static_cast<float*>(out);
        for (int64_t j = 0; j < k; ++j) o[c + j] = static_cast<float>(buf[j]);
      } else {
        T* o = static_cast<T*>(out);
        for (int64_t j = 0; j < k; ++j) o[c + j] = static_cast<T>(buf[j]);
      }
    };
  };
  if (a.grad_weight) sum_blocks(partial, store_in(a.weight_dtype, a.grad_weight));
  if (want_bias) sum_blocks(bias_partial, store_in(a.bias_dtype, a.grad_bias));
}

// Calls f(T{}, To{}) for the (input, output) dtype pairs the op takes: the input's, or bf16/fp16
// out of a float32 input.
template <typename F>
void dispatch_types(c10::ScalarType in, c10::ScalarType out, F&& f) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in, "rms_norm_cpu", [&] {
    using in_t = scalar_t;
    if constexpr (std::is_same_v<in_t, float>) {
      AT_DISPATCH_SWITCH(out, "rms_norm_cpu_out", AT_DISPATCH_CASE(at::kFloat, [&] { f(in_t{}, scalar_t{}); })
                                        AT_DISPATCH_CASE(at::kBFloat16, [&] { f(in_t{}, scalar_t{}); })
                                            AT_DISPATCH_CASE(at::kHalf, [&] { f(in_t{}, scalar_t{}); }));
    } else {
      TORCH_CHECK(out == in, "rms_norm_cpu: out dtype ", out, " for input ", in);
      f(in_t{}, in_t{});
    }
  });
}

}  // namespace

void forward(const CpuForwardArgs& a) {
  if (a.rows == 0 || a.cols == 0) return;
  dispatch_types(a.dtype, a.out_dtype, [&](auto in, auto out) {
    if (a.centered) {
      forward_typed<decltype(in), decltype(out), true>(a);
    } else {
      forward_typed<decltype(in), decltype(out), false>(a);
    }
  });
}

void backward(const CpuBackwardArgs& a) {
  if (a.rows == 0 || a.cols == 0) return;
  dispatch_types(a.dtype, a.grad_out_dtype, [&](auto in, auto out) {
    if (a.mean) {
      backward_typed<decltype(in), decltype(out), true>(a);
    } else {
      backward_typed<decltype(in), decltype(out), false>(a);
    }
  });
}

}  // namespace fuseforge::rms_norm::FUSEFORGE_CPU_NS
