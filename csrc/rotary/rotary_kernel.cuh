// rotary device code. A block takes blockDim.z consecutive tokens of the flattened (B, S) grid; a
// thread owns one chunk of a head (one 16-byte vector of the input type: a rotary chunk of the
// half-split layout's first R / 2 dims with its partners R / 2 further, a chunk of interleaved
// pairs, or a pass-through chunk of dims R..D-1) and takes it in every blockDim.y-th head of its
// token, q's then k's, kBatch heads loaded before any is computed. A thread first issues its first
// batch's loads; then the token's threads compute its R / 2 cos and sin once (accurate sincosf:
// angles reach ~1e6 rad) into shared memory, under those loads' latency; one barrier, then every
// head of the token reads them. No division a head. kVec: every chunk is whole and 16-byte aligned
// (16-byte accesses); otherwise element accesses masked at the chunk's end. Arithmetic in float32,
// one rounding to the output type.
#pragma once
#include <ATen/ATen.h>

#include "common/async_copy.cuh"
#include "common/launch.cuh"
#include "common/vec.cuh"
#include "rotary/rotary_launch.h"

namespace fuseforge::rotary {

// One chunk of a row as loaded (one 16-byte vector), converted to float on use.
template <typename T>
struct RawChunk {
  static constexpr int kElems = chunk_elems<T>();
  AlignedVector<T, kElems> vec;
  __device__ __forceinline__ float value(int j) const { return static_cast<float>(vec.val[j]); }
};

template <typename T, bool kVec>
__device__ __forceinline__ void load_chunk(const T* __restrict__ src, int n, RawChunk<T>& chunk) {
  if constexpr (kVec) {
    chunk.vec = load_vector<T, RawChunk<T>::kElems>(src);
  } else {
#pragma unroll
    for (int j = 0; j < RawChunk<T>::kElems; ++j) chunk.vec.val[j] = j < n ? src[j] : T(0);
  }
}

// kN floats to kN elements of the output type: 16-byte stores where 16-byte aligned (kVec).
template <typename T, int kN, bool kVec>
__device__ __forceinline__ void store_chunk(T* __restrict__ dst, int n, const float (&v)[kN]) {
  constexpr int kPerStore = kN * sizeof(T) > 16 ? 16 / static_cast<int>(sizeof(T)) : kN;
  if constexpr (kVec) {
#pragma unroll
    for (int u = 0; u < kN / kPerStore; ++u) {
      AlignedVector<T, kPerStore> out;
#pragma unroll
      for (int j = 0; j < kPerStore; ++j) out.val[j] = static_cast<T>(v[u * kPerStore + j]);
      store_vector<T, kPerStore>(dst + u * kPerStore, out);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kN; ++j)
      if (j < n) dst[j] = static_cast<T>(v[j]);
  }
}

// The chunk of one head a thread takes: where it is in the head and how many elements it has.
struct ChunkPlace {
  bool rotary;
  int first;  // its first element in the head
  int n;      // elements inside its range (the scalar path's mask)
};

template <typename Tin, typename Tout>
struct HeadRows {
  const Tin* src;
  Tout* dst;
};

// Head h of the token (q's heads first, then k's).
template <typename Tin, typename Tout>
__device__ __forceinline__ HeadRows<Tin, Tout> head_rows(const RotaryParams<Tin, Tout>& p, const Tin* q_row,
                                                         const Tin* k_row, Tout* q_out, Tout* k_out, int h) {
  if (h < p.heads_q) return {q_row + h * p.q_stride_h, q_out + static_cast<int64_t>(h) * p.head_dim};
  const int hk = h - p.heads_q;
  return {k_row + hk * p.k_stride_h, k_out + static_cast<int64_t>(hk) * p.head_dim};
}

// Token (b, s)'s position_ids entry.
template <typename P>
__device__ __forceinline__ int64_t position_index(const P& p, int64_t b, int64_t s) {
  const int64_t at = b * p.pos_stride_b + s * p.pos_stride_s;
  return p.positions_int64 ? static_cast<const int64_t*>(p.position_ids)[at]
                           : static_cast<int64_t>(static_cast<const int32_t*>(p.position_ids)[at]);
}

// Token (b, s)'s position in float32, as Hugging Face's position_ids.float() gives it.
template <typename P>
__device__ __forceinline__ float position_of(const P& p, int64_t b, int64_t s) {
  return static_cast<float>(position_index(p, b, s));
}

// A token's cos/sin table entries first, first + step, ... below rot_half: angle = position *
// inv_freq in one float32 multiply, as Hugging Face computes it; cos and sin times the scalings.
__device__ __forceinline__ void fill_token_table(float position, const float* __restrict__ inv_freq, int rot_half,
                                                 float cos_scaling, float sin_scaling, int first, int step,
                                                 float* cos_tab, float* sin_tab) {
  for (int i = first; i < rot_half; i += step) {
    float sv, cv;
    sincosf(__fmul_rn(position, inv_freq[i]), &sv, &cv);
    cos_tab[i] = cv * cos_scaling;
    sin_tab[i] = sv * sin_scaling;
  }
}

// The same, out of line: the token kernel's rare second table (inlined, its registers spill).
__device__ __noinline__ void refill_token_table(float position, const float* __restrict__ inv_freq, int rot_half,
                                                float cos_scaling, float sin_scaling, int first, int step,
                                                float* cos_tab, float* sin_tab) {
  fill_token_table(position, inv_freq, rot_half, cos_scaling, sin_scaling, first, step, cos_tab, sin_tab);
}

// A pass-through chunk's elements as floats.
template <typename Tin, int kChunk>
__device__ __forceinline__ void chunk_floats(const AlignedVector<Tin, kChunk>& x, float (&out)[kChunk]) {
#pragma unroll
  for (int j = 0; j < kChunk; ++j) out[j] = static_cast<float>(x.val[j]);
}

template <typename Tin, typename Tout, bool kInterleaved, bool kVec>
__global__ void __launch_bounds__(kThreads) rotary_kernel(const RotaryParams<Tin, Tout> p) {
  constexpr int kChunk = chunk_elems<Tin>();
  constexpr int kPairs = kInterleaved ? kChunk / 2 : kChunk;  // pairs a rotary chunk holds
  extern __shared__ float rotary_tables[];  // cos, then sin: (blockDim.z, rot_half) each
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.z + threadIdx.z;
  const bool active = token < p.tokens;  // no early return: every thread reaches the barrier
  const int64_t b = active ? token / p.seq : 0, s = active ? token - b * p.seq : 0;
  const Tin* q_row = p.q + b * p.q_stride_b + s * p.q_stride_s;
  const Tin* k_row = p.k + b * p.k_stride_b + s * p.k_stride_s;
  Tout* q_out = p.q_out + token * p.heads_q * p.head_dim;
  Tout* k_out = p.k_out + token * p.heads_k * p.head_dim;
  const int heads = p.heads_q + p.heads_k;
  const int head_step = blockDim.y * kBatch;
  const int partner = kInterleaved ? 0 : p.rot_half;  // the half-split partner's offset

  ChunkPlace place;
  auto place_chunk = [&](int c) {
    place.rotary = c < p.rot_chunks;
    if (place.rotary) {
      place.first = c * kChunk;
      place.n = min(kChunk, (kInterleaved ? 2 * p.rot_half : p.rot_half) - place.first);
    } else {
      place.first = 2 * p.rot_half + (c - p.rot_chunks) * kChunk;
      place.n = min(kChunk, p.head_dim - place.first);
    }
  };
  RawChunk<Tin> x[kBatch], y[kBatch];  // y: the half-split partners
  auto load_batch = [&](int h0) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int h = h0 + u * static_cast<int>(blockDim.y);
      if (h >= heads) break;
      const Tin* src = head_rows(p, q_row, k_row, q_out, k_out, h).src + place.first;
      load_chunk<Tin, kVec>(src, place.n, x[u]);
      if (!kInterleaved && place.rotary) load_chunk<Tin, kVec>(src + partner, place.n, y[u]);
    }
  };
  const bool has_chunk = active && static_cast<int>(threadIdx.x) < p.chunks_per_head;
  if (has_chunk) {
    place_chunk(threadIdx.x);
    load_batch(threadIdx.y);
  }

  // The token's cos and sin (times attention_scaling), each computed once by one of the token's
  // threads while the loads above are in flight.
  float* cos_tab = rotary_tables + threadIdx.z * p.rot_half;
  float* sin_tab = cos_tab + blockDim.z * p.rot_half;
  if (active)
    fill_token_table(position_of(p, b, s), p.inv_freq, p.rot_half, p.cos_scaling, p.sin_scaling,
                     threadIdx.y * blockDim.x + threadIdx.x, blockDim.x * blockDim.y, cos_tab, sin_tab);
  __syncthreads();
  if (!has_chunk) return;

  for (int c = threadIdx.x; c < p.chunks_per_head; c += blockDim.x) {
    if (c != static_cast<int>(threadIdx.x)) {
      place_chunk(c);
      load_batch(threadIdx.y);
    }
    float cos_v[kPairs], sin_v[kPairs];
    if (place.rotary) {
      const int freq0 = kInterleaved ? place.first / 2 : place.first;
      const int pairs = kInterleaved ? place.n / 2 : place.n;
#pragma unroll
      for (int i = 0; i < kPairs; ++i) {
        cos_v[i] = kVec || i < pairs ? cos_tab[freq0 + i] : 0.f;
        sin_v[i] = kVec || i < pairs ? sin_tab[freq0 + i] : 0.f;
      }
    }

    for (int h0 = threadIdx.y;;) {
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int h = h0 + u * static_cast<int>(blockDim.y);
        if (h >= heads) break;
        Tout* dst = head_rows(p, q_row, k_row, q_out, k_out, h).dst + place.first;
        float out[kChunk], out_partner[kChunk];
        if (!place.rotary) {
#pragma unroll
          for (int j = 0; j < kChunk; ++j) out[j] = x[u].value(j);
        } else if constexpr (kInterleaved) {
#pragma unroll
          for (int i = 0; i < kPairs; ++i) {
            const float x1 = x[u].value(2 * i), x2 = x[u].value(2 * i + 1);
            out[2 * i] = x1 * cos_v[i] - x2 * sin_v[i];
            out[2 * i + 1] = x2 * cos_v[i] + x1 * sin_v[i];
          }
        } else {
#pragma unroll
          for (int j = 0; j < kChunk; ++j) {
            const float x1 = x[u].value(j), x2 = y[u].value(j);
            out[j] = x1 * cos_v[j] - x2 * sin_v[j];
            out_partner[j] = x2 * cos_v[j] + x1 * sin_v[j];
          }
          store_chunk<Tout, kChunk, kVec>(dst + partner, place.n, out_partner);
        }
        store_chunk<Tout, kChunk, kVec>(dst, place.n, out);
      }
      h0 += head_step;
      if (h0 >= heads) break;
      load_batch(h0);
    }
  }
}

