// linear_cross_entropy device code: the row softmax over the logits that cuBLAS wrote (float32, or
// bf16 for bf16 inputs on the cluster path). It produces per-row log-sum-exp and loss and, when
// asked, the logit gradients (dz) in the input dtype for the two gradient matrix products.
//
// Two kernels:
//  - row_softmax_cluster_kernel: a cluster of 8 CTAs holds one whole row in registers (up to
//    8 * 512 * 64 = 262144 logits), so the logits are read once: statistics, cluster exchange of
//    (max, sum, sum of logits) through distributed shared memory, then dz. Persistent clusters
//    copy the next row into shared memory while this one is reduced. bf16: 4 bytes per logit, dz
//    written over the bf16 logits in place; float32 logits: 4 read + sizeof(T) written. Thread
//    block clusters need compute capability 9.0: below sm_90 the kernel compiles to a trap, and the
//    host launches it only where cluster_kernel_runnable() says so.
//  - row_softmax_stream_kernel: one CTA streams a row (or a tile of one): statistics (optionally
//    merged with running per-row statistics of earlier vocabulary tiles), and/or dz given a known
//    lse (in place over 16-bit logits on the low-memory strategy's gradient pass). Serves the
//    loss-only forward, the recomputing backward, the low-memory strategy and vocabularies too
//    large for the cluster kernel; with kEntropy also each row's entropy and its gradient.
#pragma once
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "common/async_copy.cuh"
#include "common/fast_math.cuh"
#include "common/launch.cuh"
#include "common/vec.cuh"
#include "linear_cross_entropy/linear_cross_entropy_launch.h"

// Whether this compilation pass has the cluster kernel's code: sm_90 and up, and the host pass (which
// sees the kernel's __cluster_dims__ and launches it). Below sm_90 (sm_80: the A100) thread block
// clusters do not exist; the kernel there is a trap without cluster dimensions.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define FUSEFORGE_LCE_CLUSTER_CODE 0
#else
#define FUSEFORGE_LCE_CLUSTER_CODE 1
#endif

namespace fuseforge::linear_cross_entropy {

// ---------------------------------------------------------------------------------------------
// Per-element math shared by both kernels.
struct LossMath {
  float label_smoothing, z_loss, softcap, inv_softcap, smooth_per_class;

