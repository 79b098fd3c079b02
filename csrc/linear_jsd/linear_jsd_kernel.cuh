// linear_jsd device code: one block a row of the student's and the teacher's float32 logits.
//  (1) one pass: each thread's running (max, sum exp) of s / T and t / T, merged across the block,
//      give both log-sum-exps (and the raw logits at the student's maximum);
//  (2) the row's divergence from log Q = s / T - lse_s and log P = t / T - lse_t (and log M from the
//      larger of the two, so no probability needs to be representable), with, for the reverse KL
//      and the JSD, sum(u) of u = Q (g - g_ref), g = d loss / d Q up to a constant and g_ref its
//      value at the student's argmax; the forward KL writes dz = (Q - P) / T here;
//  (3) reverse KL and JSD: dz = (u - Q sum(u)) / T, u and Q recomputed from the logits.
// The softmax Jacobian is applied as Q (g - g_ref - sum(Q (g - g_ref))): the argmax's own term is
// exactly 0 (g_ref comes from the same code on the same logits), so a nearly one-hot Q's vanishing
// gradients are not swamped by the rounding of sum(Q g) against the argmax's g.
// Float32 arithmetic; kVec: 16-byte loads of 4 logits and 4-element dz stores (vocab % 4 == 0,
// aligned rows), otherwise one element at a time.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/launch.cuh"
#include "common/vec.cuh"
#include "linear_jsd/linear_jsd_launch.h"

namespace fuseforge::linear_jsd {

constexpr int kRowWarps = kRowThreads / 32;

// (m, s) := the merge of two running (max, sum exp(z - max)); (-inf, 0) is empty.
__device__ __forceinline__ void merge_lse(float& m, float& s, float om, float os) {
  const float nm = fmaxf(m, om);
  if (nm == -INFINITY) return;
  s = s * __expf(m - nm) + os * __expf(om - nm);
  m = nm;
}

// The student's running (max, sum) with the raw logits (student's, teacher's) at that maximum, and
// the teacher's (max, sum).
struct RowStats {
  float ms, ss, ref_s, ref_t, mt, st;
};

__device__ __forceinline__ void merge_stats(RowStats& a, const RowStats& b) {
  if (b.ms > a.ms) a.ref_s = b.ref_s, a.ref_t = b.ref_t;
  merge_lse(a.ms, a.ss, b.ms, b.ss);
  merge_lse(a.mt, a.st, b.mt, b.st);
}

__device__ __forceinline__ RowStats shfl_xor_stats(const RowStats& v, int o) {
  RowStats r;
  r.ms = __shfl_xor_sync(0xffffffffu, v.ms, o);
  r.ss = __shfl_xor_sync(0xffffffffu, v.ss, o);
  r.ref_s = __shfl_xor_sync(0xffffffffu, v.ref_s, o);
  r.ref_t = __shfl_xor_sync(0xffffffffu, v.ref_t, o);
  r.mt = __shfl_xor_sync(0xffffffffu, v.mt, o);
  r.st = __shfl_xor_sync(0xffffffffu, v.st, o);
  return r;
}

// The threads' statistics merged over the block, in the same order for every thread.
__device__ __forceinline__ RowStats block_stats(RowStats v) {
  __shared__ RowStats scratch[kRowWarps];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) merge_stats(v, shfl_xor_stats(v, o));
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  RowStats r = scratch[0];
#pragma unroll
  for (int w = 1; w < kRowWarps; ++w) merge_stats(r, scratch[w]);
  return r;
}

// Two sums over the block; every thread gets them (in the same order: deterministic).
__device__ __forceinline__ void block_sum2(float& a, float& b) {
  __shared__ float scratch[2][kRowWarps];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, o);
    b += __shfl_xor_sync(0xffffffffu, b, o);
  }
  if (threadIdx.x % 32 == 0) {
    scratch[0][threadIdx.x / 32] = a;
    scratch[1][threadIdx.x / 32] = b;
  }
  __syncthreads();
  a = 0.f, b = 0.f;
#pragma unroll
  for (int w = 0; w < kRowWarps; ++w) {
    a += scratch[0][w];
    b += scratch[1][w];
  }
}

template <int N>
__device__ __forceinline__ void load_logits(const float* src, float (&v)[N]) {
  if constexpr (N == 4) {
    const AlignedVector<float, 4> pk = load_vector<float, 4>(src);
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = pk.val[k];
  } else {
    v[0] = *src;
  }
}

template <typename T, int N>
__device__ __forceinline__ void store_grads(T* dst, const float (&v)[N]) {
  if constexpr (N == 4) {
    AlignedVector<T, 4> pk;
#pragma unroll
    for (int k = 0; k < 4; ++k) pk.val[k] = static_cast<T>(v[k]);
    store_vector<T, 4>(dst, pk);
  } else {
    *dst = static_cast<T>(v[0]);
  }
}

