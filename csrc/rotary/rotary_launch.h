// rotary's launch interface, shared by the host code (rotary_cuda.cpp, compiled by the C++ compiler)
// and the kernel (rotary_launch.cu): kernel parameters, the grid plan, the launcher.
#pragma once
#include <algorithm>
#include <cstdint>

#include "common/cuda_utils.h"

namespace fuseforge::rotary {

constexpr int kThreads = 256;        // the most threads a block
constexpr int kBatch = 4;            // heads a thread loads before it computes (its loads in flight)
constexpr int kHeadsPerThread = 8;   // heads (q's and k's together) a thread aims to take, in batches
constexpr int kMaxChunkThreads = 64; // threads across one head (more chunks: each thread takes several)
constexpr int64_t kMaxRotaryDims = 8192;       // one token's cos/sin tables must fit in shared memory
constexpr int64_t kMaxTableBytes = 32 * 1024;

// Elements of a head a thread takes at a time: one 16-byte vector of the input type.
template <typename T>
constexpr int chunk_elems() { return 16 / static_cast<int>(sizeof(T)); }

template <typename Tin, typename Tout>
struct RotaryParams {
  const Tin* q;
  const Tin* k;
  Tout* q_out;  // (B, S, Hq, D) contiguous
  Tout* k_out;  // (B, S, Hk, D) contiguous
  const float* inv_freq;     // (rot_half,)
  const void* position_ids;  // int64 or int32 (positions_int64)
  bool positions_int64;
  int64_t pos_stride_b, pos_stride_s;  // pos_stride_b 0: one row for every batch row
  int64_t q_stride_b, q_stride_h, q_stride_s;
  int64_t k_stride_b, k_stride_h, k_stride_s;
  int64_t tokens, seq;  // tokens = B * S
  int heads_q, heads_k, head_dim, rot_half;
  int rot_chunks;       // chunks of a head's R rotary dims (half-split: of its first R / 2 dims, with partners)
  int chunks_per_head;  // rot_chunks + chunks of dims R..D-1
  float cos_scaling, sin_scaling;  // attention_scaling; sin's is negated for the inverse rotation
  bool dense_token_rows;  // each token's q heads (k heads) one dense row: token t's at t * heads * head_dim
};

// The grouped-query kernel's loads go under an L2 evict-last policy where a token's q and k heads take
// 8 KB or more (H200, forward against plain loads: Llama 8B 0.0838 against 0.0854 ms, 70B 0.1454
// against 0.1514), and without one on smaller tokens, which it slowed (Llama 1B 0.0442 against
// 0.0428, Gemma 2 0.0525 against 0.0509, Qwen2 0.0402 against 0.0387).
constexpr int64_t kKeepInL2TokenBytes = 8192;
inline bool keeps_in_l2(int64_t heads_q, int64_t heads_k, int64_t head_dim, int64_t elem_bytes) {
  return (heads_q + heads_k) * head_dim * elem_bytes >= kKeepInL2TokenBytes;
}

// The kernels, tried in turn: the grouped-query token kernel (below), the token kernel (the vector
// path where a token's chunks take kTokenMinThreads..kTokenMaxThreads threads: the models' heads),
// the staged kernel (16-bit inputs on the vector path otherwise: few or small heads), the register
// kernel (the rest).
// The staged kernel: kThreads threads a block, tokens_per_block tokens' heads staged in shared
// memory, the stage about kStageBytes (several blocks an SM). A token whose heads and tables exceed
// kMaxStagedTokenBytes, or a head of more than kThreads chunks, takes the register kernel instead,
// and so do float32 inputs (4-element chunks: the register kernel keeps as many bytes in flight
// and measured 6% faster than the staged one on Llama 8B's shape).
constexpr int64_t kStageBytes = 32 * 1024;
constexpr int64_t kMaxStagedTokenBytes = 64 * 1024;

// The token kernel (vector path, any input type): a block a token, a thread a chunk of one head
// (its half-split partner with it), block (chunks_per_head, Hq + Hk), grid (S, B): each thread's
// loads go out at once, the block's tables are computed under them, and nothing walks or divides
// (6% faster than the staged kernel on the Llama shapes, docs/design/rotary.md).
constexpr int kTokenMinThreads = 128;   // fewer: too few bytes in flight a block (the staged kernel)
constexpr int kTokenMaxThreads = 1024;  // a block's limit
constexpr int kTokenMinBlocks = 2;      // 2048 threads an SM: 32 registers

enum class KernelKind { kRegister, kStaged, kToken, kTokenGqa };

// The register kernel's block is (chunk threads) x (head threads) x (tokens): threadIdx.x walks a
// head's chunks, threadIdx.y its token's heads (q's, then k's), threadIdx.z the block's tokens. The
// staged kernel's is kThreads threads in x.
struct LaunchPlan {
  dim3 grid, block;
  size_t smem_bytes = 0;     // the tables (register, token kernels); the stage and the tables (staged)
  int tokens_per_block = 0;  // the staged kernel's
  KernelKind kernel = KernelKind::kRegister;
};

// The token kernel's plan, or kernel kRegister when the shape does not fit it.
inline LaunchPlan plan_token(int64_t batch, int64_t seq, int64_t heads, int64_t chunks_per_head, int64_t rot_half) {
  LaunchPlan plan;
  const int64_t threads = heads * chunks_per_head;
  if (threads < kTokenMinThreads || threads > kTokenMaxThreads || batch > 65535 || seq > INT32_MAX) return plan;
  plan.kernel = KernelKind::kToken;
  plan.block = dim3(static_cast<unsigned>(chunks_per_head), static_cast<unsigned>(heads));
  plan.grid = dim3(static_cast<unsigned>(seq), static_cast<unsigned>(batch));
  plan.smem_bytes = static_cast<size_t>(2 * rot_half * static_cast<int64_t>(sizeof(float)));
  return plan;
}

// The grouped-query token kernel (rotary_token_gqa_kernel): 16-bit q and k of the output's type,
// half-split, every dim rotary, Hq = r Hk for r = 2, 4 or 8, Hq x chunks_per_head threads a token
// (the token kernel's range). Its plan, or kernel kRegister when the shape does not fit it.
inline bool gqa_ratio_supported(int64_t ratio) { return ratio == 2 || ratio == 4 || ratio == 8; }

inline LaunchPlan plan_token_gqa(int64_t batch, int64_t seq, int64_t heads_q, int64_t heads_k, int64_t chunks_per_head,
                                 int64_t rot_half) {
  LaunchPlan plan;
  if (heads_k == 0 || heads_q % heads_k != 0 || !gqa_ratio_supported(heads_q / heads_k)) return plan;
  plan = plan_token(batch, seq, heads_q, chunks_per_head, rot_half);
  if (plan.kernel == KernelKind::kToken) plan.kernel = KernelKind::kTokenGqa;
  return plan;
}

// The staged kernel's plan, or kernel kRegister when the shape does not fit it.
inline LaunchPlan plan_staged(int64_t tokens, int64_t heads, int64_t head_dim, int64_t chunk_elems,
                              int64_t chunks_per_head, int64_t rot_half, int64_t elem_bytes) {
  LaunchPlan plan;
  const int64_t token_bytes = heads * head_dim * elem_bytes + 2 * rot_half * static_cast<int64_t>(sizeof(float));
  if (elem_bytes != 2 || token_bytes > kMaxStagedTokenBytes || head_dim / chunk_elems > kThreads ||
      chunks_per_head > kThreads)
    return plan;
  const int64_t per_block = std::clamp<int64_t>(kStageBytes / token_bytes, 1, std::max<int64_t>(tokens, 1));
  plan.tokens_per_block = static_cast<int>(per_block);
  plan.kernel = KernelKind::kStaged;
  plan.block = dim3(kThreads);
  plan.grid = dim3(static_cast<unsigned>(ceil_div(tokens, per_block)));
  plan.smem_bytes = static_cast<size_t>(per_block * token_bytes);
  return plan;
}

inline LaunchPlan plan_launch(int64_t tokens, int64_t heads, int64_t chunks_per_head, int64_t rot_half) {
  const int64_t tx = std::min<int64_t>(chunks_per_head, kMaxChunkThreads);
  const int64_t ty = std::clamp<int64_t>(ceil_div(heads, kHeadsPerThread), 1, kThreads / tx);
  const int64_t table_bytes = 2 * rot_half * static_cast<int64_t>(sizeof(float));
  // 64: blockDim.z's limit; the tables stay under 32 KB (several blocks an SM).
  const int64_t tz = std::clamp<int64_t>(std::min(kThreads / (tx * ty), kMaxTableBytes / table_bytes), 1, 64);
  LaunchPlan plan;
  plan.block = dim3(static_cast<unsigned>(tx), static_cast<unsigned>(ty), static_cast<unsigned>(tz));
  plan.grid = dim3(static_cast<unsigned>(ceil_div(tokens, tz)));
  plan.smem_bytes = static_cast<size_t>(tz * table_bytes);
  return plan;
}

// Defined in rotary_launch.cu for every pair of float, at::Half, at::BFloat16; launches on the
// current stream and never synchronizes. vectorized: every chunk is whole and 16-byte aligned.
template <typename Tin, typename Tout>
void launch_rotary(const RotaryParams<Tin, Tout>& params, const LaunchPlan& plan, bool interleaved, bool vectorized);

}  // namespace fuseforge::rotary