  template <typename T>
  __host__ __device__ static LossMath from(const RowParams<T>& p) {
    LossMath m;
    m.label_smoothing = p.label_smoothing;
    m.z_loss = p.z_loss;
    m.softcap = p.softcap;
    m.inv_softcap = p.softcap > 0.f ? 1.f / p.softcap : 0.f;
    m.smooth_per_class = p.label_smoothing / static_cast<float>(p.vocab);
    return m;
  }
  __device__ float cap(float z) const { return softcap > 0.f ? softcap * tanhf(z * inv_softcap) : z; }
  // d loss / d (raw logit), times the row's gradient weight. The target's p - 1 is expm1(-nll):
  // exact where p is close to 1 (a confident model), unlike exp(z - lse) - 1.
  __device__ float grad(float zc, float lse, float nll, bool is_target, float scale) const {
    const float p = __expf(zc - lse);
    float g;
    if (is_target) {
      g = expm1f(-nll) + p * 2.f * z_loss * lse + label_smoothing - smooth_per_class;
    } else {
      g = p * (1.f + 2.f * z_loss * lse) - smooth_per_class;
    }
    if (softcap > 0.f) {
      const float t = zc * inv_softcap;
      g *= 1.f - t * t;
    }
    return g * scale;
  }
  // grad plus the entropy's: g_H dH/dz = -g_H p (log p + H), log p = zc - lse (scale_h = g_H).
  __device__ float grad_with_entropy(float zc, float lse, float nll, bool is_target, float scale, float entropy,
                                     float scale_h) const {
    const float logp = zc - lse;
    const float p = __expf(logp);
    float g;
    if (is_target) {
      g = expm1f(-nll) + p * 2.f * z_loss * lse + label_smoothing - smooth_per_class;
    } else {
      g = p * (1.f + 2.f * z_loss * lse) - smooth_per_class;
    }
    g = g * scale - scale_h * p * (logp + entropy);
    if (softcap > 0.f) {
      const float t = zc * inv_softcap;
      g *= 1.f - t * t;
    }
    return g;
  }
  // lse - (1 - ls) z_t - (ls / V) sum(z) + z_loss lse^2, with lse - z_t = nll formed without cancellation.
  __device__ float loss(float lse, float nll, float sumz) const {
    return (1.f - label_smoothing) * nll + label_smoothing * lse - smooth_per_class * sumz + z_loss * lse * lse;
  }
};

template <typename T>
__device__ __forceinline__ float row_grad_scale(const RowParams<T>& p, int64_t row) {
  float s = p.row_scale ? p.row_scale[row] : 1.f;
  if (p.scalar_scale) s *= *p.scalar_scale;
  return s;
}

// The raw (bias-free) logit of tile column col of launch row `row`: cuBLAS's, or, for the row's
// target column when p.target_logit is given, the exact float32 dot product x . W[t] (cuBLAS's
// tensor-core float32 accumulation leaves a large target logit ~1e-4 low, which a confident
// model's loss sees whole).
template <typename T>
__device__ __forceinline__ float raw_logit(const RowParams<T>& p, float from_gemm, int64_t row, int64_t col,
                                           int64_t t_local) {
  return (p.target_logit != nullptr && col == t_local) ? p.target_logit[row] : from_gemm;
}

// Tile column col's logit with bias and softcap applied (zrow is not read where raw_logit would
// replace the value).
template <typename T, typename L>
__device__ __forceinline__ float load_logit(const RowParams<T>& p, const L* zrow, int64_t row, int64_t col,
                                            int64_t t_local, const LossMath& m) {
  float z = (p.target_logit != nullptr && col == t_local) ? p.target_logit[row] : static_cast<float>(zrow[col]);
  if (p.bias) z += static_cast<float>(p.bias[p.col_begin + col]);
  return m.cap(z);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Block-wide max / sum; every thread gets the result. scratch: kWarps floats.
template <int kThreads>
__device__ float block_max(float v, float* scratch) {
  constexpr int kWarps = kThreads / 32;
  v = warp_max(v);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) r = fmaxf(r, scratch[w]);
  return r;
}
template <int kThreads>
__device__ float block_sum(float v, float* scratch) {
  constexpr int kWarps = kThreads / 32;
  v = warp_sum(v);
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float r = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) r += scratch[w];
  return r;
}

// Four consecutive logits from float32 or 16-bit storage (aligned to 4 of them).
template <typename L>
__device__ __forceinline__ void load4(const L* src, float (&v)[4]) {
  const AlignedVector<L, 4> pk = load_vector<L, 4>(src);
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = static_cast<float>(pk.val[k]);
}

// Four gradients to T at dst (aligned to 4 of them).
template <typename T>
__device__ __forceinline__ void store4(T* dst, float a, float b, float c, float d) {
  AlignedVector<T, 4> pk;
  pk.val[0] = static_cast<T>(a);
  pk.val[1] = static_cast<T>(b);
  pk.val[2] = static_cast<T>(c);
  pk.val[3] = static_cast<T>(d);
  store_vector<T, 4>(dst, pk);
}

template <typename T>
__device__ void zero_tile_row(const RowParams<T>& p, int64_t row, int64_t c0, int64_t c1, int tid, int nthreads) {
  T* out = p.dz + row * p.ld_dz;
  for (int64_t c = c0 + tid; c < c1; c += nthreads) out[c] = static_cast<T>(0.f);
}

// ---------------------------------------------------------------------------------------------
// Cluster kernel: grid (8, clusters); each cluster takes rows blockIdx.y, blockIdx.y + gridDim.y, ...
// (persistent when gridDim.y < rows). CTA `rank` owns columns [rank * span, min(cols, (rank + 1) *
// span)), span a multiple of 4 <= 512 * 4 * kVec4. Needs ld_logits % 4 == 0, ld_dz % 4 == 0,
// cols % 4 == 0, col_begin == 0, cols == vocab. L: the logits' storage (float, or T from
// p.logits_lowp). dz may alias the logits (bf16 in place, with p.target_logit given): every logit
// of a row is read before the cluster barrier after which any CTA writes that row's dz.
template <typename T, typename L>
__device__ __forceinline__ const L* logit_row(const RowParams<T>& p, int64_t row) {
  if constexpr (std::is_same_v<L, float>) {
    return p.logits + row * p.ld_logits;
  } else {
    return p.logits_lowp + row * p.ld_logits;
  }
}