// kN consecutive floats of a cos/sin table in shared memory, 16-byte reads (8-byte for 2, 4 for 1). The
// staged kernel's offsets are multiples of kN (the vector path's R / 2 or R is a multiple of the
// chunk) and the tables start 16-byte aligned; the token kernel's likewise.
template <int kN>
__device__ __forceinline__ void load_table(const float* src, float (&v)[kN]) {
  static_assert(kN % 4 == 0 || kN <= 2, "4k, 2 or 1 floats");
  constexpr int kAccess = kN <= 2 ? kN : 4;
#pragma unroll
  for (int i = 0; i < kN; i += kAccess) {
    const AlignedVector<float, kAccess> t = load_vector<float, kAccess>(src + i);
#pragma unroll
    for (int j = 0; j < kAccess; ++j) v[i + j] = t.val[j];
  }
}

// One rotary chunk x (interleaved pairs, or the half-split's first-half chunk with its partner y)
// rotated by its kPairs cos/sin, in float32: out (and out_partner, half-split).
template <bool kInterleaved, typename Tin, int kChunk, int kPairs>
__device__ __forceinline__ void rotate_chunk(const AlignedVector<Tin, kChunk>& x, const AlignedVector<Tin, kChunk>& y,
                                             const float (&cos_v)[kPairs], const float (&sin_v)[kPairs],
                                             float (&out)[kChunk], float (&out_partner)[kChunk]) {
  if constexpr (kInterleaved) {
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      const float x1 = static_cast<float>(x.val[2 * i]), x2 = static_cast<float>(x.val[2 * i + 1]);
      out[2 * i] = x1 * cos_v[i] - x2 * sin_v[i];
      out[2 * i + 1] = x2 * cos_v[i] + x1 * sin_v[i];
    }
  } else {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const float x1 = static_cast<float>(x.val[j]), x2 = static_cast<float>(y.val[j]);
      out[j] = x1 * cos_v[j] - x2 * sin_v[j];
      out_partner[j] = x2 * cos_v[j] + x1 * sin_v[j];
    }
  }
}