// The reverse KL's (kMode 1) and the JSD's (kMode 2) per-logit pieces: Q, g = d loss / d Q up to a
// constant, and the loss term. log M = max + log(w_big + w_small exp(-|lp - lq|)).
//   reverse KL: loss = Q (log Q - log P), g = log Q - log P;
//   JSD: loss = beta P (log P - log M) + Q g, g = (1 - beta) (log Q - log M).
template <int kMode>
__device__ __forceinline__ void divergence_terms(float lq, float lp, float beta, float& q, float& g, float& loss) {
  q = __expf(lq);
  if constexpr (kMode == 1) {
    g = lq - lp;
    loss = q * g;
  } else {
    const float d = lp - lq;
    const float e = __expf(-fabsf(d));
    const float lm = fmaxf(lp, lq) + logf(d >= 0.f ? fmaf(1.f - beta, e, beta) : fmaf(beta, e, 1.f - beta));
    g = (1.f - beta) * (lq - lm);
    loss = beta * __expf(lp) * (lp - lm) + q * g;
  }
}

// kMode: 0 forward KL, 1 reverse KL, 2 JSD.
template <typename T, int kMode, bool kVec>
__device__ void row_body(const RowParams<T>& p, int64_t row) {
  constexpr int N = kVec ? 4 : 1;
  const int tid = threadIdx.x;
  const int64_t vocab = p.vocab;
  const float* srow = p.student + row * p.ld;
  const float* trow = p.teacher + row * p.ld;
  T* drow = p.dz != nullptr ? p.dz + row * p.ld_dz : nullptr;
  if (p.target != nullptr && p.target[row] == p.ignore_index) {  // no loss, no gradient, no arithmetic
    if (tid == 0 && p.loss_out) p.loss_out[row] = 0.f;
    if (drow)
      for (int64_t c = tid; c < vocab; c += kRowThreads) drow[c] = static_cast<T>(0.f);
    return;
  }
  const float it = p.inv_temperature;

  // (1) running (max, sum exp) of both rows.
  RowStats v{-INFINITY, 0.f, 0.f, 0.f, -INFINITY, 0.f};
  for (int64_t c = int64_t{tid} * N; c < vocab; c += int64_t{kRowThreads} * N) {
    float s[N], t[N];
    load_logits<N>(srow + c, s);
    load_logits<N>(trow + c, t);
    float bs = -INFINITY, bt = -INFINITY, cs = 0.f, ct = 0.f;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float sk = s[k] * it;
      if (sk > bs) bs = sk, cs = s[k], ct = t[k];
      bt = fmaxf(bt, t[k] * it);
    }
    if (bs > v.ms) {  // (the first maximum is kept: strict)
      v.ss *= __expf(v.ms - bs);
      v.ms = bs;
      v.ref_s = cs;
      v.ref_t = ct;
    }
    if (bt > v.mt) {
      v.st *= __expf(v.mt - bt);
      v.mt = bt;
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
      v.ss += __expf(s[k] * it - v.ms);
      v.st += __expf(t[k] * it - v.mt);
    }
  }
  const RowStats stats = block_stats(v);
  const float lse_s = stats.ms + logf(stats.ss);
  const float lse_t = stats.mt + logf(stats.st);

  float scale = it;
  if (drow) {
    if (p.row_scale) scale *= p.row_scale[row];
    if (p.scalar_scale) scale *= *p.scalar_scale;
  }
  const float beta = p.beta;
  float g_ref = 0.f;
  if constexpr (kMode != 0) {
    float q, l;
    divergence_terms<kMode>(fmaf(stats.ref_s, it, -lse_s), fmaf(stats.ref_t, it, -lse_t), beta, q, g_ref, l);
  }

  // (2) the divergence (and the forward KL's gradient), sum(u).
  float loss = 0.f, usum = 0.f;
  for (int64_t c = int64_t{tid} * N; c < vocab; c += int64_t{kRowThreads} * N) {
    float s[N], t[N], dz[N];
    load_logits<N>(srow + c, s);
    load_logits<N>(trow + c, t);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float lq = fmaf(s[k], it, -lse_s);
      const float lp = fmaf(t[k], it, -lse_t);
      if constexpr (kMode == 0) {
        const float pk = __expf(lp);
        loss += pk * (lp - lq);
        dz[k] = (__expf(lq) - pk) * scale;
      } else {
        float q, g, l;
        divergence_terms<kMode>(lq, lp, beta, q, g, l);
        loss += l;
        usum += q * (g - g_ref);
      }
    }
    if constexpr (kMode == 0) {
      if (drow) store_grads<T, N>(drow + c, dz);
    }
  }
  block_sum2(loss, usum);
  if (tid == 0 && p.loss_out) p.loss_out[row] = loss;
  if constexpr (kMode != 0) {
    if (drow == nullptr) return;
    // (3) dz = (u - Q sum(u)) / T, times the row's weight.
    for (int64_t c = int64_t{tid} * N; c < vocab; c += int64_t{kRowThreads} * N) {
      float s[N], t[N], dz[N];
      load_logits<N>(srow + c, s);
      load_logits<N>(trow + c, t);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        float q, g, l;
        divergence_terms<kMode>(fmaf(s[k], it, -lse_s), fmaf(t[k], it, -lse_t), beta, q, g, l);
        dz[k] = (q * (g - g_ref) - q * usum) * scale;
      }
      store_grads<T, N>(drow + c, dz);
    }
  }
}

template <typename T, int kMode, bool kVec>
__global__ void __launch_bounds__(kRowThreads) rows_kernel(const RowParams<T> p) {
  row_body<T, kMode, kVec>(p, blockIdx.x);
}

}  // namespace fuseforge::linear_jsd