// Bytes of dynamic shared memory the cluster kernel takes: one row span in the logits' storage, the
// next row's logits on their way in.
template <typename L, int kVec4>
constexpr size_t cluster_prefetch_bytes() {
  return sizeof(L) * 4 * kVec4 * kClusterThreads;
}

// The target column's exact logit and its gradient are handled once a row by the thread that holds
// it, not by a test on every logit. kPlain: no bias, softcap, z-loss or label smoothing (the usual
// training loss): per logit only its max, one exp and p * scale. Per-logit tests and option math
// make this kernel instruction-bound (measured on the H100).
#if FUSEFORGE_LCE_CLUSTER_CODE
template <typename T, typename L, int kVec4, bool kPlain>
__device__ void row_softmax_cluster_body(const RowParams<T>& p, int64_t span) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  __shared__ float scratch[kClusterThreads / 32];
  // This CTA's (max, sum of exp(z - max), sum of z), double-buffered by row parity: one cluster
  // barrier a row suffices, as a CTA two rows ahead would have passed a barrier its peers reach only
  // after reading the older buffer.
  __shared__ float stats[2][3];
  // The next row's logits (this thread's groups of 4 at [(i * threads + tid) * 4]), copied by
  // cp.async while this row is reduced, exchanged and written: HBM stays busy through the barriers.
  extern __shared__ __align__(16) unsigned char prefetch_smem[];
  L* next_row = reinterpret_cast<L*>(prefetch_smem);

  const int tid = threadIdx.x;
  const int rank = static_cast<int>(cluster.block_rank());
  // Column indices in 32 bits (cols <= kClusterMaxVocab): fewer registers next to the row.
  const int c0 = rank * static_cast<int>(span);
  const int c1 = c0 + static_cast<int>(span) < p.cols ? c0 + static_cast<int>(span) : static_cast<int>(p.cols);
  const LossMath m = LossMath::from(p);
  const bool need_sumz = m.label_smoothing > 0.f && p.row_sumz == nullptr;
  const auto col_of = [&](int i) { return c0 + (i * kClusterThreads + tid) * 4; };
  const auto slot_of = [&](int i) { return next_row + (i * kClusterThreads + tid) * 4; };
  const auto prefetch = [&](int64_t row) {
    if (row >= p.rows || p.target[row] == p.ignore_index) return;  // ignored rows are not read
    const L* zrow = logit_row<T, L>(p, row);
#pragma unroll
    for (int i = 0; i < kVec4; ++i) {
      if (col_of(i) < c1) {  // cols % 4 == 0 and span % 4 == 0: the four are all in range
        if constexpr (sizeof(L) == 4) {  // 4 floats: 16 bytes
          cp_async_16(smem_addr(slot_of(i)), zrow + col_of(i), true);
        } else {
          cp_async_8(smem_addr(slot_of(i)), zrow + col_of(i));
        }
      }
    }
  };
  prefetch(blockIdx.y);
  cp_async_commit();

  int parity = 0;
  for (int64_t row = blockIdx.y; row < p.rows; row += gridDim.y) {
    const int64_t t = p.target[row];
    if (t == p.ignore_index) {  // uniform over the cluster: no cluster barrier is skipped by half
      prefetch(row + gridDim.y);  // (this row's were not fetched: the slots are free)
      cp_async_commit();
      if (p.dz) zero_tile_row(p, row, c0, c1, tid, kClusterThreads);
      if (rank == 0 && tid == 0) {
        if (p.loss_out) p.loss_out[row] = 0.f;
        if (p.lse_out) p.lse_out[row] = 0.f;
        if (p.nll_out) p.nll_out[row] = 0.f;
      }
      continue;
    }
    const bool bad_target = t < 0 || t >= p.vocab;
    cp_async_wait<0>();  // this thread's slots hold the row (each thread reads only its own)
    float v[kVec4][4];
#pragma unroll
    for (int i = 0; i < kVec4; ++i) {
      if (col_of(i) < c1) load4(slot_of(i), v[i]);
    }
    // Whether this thread holds the target column (group i_t, lane k_t); recomputed where needed
    // rather than kept in registers next to the row.
    const auto holds_target = [&] { return !bad_target && t >= c0 && t < c1 && ((t - c0) / 4) % kClusterThreads == tid; };
    // The target's entry of v (a register: selected by unrolled compares, not indexed).
    const auto target_entry = [&](auto&& use) {
      const int i_t = static_cast<int>((t - c0) / 4) / kClusterThreads, k_t = static_cast<int>(t - c0) % 4;
#pragma unroll
      for (int i = 0; i < kVec4; ++i) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if (i == i_t && k == k_t) use(v[i][k]);
        }
      }
    };
    // The exact target logit in place of cuBLAS's (raw_logit), once a row by its holder.
    if (p.target_logit && holds_target()) target_entry([&](float& z) { z = p.target_logit[row]; });
    float local_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < kVec4; ++i) {
      if (col_of(i) < c1) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if constexpr (!kPlain) {
            if (p.bias) v[i][k] += static_cast<float>(p.bias[col_of(i) + k]);
            v[i][k] = m.cap(v[i][k]);
          }
          local_max = fmaxf(local_max, v[i][k]);
        }
      }
    }
    // Sums of exp(z - cta_max) and of z over this thread's columns. (Merging (max, sum) pairs per
    // thread through the warp instead, 1 block barrier instead of 6, measures 4% slower on the H100.)
    const float cta_max = block_max<kClusterThreads>(local_max, scratch);
    // The slots are consumed (cta_max depends on every value read, and block_max's barriers keep
    // the compiler from moving those reads down): refill them.
    prefetch(row + gridDim.y);
    cp_async_commit();
    float local_sum = 0.f, local_sumz = 0.f;
    const float max_log2 = cta_max * kLog2e;