// Token (b, s)'s cos/sin table, computed by the block's threads tid < rot_half (threads in all). It
// is computed for position s while the token's position_ids entry loads (an unpacked batch's
// positions are arange(S)), so that load is not on the way to the barrier (Llama 1B forward 0.0473
// -> 0.0463 ms); a token whose position differs (packed batches) computes it again.
template <typename Tin, typename Tout>
__device__ __forceinline__ void token_table(const RotaryParams<Tin, Tout>& p, int64_t b, int64_t s, int tid,
                                            int threads, float* cos_tab, float* sin_tab) {
  if (tid >= p.rot_half) return;
  const int64_t position = position_index(p, b, s);
  fill_token_table(static_cast<float>(s), p.inv_freq, p.rot_half, p.cos_scaling, p.sin_scaling, tid, threads,
                   cos_tab, sin_tab);
  if (position != s)
    refill_token_table(static_cast<float>(position), p.inv_freq, p.rot_half, p.cos_scaling, p.sin_scaling, tid,
                       threads, cos_tab, sin_tab);
}

// The token kernel: block (chunks_per_head, Hq + Hk) for token (b = blockIdx.y, s = blockIdx.x); a
// thread loads its head's chunk (and the half-split partner) straight into registers first, then
// the block's first rot_half threads compute the token's cos/sin into shared memory under those
// loads; one barrier; each thread rotates its chunk and stores it. A thread's work and addresses
// come from its indices alone, as Liger-Kernel's rope (a program a token) does.
template <typename Tin, typename Tout, bool kInterleaved>
__global__ void __launch_bounds__(kTokenMaxThreads, kTokenMinBlocks) rotary_token_kernel(const RotaryParams<Tin, Tout> p) {
  constexpr int kChunk = chunk_elems<Tin>();
  constexpr int kPairs = kInterleaved ? kChunk / 2 : kChunk;  // pairs a rotary chunk holds
  extern __shared__ float rotary_tables[];                    // cos, then sin: rot_half each
  const int64_t s = blockIdx.x, b = blockIdx.y;
  const int c = threadIdx.x, h = threadIdx.y;
  const bool is_q = h < p.heads_q;
  const int hk = h - p.heads_q;
  const Tin* src = is_q ? p.q + b * p.q_stride_b + s * p.q_stride_s + h * p.q_stride_h
                        : p.k + b * p.k_stride_b + s * p.k_stride_s + hk * p.k_stride_h;
  const int64_t token = b * p.seq + s;
  Tout* dst = is_q ? p.q_out + (token * p.heads_q + h) * p.head_dim : p.k_out + (token * p.heads_k + hk) * p.head_dim;
  const bool rotary = c < p.rot_chunks;
  const int first = rotary ? c * kChunk : 2 * p.rot_half + (c - p.rot_chunks) * kChunk;
  const int partner = kInterleaved ? 0 : p.rot_half;
  const AlignedVector<Tin, kChunk> x = load_vector<Tin, kChunk>(src + first);
  AlignedVector<Tin, kChunk> y;
  if (!kInterleaved && rotary) y = load_vector<Tin, kChunk>(src + first + partner);

  float* cos_tab = rotary_tables;
  float* sin_tab = rotary_tables + p.rot_half;
  token_table(p, b, s, h * blockDim.x + c, blockDim.x * blockDim.y, cos_tab, sin_tab);
  __syncthreads();

  float out[kChunk], out_partner[kChunk];
  if (!rotary) {
    chunk_floats(x, out);
  } else {
    float cos_v[kPairs], sin_v[kPairs];
    const int freq0 = kInterleaved ? first / 2 : first;
    load_table<kPairs>(cos_tab + freq0, cos_v);
    load_table<kPairs>(sin_tab + freq0, sin_v);
    rotate_chunk<kInterleaved>(x, y, cos_v, sin_v, out, out_partner);
    if constexpr (!kInterleaved) store_chunk<Tout, kChunk, true>(dst + first + partner, kChunk, out_partner);
  }
  store_chunk<Tout, kChunk, true>(dst + first, kChunk, out);
}

