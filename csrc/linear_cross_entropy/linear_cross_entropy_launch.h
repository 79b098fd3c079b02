// linear_cross_entropy's launch interface, shared by the host code (linear_cross_entropy_cuda.cpp,
// compiled by the C++ compiler) and the kernels (*.cu): kernel parameters and launchers.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace fuseforge::linear_cross_entropy {

// Logits tile [rows) x [cols) of a float32 buffer (row stride ld_logits); tile column 0 is vocabulary
// index col_begin.
template <typename T>
struct RowParams {
  const float* logits = nullptr;
  // Or the logits in T (16-bit inputs; same ld_logits): cuBLAS's 16-bit output. Cluster kernel: bf16,
  // reduced losses; stream kernel: the low-memory strategy's gradient pass (lse given).
  const T* logits_lowp = nullptr;
  int64_t ld_logits = 0;
  T* dz = nullptr;  // gradient tile (row stride ld_dz) or nullptr: no gradient
  int64_t ld_dz = 0;
  const T* bias = nullptr;  // (vocab,) or nullptr
  const int64_t* target = nullptr;
  int64_t rows = 0, cols = 0, col_begin = 0, vocab = 0;
  int64_t ignore_index = -100;
  float label_smoothing = 0.f, z_loss = 0.f, softcap = 0.f;
  const float* row_scale = nullptr;     // per-row gradient weight, or nullptr
  const float* scalar_scale = nullptr;  // one device float (1/count, grad_output), or nullptr
  // Running statistics across vocabulary tiles (stream kernel, low-memory strategy), or nullptr.
  float* run_max = nullptr;
  float* run_sum = nullptr;
  float* run_sumz = nullptr;
  float* run_zt = nullptr;
  bool first_tile = true, last_tile = true;
  // Per-row statistics: lse and nll = -log p(target) (kept apart from lse - z_target, which cancels
  // when the target dominates). Known statistics (stats_in): gradient only.
  // Exact float32 target logits x . W[t] of the launch's rows (launch_target_logits), or nullptr:
  // cuBLAS's logit is used for the target too.
  const float* target_logit = nullptr;
  // Exact per-row sums of the logits (x . colsum(W) + sum(bias); label smoothing on bf16 logits
  // without softcap), or nullptr: the kernel sums the logits it reads.
  const float* row_sumz = nullptr;
  const float* lse_in = nullptr;
  const float* nll_in = nullptr;
  float* lse_out = nullptr;
  float* nll_out = nullptr;
  float* loss_out = nullptr;
};

// The stream kernel's parameters: RowParams and the entropy of each row's (capped) logits, for
// per-token losses (apart from RowParams, so the cluster kernel's parameters stay as they are).
// H = log S - A / S with S = sum exp(z - max) and A = sum exp(z - max) (z - max): two terms >= 0.
template <typename T>
struct StreamParams : RowParams<T> {
  float* entropy_out = nullptr;          // forward: per-row H (0 for ignored rows), or nullptr
  float* run_ent = nullptr;              // running A across vocabulary tiles (with run_max), or nullptr
  const float* entropy_in = nullptr;     // recomputing backward: the forward's H ...
  const float* entropy_scale = nullptr;  // ... and its per-row upstream gradient, or nullptr: none
  // Gradient pass of whole rows (16-bit T): each row's target entry of dz minus its rounding to T
  // (0 for ignored rows), so the host can add it back in float32 (launch_add_target_rows,
  // launch_scatter_target_rows); or nullptr.
  float* target_residual = nullptr;
};

constexpr int kClusterSize = 8;
constexpr int kClusterThreads = 512;
constexpr int kStreamThreads = 256;

// Launchers (linear_cross_entropy_cluster.cu, linear_cross_entropy_stream.cu).
// Whether the cluster kernel runs on the current device: compute capability 9.0 or later, with the
// kernel's sm_90+ code (below sm_90 it is a trap, never launched).
bool cluster_kernel_runnable();
// persistent: as many clusters as the GPU holds at once, each looping over rows (else one a row).
template <typename T>
void launch_row_softmax_cluster(const RowParams<T>& p, bool persistent);
template <typename T>
void launch_row_softmax_stream(const StreamParams<T>& p);
template <typename T>
void launch_scale(T* data, int64_t n, const float* a, const float* b);
// out[r] = x[r] . weight[target[r]] in float32 for r < rows (x rows x hidden, weight vocab x hidden,
// both contiguous); 0 where the target is ignore_index or out of range.
template <typename T>
void launch_target_logits(const T* x, const T* weight, const int64_t* target, int64_t rows, int64_t hidden,
                          int64_t vocab, int64_t ignore_index, float* out);
// The target entries' roundings put back (rows' residuals from the stream kernel's target_residual):
// grad_x[r] = T(acc[r] + residual[r] * weight[target[r]]) for r < rows, acc the float32 dz @ W rows;
// and, over all rows at once, w_acc[t] += sum residual[r] * x[r] (b_acc[t] += sum residual[r]) over
// the rows r whose target is t, summed in sorted (stable) order: deterministic. sorted_target and
// order: the targets sorted and their row indices; w_acc or b_acc may be nullptr.
template <typename T>
void launch_add_target_rows(const float* acc, const T* weight, const int64_t* target, const float* residual,
                            int64_t rows, int64_t hidden, int64_t vocab, T* grad_x);
template <typename T>
void launch_scatter_target_rows(const int64_t* sorted_target, const int64_t* order, const float* residual,
                                const T* x, int64_t rows, int64_t hidden, int64_t vocab, float* w_acc, float* b_acc);
// Largest vocabulary the cluster kernel holds in registers.
constexpr int64_t kClusterMaxVocab = int64_t{kClusterSize} * kClusterThreads * 4 * 16;

}  // namespace fuseforge::linear_cross_entropy