#pragma unroll
    for (int i = 0; i < kVec4; ++i) {
      if (col_of(i) < c1) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          local_sum += fast_exp2(fmaf(v[i][k], kLog2e, -max_log2));
          if constexpr (!kPlain) local_sumz += v[i][k];
        }
      }
    }
    const float cta_sum = block_sum<kClusterThreads>(local_sum, scratch);
    const float cta_sumz = !kPlain && need_sumz ? block_sum<kClusterThreads>(local_sumz, scratch) : 0.f;
    if (tid == 0) {
      stats[parity][0] = cta_max;
      stats[parity][1] = cta_sum;
      stats[parity][2] = cta_sumz;
    }
    cluster.sync();  // every CTA's stats of this row are written, and every logit of the row read
    // Two sweeps over the peers' three floats (distributed shared memory) rather than arrays that
    // would cost registers next to the row.
    float row_max = -INFINITY;
    float row_sumz = 0.f;
#pragma unroll
    for (int r = 0; r < kClusterSize; ++r) {
      const float* peer = cluster.map_shared_rank(&stats[parity][0], r);
      row_max = fmaxf(row_max, peer[0]);
      row_sumz += peer[2];
    }
    float row_sum = 0.f;
#pragma unroll
    for (int r = 0; r < kClusterSize; ++r) {
      const float* peer = cluster.map_shared_rank(&stats[parity][0], r);
      const float peer_sum = peer[1];
      if (peer_sum > 0.f) row_sum += peer_sum * __expf(peer[0] - row_max);
    }
    parity ^= 1;
    const float log_sum = logf(row_sum);
    const float lse = row_max + log_sum;
    // The target's logit from p.target_logit: in place, after this row's cluster barrier the logits
    // themselves may already be overwritten (the host passes it whenever dz aliases the logits).
    const float nll = bad_target ? NAN : (row_max - load_logit(p, logit_row<T, L>(p, row), row, t, t, m)) + log_sum;

    if (rank == 0 && tid == 0) {
      if (p.loss_out) p.loss_out[row] = m.loss(lse, nll, p.row_sumz ? p.row_sumz[row] : row_sumz);
      if (p.lse_out) p.lse_out[row] = lse;
      if (p.nll_out) p.nll_out[row] = nll;
    }
    if (!p.dz) continue;
    const float scale = bad_target ? NAN : row_grad_scale(p, row);
    T* out = p.dz + row * p.ld_dz;
    // Every column as a non-target, then the target's gradient over it by its holder.
    const float lse_log2 = lse * kLog2e;
#pragma unroll
    for (int i = 0; i < kVec4; ++i) {
      if (col_of(i) < c1) {
        float g[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if constexpr (kPlain) {
            g[k] = fast_exp2(fmaf(v[i][k], kLog2e, -lse_log2)) * scale;
          } else {
            g[k] = m.grad(v[i][k], lse, nll, false, scale);
          }
        }
        store4(out + col_of(i), g[0], g[1], g[2], g[3]);
      }
    }
    if (holds_target()) target_entry([&](float& z) { out[t] = static_cast<T>(m.grad(z, lse, nll, true, scale)); });
  }
  cluster.sync();  // no CTA leaves (freeing its shared memory) before every peer has read it
}