// kN elements x of a half-split head from its first dim `first` on, and their partners y, rotated
// by the table's entries first.. and stored at dst and dst + rot_half.
template <typename T, int kN>
__device__ __forceinline__ void rotate_store_half_split(const AlignedVector<T, kN>& x, const AlignedVector<T, kN>& y,
                                                        const float* cos_tab, const float* sin_tab, int first,
                                                        int rot_half, T* dst) {
  float cos_v[kN], sin_v[kN], out[kN], out_partner[kN];
  load_table<kN>(cos_tab + first, cos_v);
  load_table<kN>(sin_tab + first, sin_v);
  rotate_chunk<false>(x, y, cos_v, sin_v, out, out_partner);
  store_chunk<T, kN, true>(dst, kN, out);
  store_chunk<T, kN, true>(dst + rot_half, kN, out_partner);
}

// N elements under the L2 policy where they are whole 32-bit words (4-16 bytes), else a plain load.
template <typename T, int N>
__device__ __forceinline__ AlignedVector<T, N> load_kept(const T* p, uint64_t policy) {
  if constexpr (N * sizeof(T) >= 4) {
    return load_vector_l2_hint<T, N>(p, policy);
  } else {
    return load_vector<T, N>(p);
  }
}

// The grouped-query token kernel (16-bit q and k of one type, half-split, every dim rotary, Hq = r
// Hk for r = 2, 4, 8): block (chunks_per_head, Hq) for token (b = blockIdx.y, s = blockIdx.x). Thread
// (c, h) takes q head h's chunk c with its partner, as the token kernel, and a slice of kKElems =
// kChunk / r elements of k head h / r's first half (with its partners): the r q heads of a k head
// share its r x chunks_per_head slices. So k takes no threads of its own: a thread keeps 32 + 4
// kKElems bytes in flight, and at Llama's 4:1 a block is 128 threads (16 tokens an SM, Liger's
// rope's shape) instead of the token kernel's 160 (12 tokens an SM, 32 bytes a thread). kKeepInL2:
// q and k read under an L2 evict-last policy, for tokens of 8 KB or more (keeps_in_l2); smaller ones
// read with plain loads (an evict-normal policy was slower than both, docs/design/rotary.md).
template <typename T, int kKElems, bool kKeepInL2>
__global__ void __launch_bounds__(kTokenMaxThreads, kTokenMinBlocks)
    rotary_token_gqa_kernel(const RotaryParams<T, T> p) {
  constexpr int kChunk = chunk_elems<T>();
  constexpr int kRatio = kChunk / kKElems;  // q heads a k head
  extern __shared__ float rotary_tables[];
  const int64_t s = blockIdx.x, b = blockIdx.y;
  const int c = threadIdx.x, h = threadIdx.y;
  const int hk = h / kRatio;
  const int k_first = ((h - hk * kRatio) * p.chunks_per_head + c) * kKElems;
  const int q_first = c * kChunk;
  const T* q_src = p.q + b * p.q_stride_b + s * p.q_stride_s + h * p.q_stride_h + q_first;
  const T* k_src = p.k + b * p.k_stride_b + s * p.k_stride_s + hk * p.k_stride_h + k_first;
  AlignedVector<T, kChunk> qx, qy;
  AlignedVector<T, kKElems> kx, ky;
  if constexpr (kKeepInL2) {
    const uint64_t policy = l2_evict_last_policy();
    qx = load_vector_l2_hint<T, kChunk>(q_src, policy);
    qy = load_vector_l2_hint<T, kChunk>(q_src + p.rot_half, policy);
    kx = load_kept<T, kKElems>(k_src, policy);
    ky = load_kept<T, kKElems>(k_src + p.rot_half, policy);
  } else {
    qx = load_vector<T, kChunk>(q_src);
    qy = load_vector<T, kChunk>(q_src + p.rot_half);
    kx = load_vector<T, kKElems>(k_src);
    ky = load_vector<T, kKElems>(k_src + p.rot_half);
  }

  float* cos_tab = rotary_tables;
  float* sin_tab = rotary_tables + p.rot_half;
  token_table(p, b, s, h * blockDim.x + c, blockDim.x * blockDim.y, cos_tab, sin_tab);
  __syncthreads();

  const int64_t token = b * p.seq + s;
  rotate_store_half_split(kx, ky, cos_tab, sin_tab, k_first, p.rot_half,
                          p.k_out + (token * p.heads_k + hk) * p.head_dim + k_first);
  rotate_store_half_split(qx, qy, cos_tab, sin_tab, q_first, p.rot_half,
                          p.q_out + (token * p.heads_q + h) * p.head_dim + q_first);
}

