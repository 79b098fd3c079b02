// What the attention kernels take: one params struct of raw pointers and int64 element strides,
// passed by value, shared by the forward and backward launchers (no torch types, so a later Hopper
// wgmma/TMA path can take the same struct).
#pragma once
#include <cstdint>

namespace fuseforge::attention {

struct FwdParams {
  // q (B, Hq, Sq, D), k/v (B, Hk, Sk, D), out like q: any strides, the last dim contiguous.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // (B, Hq, Sq) contiguous, natural log; -inf for rows that see no key
  int64_t q_batch_stride = 0, q_head_stride = 0, q_row_stride = 0;
  int64_t k_batch_stride = 0, k_head_stride = 0, k_row_stride = 0;
  int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0;
  int64_t out_batch_stride = 0, out_head_stride = 0, out_row_stride = 0;
  int batch = 0, heads_q = 0, heads_kv = 0, group = 1;  // group = Hq / Hk
  int seqlen_q = 0, seqlen_k = 0;
  float scale = 1.f;       // on q k^T
  float scale_log2 = 1.f;  // scale * log2(e): the kernels use exp2
};

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
  // fp32, zeroed, for the atomic dq path (null when deterministic): (B, Hq, Sq rounded up to 16, D)
  // elements in 16 x 8 tiles of mma C-fragment order (attention_bwd_kernel.cuh, dq_accum_tile).
  float* dq_accum = nullptr;
  bool kv_block_slowest = false;  // set by the launcher: the dk/dv grid is (Hk, B, key blocks), heaviest first
};

// Launchers, one explicit instantiation per (element type, head dim) in instantiations/*.cu; they
// launch on the current stream of the current device (the caller holds the device guard) and never
// synchronize. T is at::Half or at::BFloat16: c10's names, so this header and the host code that
// calls it (attention_cuda.cpp, compiled by the C++ compiler) need no CUDA headers.
template <typename T, int kHeadDim>
void run_attention_fwd(const FwdParams& params, bool causal);
template <typename T, int kHeadDim>
void run_attention_bwd(const BwdParams& params, bool causal, bool deterministic);

}  // namespace fuseforge::attention