template <typename T, typename L, int kVec4, bool kPlain>
__global__ void __cluster_dims__(kClusterSize, 1, 1) __launch_bounds__(kClusterThreads, kVec4 >= 16 ? 1 : 2)
    row_softmax_cluster_kernel(RowParams<T> p, int64_t span) {
  row_softmax_cluster_body<T, L, kVec4, kPlain>(p, span);
}
#else
template <typename T, typename L, int kVec4, bool kPlain>
__global__ void __launch_bounds__(kClusterThreads, kVec4 >= 16 ? 1 : 2)
    row_softmax_cluster_kernel(RowParams<T> p, int64_t span) {
  __trap();  // no cluster code below sm_90: the host does not launch it (cluster_kernel_runnable)
}
#endif

// ---------------------------------------------------------------------------------------------
// Stream kernel: grid (rows); one CTA a row of the tile. kVec: ld_logits, cols and ld_dz are
// multiples of 4 (4-wide loads and stores). L: the logits' storage (float, or T from
// p.logits_lowp). dz may alias the logits when lse is given (p.lse_in): each thread reads its own
// columns before it writes them, and the target's logit then comes from p.target_logit.
// kEntropy: the forward also accumulates A = sum exp(z - m) (z - m) beside the sum S (rescaled with
// the running max m like it) and writes H = log S - A / S; the gradient pass adds the entropy's
// gradient with p.entropy_scale. Without it the kernel is the plain per-token one (StreamParams'
// entropy fields unread).
template <typename T, typename L, bool kVec, bool kEntropy>
__device__ void row_softmax_stream_body(const StreamParams<T>& p) {
  __shared__ float scratch[kStreamThreads / 32];
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x;
  const int64_t t = p.target[row];
  const LossMath m = LossMath::from(p);
  const int64_t t_local = t - p.col_begin;
  const bool target_in_tile = t_local >= 0 && t_local < p.cols;

  if (t == p.ignore_index) {
    if (p.dz) zero_tile_row(p, row, 0, p.cols, tid, kStreamThreads);
    if (tid == 0 && p.target_residual) p.target_residual[row] = 0.f;
    if (tid == 0 && p.last_tile && !p.lse_in) {
      if (p.loss_out) p.loss_out[row] = 0.f;
      if (p.lse_out) p.lse_out[row] = 0.f;
      if (p.nll_out) p.nll_out[row] = 0.f;
      if constexpr (kEntropy) {
        if (p.entropy_out) p.entropy_out[row] = 0.f;
      }
    }
    return;
  }
  const bool bad_target = t < 0 || t >= p.vocab;
  const L* zrow = logit_row<T, L>(p, row);
  constexpr int kStep = kVec ? 4 : 1;

  float lse, nll;
  float entropy = 0.f;
  // A of terms whose exp(z - m) sum to `sum`, carried from max m to max new_m >= m:
  // exp(m - new_m) (A + (m - new_m) sum), both terms <= 0; 0 while nothing is summed (m = -inf).
  const auto rescale_a = [](float a, float sum, float m, float new_m) {
    return sum > 0.f ? __expf(m - new_m) * fmaf(m - new_m, sum, a) : 0.f;
  };
  if (p.lse_in) {
    lse = p.lse_in[row];
    nll = p.nll_in[row];
    if constexpr (kEntropy) entropy = p.entropy_in[row];
  } else {
    // Online max / sum over this thread's columns, then across the block.
    float run_m = -INFINITY, run_s = 0.f, run_z = 0.f, run_a = 0.f;
    for (int64_t col = static_cast<int64_t>(tid) * kStep; col < p.cols; col += kStreamThreads * kStep) {
      float z[kStep];
      if constexpr (kVec) {
        load4(zrow + col, z);
      } else {
        z[0] = static_cast<float>(zrow[col]);
      }
      float mx = -INFINITY;
#pragma unroll
      for (int k = 0; k < kStep; ++k) {
        z[k] = raw_logit(p, z[k], row, col + k, t_local);
        if (p.bias) z[k] += static_cast<float>(p.bias[p.col_begin + col + k]);
        z[k] = m.cap(z[k]);
        mx = fmaxf(mx, z[k]);
        run_z += z[k];
      }
      const float new_m = fmaxf(run_m, mx);
      float s = run_s * __expf(run_m - new_m);  // run_m = -inf at first: exp(-inf) = 0
      if constexpr (kEntropy) run_a = rescale_a(run_a, run_s, run_m, new_m);
#pragma unroll
      for (int k = 0; k < kStep; ++k) {
        const float d = z[k] - new_m;
        const float e = __expf(d);
        s += e;
        // (d clamped to a finite value: 0, not NaN, for a -inf logit)
        if constexpr (kEntropy) run_a = fmaf(e, fmaxf(d, -FLT_MAX), run_a);
      }
      run_s = s;
      run_m = new_m;
    }
    float tile_max = block_max<kStreamThreads>(run_m, scratch);
    float tile_a = 0.f;
    if constexpr (kEntropy) tile_a = block_sum<kStreamThreads>(rescale_a(run_a, run_s, run_m, tile_max), scratch);
    float tile_sum = block_sum<kStreamThreads>(run_s > 0.f ? run_s * __expf(run_m - tile_max) : 0.f, scratch);
    float tile_sumz = block_sum<kStreamThreads>(run_z, scratch);
    float zt = target_in_tile ? load_logit(p, zrow, row, t_local, t_local, m) : 0.f;
    if (p.run_max && !p.first_tile) {  // merge with the earlier tiles of this row
      const float prev_m = p.run_max[row], prev_s = p.run_sum[row];
      const float new_m = fmaxf(prev_m, tile_max);
      if constexpr (kEntropy) {
        tile_a = rescale_a(tile_a, tile_sum, tile_max, new_m) + rescale_a(p.run_ent[row], prev_s, prev_m, new_m);
      }
      tile_sum = tile_sum * __expf(tile_max - new_m) + prev_s * __expf(prev_m - new_m);
      tile_max = new_m;
      tile_sumz += p.run_sumz[row];
      if (!target_in_tile) zt = p.run_zt[row];
    }
    if (!p.last_tile) {
      if (tid == 0) {
        p.run_max[row] = tile_max;
        p.run_sum[row] = tile_sum;
        p.run_sumz[row] = tile_sumz;
        if (target_in_tile) p.run_zt[row] = zt;
        if constexpr (kEntropy) p.run_ent[row] = tile_a;
      }
      return;  // gradients need the whole row's lse
    }
    const float log_sum = logf(tile_sum);
    lse = tile_max + log_sum;
    nll = bad_target ? NAN : (tile_max - zt) + log_sum;
    if constexpr (kEntropy) entropy = bad_target ? NAN : log_sum - tile_a / tile_sum;
    if (tid == 0) {
      if (p.loss_out) p.loss_out[row] = m.loss(lse, nll, tile_sumz);
      if (p.lse_out) p.lse_out[row] = lse;
      if (p.nll_out) p.nll_out[row] = nll;
      if constexpr (kEntropy) {
        if (p.entropy_out) p.entropy_out[row] = entropy;
      }
    }
  }
  if (!p.dz) return;
  const float scale = bad_target ? NAN : row_grad_scale(p, row);
  float scale_h = 0.f;  // the entropy's upstream gradient
  if constexpr (kEntropy) scale_h = bad_target ? NAN : (p.entropy_scale ? p.entropy_scale[row] : 0.f);
  // d loss / d z, plus the entropy's gradient with kEntropy.
  const auto grad = [&](float zc, bool is_target) {
    if constexpr (kEntropy) {
      return m.grad_with_entropy(zc, lse, nll, is_target, scale, entropy, scale_h);
    } else {
      return m.grad(zc, lse, nll, is_target, scale);
    }
  };
  T* out = p.dz + row * p.ld_dz;
  // The target's entry is the row's largest gradient: what rounding it to T loses goes to
  // target_residual (0 where the row has no target entry here).
  const auto keep_residual = [&](float g) {
    if (p.target_residual) p.target_residual[row] = g - static_cast<float>(static_cast<T>(g));
  };
  if (tid == 0 && p.target_residual && !target_in_tile) p.target_residual[row] = 0.f;
  for (int64_t col = static_cast<int64_t>(tid) * kStep; col < p.cols; col += kStreamThreads * kStep) {
    if constexpr (kVec) {
      float z[4];
      load4(zrow + col, z);
      float g[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        float zk = raw_logit(p, z[k], row, col + k, t_local);
        if (p.bias) zk += static_cast<float>(p.bias[p.col_begin + col + k]);
        g[k] = grad(m.cap(zk), col + k == t_local);
        if (col + k == t_local) keep_residual(g[k]);
      }
      store4(out + col, g[0], g[1], g[2], g[3]);
    } else {
      const float g = grad(load_logit(p, zrow, row, col, t_local, m), col == t_local);
      if (col == t_local) keep_residual(g);
      out[col] = static_cast<T>(g);
    }
  }
}

