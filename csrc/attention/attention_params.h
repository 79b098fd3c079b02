// What the attention kernels take: one params struct of raw pointers and int64 element strides,
// passed by value, shared by the forward and backward launchers (no torch types, so a later Hopper
// wgmma/TMA path can take the same struct).
#pragma once
#include <c10/macros/Macros.h>

#include <algorithm>
#include <cstdint>

// Inline helpers the kernels and the host's tests share (as query_key_tiles); force-inlined in CUDA code.
#if defined(__CUDACC__)
#define FUSEFORGE_ATTN_HD __host__ __device__ __forceinline__
#else
#define FUSEFORGE_ATTN_HD inline
#endif

namespace fuseforge::attention {

// The key tiles [n_begin, n_end) of block_n keys that query rows [m0, m0 + rows) of one sequence
// (offset = Sk - Sq) may see: every tile without the local mask; with it, the tiles holding a key of
// [m0 + offset - window_left, m0 + rows - 1 + offset + window_right] within [0, seqlen_k), the left
// bound only where left_bound (a sliding window; causal has none). The kernels' QueryBlock and the
// host's tile plan (fwd_tile_area) both take it. I: int on the device, int64_t on the host.
template <typename I>
C10_HOST_DEVICE inline void query_key_tiles(bool local, bool left_bound, I m0, I rows, I seqlen_k, I offset,
                                            I window_left, I window_right, I block_n, I& n_begin, I& n_end) {
#ifdef __CUDA_ARCH__
  using ::max, ::min;
#else
  using std::max, std::min;
#endif
  I key_begin = 0, key_end = seqlen_k;
  if (local && left_bound) key_begin = max(I{0}, m0 + offset - window_left);
  if (local) key_end = min(seqlen_k, max(I{0}, m0 + rows + offset + window_right));
  n_begin = key_begin / block_n;
  n_end = max(n_begin, (key_end + block_n - 1) / block_n);
}

// The first row of query tile m_block (block_m rows) of a sequence of seqlen_q rows: the tiles start
// at row 0, or (bottom) end at the last row, so a partial tile is the first and starts before row 0.
// The kernels' QueryBlock and the host's tile plan (fwd_tile_area) both take it. I: as above.
template <typename I>
C10_HOST_DEVICE inline I query_tile_first_row(bool bottom, I seqlen_q, I block_m, I m_block) {
  return bottom ? seqlen_q - ((seqlen_q + block_m - 1) / block_m - m_block) * block_m : m_block * block_m;
}

struct FwdParams {
  // q (B, Hq, Sq, D), k/v (B, Hk, Sk, D), out like q: any strides, the last dim contiguous.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  // Row r of (batch b, head h) at lse[b * lse_batch_stride + h * lse_head_stride + r]: (B, Hq, Sq)
  // contiguous, or (Hq, total_q) for varlen; natural log; -inf for rows that see no key. The backward's
  // row_dot has the same layout.
  float* lse = nullptr;
  int64_t lse_batch_stride = 0, lse_head_stride = 0;
  int64_t q_batch_stride = 0, q_head_stride = 0, q_row_stride = 0;
  int64_t k_batch_stride = 0, k_head_stride = 0, k_row_stride = 0;
  int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0;
  int64_t out_batch_stride = 0, out_head_stride = 0, out_row_stride = 0;
  int batch = 0, heads_q = 0, heads_kv = 0, group = 1;  // group = Hq / Hk
  // The backward's grouped-query head split (attention_bwd_cuda): heads_kv and group count split x
  // the KV heads, each taking group / split query heads, and KV head hk reads K / V head
  // hk / kv_head_split in place (its dK / dV go to a partials buffer of heads_kv heads). 1 elsewhere.
  int kv_head_split = 1;
  // The K / V head that KV head hk of the grid reads, and how many K / V heads the tensors hold.
  FUSEFORGE_ATTN_HD int kv_source_head(int hk) const { return hk / kv_head_split; }
  FUSEFORGE_ATTN_HD int kv_source_heads() const { return heads_kv / kv_head_split; }
  int seqlen_q = 0, seqlen_k = 0;  // the max over sequences for varlen
  int64_t rows_q = 0, rows_k = 0;  // the views' row counts: seqlen_q/k, or the totals for varlen (TMA bounds)
  // The tensors' head dim, a multiple of 8 up to the kernel's kHeadDim (64 or 128). The kernels built
  // with kPadHeadDim zero-fill the shared-memory columns past it on load and skip them on store, so a
  // head dim of 96 runs the 128 kernels (products over zeros, nothing else changes).
  int head_dim = 0;
  // Packed variable-length batches: sequence b is rows [cu[b], cu[b + 1]) of a (1, H, total, D) view
  // (batch strides 0, `batch` sequences); null for fixed-length batches.
  const int* cu_seqlens_q = nullptr;
  const int* cu_seqlens_k = nullptr;
  // Varlen: the sequence a grid's (or tile list's) batch slot b runs, seq_order[b], longest sequences
  // first so the heaviest tiles start early and the short ones fill the tail (written on the device
  // by check_and_order_sequences_async). Null for fixed-length batches.
  const int* seq_order = nullptr;
  // The local mask (kernels instantiated with a kMask mode): query i sees key j when
  // i + off - window_left <= j <= i + off + window_right, off = Sk - Sq of the sequence. The host
  // clamps unbounded sides to the max lengths (causal: window_right = 0), so no sum overflows.
  int window_left = 0, window_right = 0;
  float scale = 1.f;       // on q k^T
  float scale_log2 = 1.f;  // scale * log2(e): the kernels use exp2
  // Softcap (kernels instantiated with kSoftcap): the score z = softcap * tanh(scale s / softcap) is
  // kept as s' = z / scale = softcap_out * tanh(softcap_in * s), so the softmax code is unchanged.
  float softcap_in = 0.f, softcap_out = 0.f;
  // One int32, zeroed on the stream before the launch: the persistent forward's next tile (its blocks
  // take tiles from it with atomicAdd). Unused by the other kernels.
  int* tile_counter = nullptr;
};

// Mask modes, a template parameter kMask of every kernel: kNoMask; kRightBound, keys past
// i + off + window_right masked (causal); kWindow, keys before i + off - window_left too (sliding
// windows). Causal keeps its own mode: the extra left-bound test made the causal backward 37% slower
// at D = 64 (the dk/dv kernel at 255 registers).
constexpr int kNoMask = 0, kRightBound = 1, kWindow = 2;

// The masked elements' test: a thread's elements on one line of a tile (a query row in the forward,
// a key in the backward) sit at compile-time offsets c from the thread's first column, and element c
// is visible when lo <= c <= hi. Two compares against immediates an element; testing the key
// against row + offset + bound, the compiler recomputed that sum for every element (the window's
// masked dk/dv tile ran ~180 SASS instructions a thread over an unmasked one, causal's ~90). Query
// i sees key j when j < Sk and i + off - left <= j <= i + off + right (kMask: which bounds apply).
// Bitwise & on purpose: with && a bound's test (a load of p.window_left) was a short-circuit branch,
// and ptxas branched around every element of the dk/dv kernels' masked exp (62 branches a tile)
// instead of predicating.
struct VisibleRange {
  int lo, hi;
  FUSEFORGE_ATTN_HD bool contains(int c) const { return (lo <= c) & (c <= hi); }
};
constexpr int kUnbounded = 1 << 30;  // a bound no offset within a tile reaches

// The keys query row `row` sees, from key col0 (both sequence-relative).
template <int kMask>
FUSEFORGE_ATTN_HD VisibleRange keys_of_row(int row, int col0, int seqlen_k, int offset, const FwdParams& p) {
  int hi = seqlen_k - 1 - col0;
  if constexpr (kMask != kNoMask) {
    const int right = row + offset + p.window_right - col0;
    hi = right < hi ? right : hi;
  }
  return {kMask == kWindow ? row + offset - p.window_left - col0 : -kUnbounded, hi};
}

// The query rows that see key `key`, from row q0 (both sequence-relative); none past Sk.
template <int kMask>
FUSEFORGE_ATTN_HD VisibleRange rows_of_key(int key, int q0, int seqlen_k, int offset, const FwdParams& p) {
  const int lo = kMask != kNoMask ? key - offset - p.window_right - q0 : -kUnbounded;
  return {key < seqlen_k ? lo : kUnbounded, kMask == kWindow ? key - offset + p.window_left - q0 : kUnbounded};
}

struct BwdParams : FwdParams {
  const void* grad_out = nullptr;  // like q
  int64_t do_batch_stride = 0, do_head_stride = 0, do_row_stride = 0;
  void* grad_q = nullptr;  // like q
  void* grad_k = nullptr;  // like k
  void* grad_v = nullptr;  // like v
  int64_t dq_batch_stride = 0, dq_head_stride = 0, dq_row_stride = 0;
  int64_t dk_batch_stride = 0, dk_head_stride = 0, dk_row_stride = 0;
  int64_t dv_batch_stride = 0, dv_head_stride = 0, dv_row_stride = 0;
  float* row_dot = nullptr;   // (B, Hq, Sq) fp32: D_i = sum_d dO * O, from the preprocessing kernel
  // fp32, zeroed, for the atomic dq path (null when deterministic): per (batch, head) rows in 16 x 8
  // tiles of mma C-fragment order (attention_bwd_kernel.cuh, dq_accum_tile); tile strides below.
  // Fixed length: (B, Hq, Sq rounded up to 16, D). Varlen: (Hq, R, D), sequence b starting at the
  // 16-row tile cu[b] / 16 + b (R = 16 (total / 16 + B + 1): sequences never share a tile).
  float* dq_accum = nullptr;
  int64_t dq_accum_batch_tiles = 0, dq_accum_head_tiles = 0;  // in 16-row tiles
  int64_t dq_accum_floats = 0;  // its size; the row_dot kernel zeroes it unless dq_zero_ahead > 0
  // dq_accum zeroed by the dk/dv kernel itself (attention_bwd_kernel.cuh, DqZeroUnit): the block that
  // is the t-th of the grid's real key blocks zeroes the unit of real block t + dq_zero_ahead and
  // counts it in dq_zero_counts (an int a grid row), which a row's blocks wait on before their first
  // reduction; units below dq_zero_ahead are zeroed by attention_dq_zero_first_kernel. 0: the row_dot
  // kernel zeroes all of dq_accum. Real blocks: at fixed length every block of the grid; varlen the
  // blocks within their sequence, counted with key_block_prefix (batch + 1 ints: entry z = the
  // 128-key blocks of sequences seq_order[0, z), written by check_and_order_sequences_async).
  int64_t dq_zero_ahead = 0;
  int* dq_zero_counts = nullptr;
  const int* key_block_prefix = nullptr;  // of kBwdZeroKeyBlockRows-key blocks
  bool kv_block_slowest = false;  // set by the launcher: the dk/dv grid is (Hk, B, key blocks), heaviest first
  // The rows the 80-query dk/dv tiles' origin is rounded down to (KeyBlock): 16, or 80 (bwd_row_align).
  int bwd_row_align = 16;
};

// The key block of the warp-specialized dk/dv kernel, the one that zeroes dq_accum itself (BwdParams::
// key_block_prefix counts these).
constexpr int kBwdZeroKeyBlockRows = 128;

// Launchers, one explicit instantiation per (element type, head dim, softcap, padded head dim) in
// instantiations/*.cu; they launch on the current stream of the current device (the caller holds the
// device guard) and never synchronize. T is at::Half or at::BFloat16: c10's names, so this header and
// the host code that calls it (attention_cuda.cpp, compiled by the C++ compiler) need no CUDA headers.
// local: the window mask (causal included); kSoftcap: params.softcap_* apply; kPadHeadDim:
// params.head_dim < kHeadDim (attention_kernel_traits.h). The backward's row_dot_params is the
// problem as the row_dot kernel sees it (varlen: one sequence of all total_q rows).
// Varlen: checks cu_seqlens on the device (attention_varlen_check.cu): a device-side assert names
// what is wrong; and writes seq_order (batch ints): the sequences by decreasing len_q + len_k
// (longest_first; else 0, 1, ...), and, unless null, key_block_prefix (batch + 1 ints, BwdParams): the
// blocks of key_block_rows keys of the sequences before each in that order. Launched ahead of the
// attention kernels on the current stream.
void check_and_order_sequences_async(const int* cu_q, const int* cu_k, int batch, int64_t total_q, int64_t total_k,
                                     int64_t max_q, int64_t max_k, bool longest_first, int* seq_order,
                                     int* key_block_prefix, int key_block_rows);

// The GQA head split's dK / dV partials (attention_bwd_cuda): parts[0] (dK) and parts[1] (dV), each
// (batch, heads_kv * split, seqlen, head_dim) contiguous, partial j of KV head h at head h * split + j;
// grad[0] / grad[1] get each KV head's float32 sum (strides in elements, the head dim contiguous, every
// row 16-byte aligned; head_dim a multiple of 8). One launch on the current stream
// (attention_head_split_sum.cu); bf16, else fp16.
struct HeadSplitSumParams {
  const void* parts[2] = {nullptr, nullptr};
  void* grad[2] = {nullptr, nullptr};
  int64_t batch_stride[2] = {0, 0}, head_stride[2] = {0, 0}, row_stride[2] = {0, 0};
  int64_t batch = 0, heads_kv = 0, seqlen = 0, head_dim = 0;
  int split = 1;
};
void head_split_sum_async(const HeadSplitSumParams& p, bool bf16);

template <typename T, int kHeadDim, bool kSoftcap, bool kPadHeadDim>
void run_attention_fwd(const FwdParams& params, bool local);
template <typename T, int kHeadDim, bool kSoftcap, bool kPadHeadDim>
void run_attention_bwd(const BwdParams& params, const BwdParams& row_dot_params, bool local, bool deterministic);

}  // namespace fuseforge::attention