// A token's (batch, sequence) index.
struct TokenIndex {
  int64_t b, s;
};

// The (b, s) of a block's tokens token0 + z from one 64-bit division a thread: the block's tokens are
// consecutive, so token0 + z is s0 + z positions into row b0, and past the row's end (a block that
// straddles rows) one more division.
struct BlockTokens {
  int64_t b0, s0;
  template <typename P>
  __device__ __forceinline__ TokenIndex at(const P& p, int z) const {
    const int64_t s = s0 + z;
    if (s < p.seq) return {b0, s};
    const int64_t rows_on = s / p.seq;
    return {b0 + rows_on, s - rows_on * p.seq};
  }
};

template <typename P>
__device__ __forceinline__ BlockTokens block_tokens(const P& p, int64_t token0) {
  const int64_t b0 = token0 / p.seq;
  return {b0, token0 - b0 * p.seq};
}

// Rows r0, r0 + step, r0 + 2 step, ... of a block's (token, head) rows, token-major, as (z, h):
// one division to start, then carries, so the loops over them divide nothing.
struct RowWalk {
  int z, h, dz, dh;
  __device__ __forceinline__ RowWalk(int r0, int step, int heads)
      : z(r0 / heads), h(r0 - r0 / heads * heads), dz(step / heads), dh(step - step / heads * heads) {}
  __device__ __forceinline__ int row(int heads) const { return z * heads + h; }
  __device__ __forceinline__ void next(int heads) {
    h += dh;
    z += dz;
    if (h >= heads) {
      h -= heads;
      ++z;
    }
  }
};