template <typename T, typename L, bool kVec, bool kEntropy>
__global__ void __launch_bounds__(kStreamThreads) row_softmax_stream_kernel(StreamParams<T> p) {
  row_softmax_stream_body<T, L, kVec, kEntropy>(p);
}

// out[r] = x[r] . weight[target[r]] in float32 (0 for ignored or out-of-range targets): one warp a
// row, each lane a strided slice of the hidden dim, then a warp sum. x and weight row-major.
constexpr int kTargetLogitThreads = 256;
template <typename T>
__global__ void __launch_bounds__(kTargetLogitThreads)
    target_logit_kernel(const T* x, const T* weight, const int64_t* target, int64_t rows, int64_t hidden,
                        int64_t vocab, int64_t ignore_index, float* out) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kTargetLogitThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t t = target[row];
  float acc = 0.f;
  if (t != ignore_index && t >= 0 && t < vocab) {
    const T* xr = x + row * hidden;
    const T* wr = weight + t * hidden;
    for (int64_t h = lane; h < hidden; h += 32) acc = fmaf(static_cast<float>(xr[h]), static_cast<float>(wr[h]), acc);
  }
  acc = warp_sum(acc);
  if (lane == 0) out[row] = acc;
}

// grad_x[r] = T(acc[r] + residual[r] * weight[target[r]]): grid (rows), a block a row.
template <typename T>
__global__ void __launch_bounds__(256)
    add_target_rows_kernel(const float* acc, const T* weight, const int64_t* target, const float* residual,
                           int64_t hidden, int64_t vocab, T* grad_x) {
  const int64_t row = blockIdx.x;
  const int64_t t = target[row];
  const float r = residual[row];
  const bool add = r != 0.f && t >= 0 && t < vocab;
  const float* a = acc + row * hidden;
  T* out = grad_x + row * hidden;
  const T* w = weight + (add ? t : 0) * hidden;
  for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
    out[h] = static_cast<T>(add ? fmaf(r, static_cast<float>(w[h]), a[h]) : a[h]);
  }
}

// Block j of grid (rows) owns target sorted_target[j] if j is that target's first position: it adds
// the residual-weighted x rows of every row with that target, in order, to w_acc[t] (and the
// residuals to b_acc[t]). One writer a target: no atomics, the same sums every run.
template <typename T>
__global__ void __launch_bounds__(256)
    scatter_target_rows_kernel(const int64_t* sorted_target, const int64_t* order, const float* residual, const T* x,
                               int64_t rows, int64_t hidden, int64_t vocab, float* w_acc, float* b_acc) {
  const int64_t j = blockIdx.x;
  const int64_t t = sorted_target[j];
  if ((j > 0 && sorted_target[j - 1] == t) || t < 0 || t >= vocab) return;
  int64_t end = j + 1;
  while (end < rows && sorted_target[end] == t) ++end;
  if (w_acc) {
    for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
      float s = 0.f;
      for (int64_t k = j; k < end; ++k) {
        const int64_t i = order[k];
        s = fmaf(residual[i], static_cast<float>(x[i * hidden + h]), s);
      }
      w_acc[t * hidden + h] += s;
    }
  }
  if (b_acc && threadIdx.x == 0) {
    float s = 0.f;
    for (int64_t k = j; k < end; ++k) s += residual[order[k]];
    b_acc[t] += s;
  }
}

// data *= (*a) * (*b), skipped entirely when that product is exactly 1 (then no memory is touched).
template <typename T>
__global__ void __launch_bounds__(256) scale_kernel(T* data, int64_t n, const float* a, const float* b) {
  const float s = *a * *b;
  if (s == 1.f) return;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    data[i] = static_cast<T>(static_cast<float>(data[i]) * s);
  }
}

}  // namespace fuseforge::linear_cross_entropy