// The staged kernel (the vector path whenever a token's q and k heads fit in shared memory): a block
// takes tokens_per_block consecutive tokens. Its threads copy every 16-byte chunk of those tokens'
// heads to shared memory with cp.async, laid out as the outputs are (the block's q rows, then its k
// rows), so the loads in flight hold no registers and a block keeps its whole stage (~20-32 KB) in
// flight, several blocks an SM; meanwhile they compute the tokens' cos/sin tables; one wait and
// barrier; then each thread rotates chunks read from shared memory into 16-byte stores, q's rows
// and then k's, a fixed chunk of every step-th row. The loops divide nothing and their offsets grow
// by constant steps (a row's token by carries, RowWalk): ncu counted 4x Liger's instructions for
// the same bytes when each row's offsets were formed from (token, head), the kernel issue-bound
// (75% of issue slots) at 52% of DRAM bandwidth (Qwen2's 16 x 2 heads). Where a token's q heads
// and k heads are each one dense row of the tensor (the projections' layout), the copies are two
// flat spans.
template <typename Tin, typename Tout, bool kInterleaved>
__global__ void __launch_bounds__(kThreads, 8) rotary_staged_kernel(const RotaryParams<Tin, Tout> p,
                                                                 const int tokens_per_block) {
  constexpr int kChunk = chunk_elems<Tin>();
  constexpr int kPairs = kInterleaved ? kChunk / 2 : kChunk;  // pairs a rotary chunk holds
  extern __shared__ __align__(16) unsigned char rotary_stage[];
  const int heads = p.heads_q + p.heads_k;
  const int head_chunks = p.head_dim / kChunk;
  const int q_span = tokens_per_block * p.heads_q * p.head_dim;  // elements of the stage's q rows
  Tin* stage_q = reinterpret_cast<Tin*>(rotary_stage);  // (tokens_per_block, heads_q, head_dim)
  Tin* stage_k = stage_q + q_span;                       // (tokens_per_block, heads_k, head_dim)
  float* cos_tab = reinterpret_cast<float*>(stage_k + tokens_per_block * p.heads_k * p.head_dim);
  float* sin_tab = cos_tab + tokens_per_block * p.rot_half;  // (tokens_per_block, rot_half) each
  const int64_t token0 = static_cast<int64_t>(blockIdx.x) * tokens_per_block;
  const int tid = threadIdx.x;
  const BlockTokens tokens = block_tokens(p, token0);
  const int tokens_here = static_cast<int>(min(static_cast<int64_t>(tokens_per_block), p.tokens - token0));

  if (p.dense_token_rows) {
    // Token t's q heads are q[t * heads_q * head_dim ...], its k heads likewise.
    const Tin* q_src = p.q + token0 * p.heads_q * p.head_dim;
    const Tin* k_src = p.k + token0 * p.heads_k * p.head_dim;
    const int q_here = tokens_here * p.heads_q * p.head_dim, k_here = tokens_here * p.heads_k * p.head_dim;
    for (int i = tid * kChunk; i < q_here; i += kThreads * kChunk) cp_async_16(smem_addr(stage_q + i), q_src + i, true);
    for (int i = tid * kChunk; i < k_here; i += kThreads * kChunk) cp_async_16(smem_addr(stage_k + i), k_src + i, true);
  } else if (tid < kThreads / head_chunks * head_chunks) {
    // A thread takes chunk c of every step-th (token z, head h) row; the threads past the last whole
    // set of head_chunks sit out (they would copy a chunk twice).
    const int c = tid % head_chunks, step = kThreads / head_chunks;
    RowWalk w(tid / head_chunks, step, heads);
    int row_token = -1;
    const Tin *q_row = nullptr, *k_row = nullptr;  // chunk c of the current token's rows
    for (; w.z < tokens_here; w.next(heads)) {
      if (w.z != row_token) {
        row_token = w.z;
        const TokenIndex t = tokens.at(p, w.z);
        q_row = p.q + t.b * p.q_stride_b + t.s * p.q_stride_s + c * kChunk;
        k_row = p.k + t.b * p.k_stride_b + t.s * p.k_stride_s + c * kChunk;
      }
      const bool is_q = w.h < p.heads_q;
      const Tin* src = is_q ? q_row + w.h * p.q_stride_h : k_row + (w.h - p.heads_q) * p.k_stride_h;
      Tin* to = is_q ? stage_q + (w.z * p.heads_q + w.h) * p.head_dim
                     : stage_k + (w.z * p.heads_k + w.h - p.heads_q) * p.head_dim;
      cp_async_16(smem_addr(to + c * kChunk), src, true);
    }
  }
  cp_async_commit();

  // The tokens' cos and sin (times attention_scaling) under the copies' latency: angle =
  // float(position) * inv_freq in one float32 multiply, as Hugging Face computes it. Entry (token z,
  // frequency f) walked by carries like the rows.
  for (RowWalk w(tid, kThreads, p.rot_half); w.z < tokens_here; w.next(p.rot_half)) {
    const TokenIndex t = tokens.at(p, w.z);
    const float position = position_of(p, t.b, t.s);
    float sv, cv;
    sincosf(__fmul_rn(position, p.inv_freq[w.h]), &sv, &cv);
    const int i = w.row(p.rot_half);
    cos_tab[i] = cv * p.cos_scaling;
    sin_tab[i] = sv * p.sin_scaling;
  }
  cp_async_wait<0>();
  __syncthreads();
  if (tid >= kThreads / p.chunks_per_head * p.chunks_per_head) return;

  // Rotation: item c of a row is rotary chunk c (with its half-split partner) or, from rot_chunks
  // on, a pass-through chunk. The stage's rows and the outputs' rows share their offsets.
  const int c = tid % p.chunks_per_head;
  const bool rotary = c < p.rot_chunks;
  const int first = rotary ? c * kChunk : 2 * p.rot_half + (c - p.rot_chunks) * kChunk;
  const int partner = kInterleaved ? 0 : p.rot_half;
  const int freq0 = kInterleaved ? first / 2 : first;
  const int step = kThreads / p.chunks_per_head;
  auto rotate_rows = [&](const Tin* stage_rows, Tout* out_rows, int row_heads) {
    RowWalk w(tid / p.chunks_per_head, step, row_heads);
    const int offset0 = w.row(row_heads) * p.head_dim + first, advance = step * p.head_dim;
    const Tin* x_row = stage_rows + offset0;
    Tout* dst = out_rows + offset0;
    for (; w.z < tokens_here; w.next(row_heads), x_row += advance, dst += advance) {
      const AlignedVector<Tin, kChunk> x = load_vector<Tin, kChunk>(x_row);
      float out[kChunk], out_partner[kChunk];
      if (!rotary) {
        chunk_floats(x, out);
      } else {
        float cos_v[kPairs], sin_v[kPairs];
        load_table<kPairs>(cos_tab + w.z * p.rot_half + freq0, cos_v);
        load_table<kPairs>(sin_tab + w.z * p.rot_half + freq0, sin_v);
        if constexpr (kInterleaved) {
          rotate_chunk<kInterleaved>(x, x, cos_v, sin_v, out, out_partner);
        } else {
          const AlignedVector<Tin, kChunk> y = load_vector<Tin, kChunk>(x_row + partner);
          rotate_chunk<kInterleaved>(x, y, cos_v, sin_v, out, out_partner);
          store_chunk<Tout, kChunk, true>(dst + partner, kChunk, out_partner);
        }
      }
      store_chunk<Tout, kChunk, true>(dst, kChunk, out);
    }
  };
  // The block's tokens' output rows are consecutive: q_out's from token0 on, k_out's likewise.
  rotate_rows(stage_q, p.q_out + token0 * p.heads_q * p.head_dim, p.heads_q);
  rotate_rows(stage_k, p.k_out + token0 * p.heads_k * p.head_dim, p.heads_k);
}

}  // namespace fuseforge::rotary
