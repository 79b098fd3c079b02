// linear_cross_entropy CUDA implementation, host side: the chunk plans, the cuBLAS matrix products
// (through at::mm / at::addmm, float32 accumulation) and the launches of the row-softmax kernels.
// No host sync anywhere: the mean's divisor stays a device scalar. Compiled by the C++ compiler, not
// nvcc (errors thrown here unwind through C++ frames only).
//
// Default strategy (row chunks), per super-chunk of S rows:
//   for each sub-chunk of c rows:  logits(c x V) = x_c @ W^T                  (cuBLAS)
//                                  loss, lse, dz(c x V, input dtype)          (cluster row-softmax)
//   grad_x[S rows] = dz_S @ W ;  grad_W (+)= dz_S^T @ x_S ;  grad_b += sum(dz_S)   (cuBLAS)
// Logits in float32 in a staging chunk (workspace 4cV + sizeof(T) S V bytes <= kWorkspaceBudget),
// or, for bf16 with gradients on the cluster path, in bf16 straight into the dz rows, which the
// cluster kernel overwrites with dz in place (workspace 2 S V bytes; c = S by default), or, for a
// bf16 loss-only forward, in a bf16 staging chunk of twice the rows. grad_W
// accumulates in cuBLAS (float32 inside, one rounding to T a super-chunk): at most
// kMaxRoundedPasses passes, else a float32 V x H accumulator.
//
// Low-memory strategy (recomputation; workspace a few percent of the gradients): pass 1 over
// (row, vocab) tiles of float32 logits merges running per-row statistics into lse and the loss,
// before the gradients are allocated. Pass 2, in at most kMaxRoundedPasses row blocks of B rows:
//   for each vocabulary chunk of C columns:  logits(B x C) = x_B @ W_C^T in T, dz in place (lse known)
//                                            grad_W[C rows] (+)= dz^T @ x_B   (one rounding a block)
//                                            acc(B x H, float32) (+)= dz @ W_C
//   grad_x[B rows] = acc
// Four GEMMs instead of three; workspace B x H float32 + B x C in T (48 MiB at N = 8192, H = 4096).
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mv.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/sum.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#include "common/checks.h"
#include "common/cuda_utils.h"
#include "common/dispatch.h"
#include "common/env.h"
#include "linear_cross_entropy/linear_cross_entropy.h"
#include "linear_cross_entropy/linear_cross_entropy_launch.h"

namespace fuseforge::linear_cross_entropy {
namespace {

constexpr int64_t kWorkspaceBudget = int64_t{768} << 20;  // bytes, default strategy
constexpr int64_t kMaxRoundedPasses = 4;                  // low-precision roundings of grad_W per element
constexpr int64_t kMaxSuperRows = 8192;
constexpr int64_t kLowMemStatsBytes = int64_t{64} << 20;  // low-memory pass 1: float32 logits tile
constexpr int64_t kLowMemStatsCols = 8192;
constexpr int64_t kLowMemCols = 4096;                     // low-memory pass 2: vocabulary chunk
constexpr int64_t kLowMemMinRows = 1024;                  // ... and smallest row block

struct Plan {
  int64_t sub_rows = 0, super_rows = 0;
  bool fp32_weight_acc = false;
  bool bf16_logits = false;  // GEMM1 writes bf16 logits (bf16 inputs, cluster kernel), else float32
  bool in_place = false;     // ... straight into the dz rows (gradients in the forward)
};

// Every row's target logit as an exact float32 dot product x . W[t] (one small kernel, N x H reads);
// the row kernels use it in place of cuBLAS's for the target column. cuBLAS's tensor-core float32
// accumulation leaves the target logit ~1e-4 low at |z| ~ 14, and on a confident model the loss moves
// by that much: on the H100 the peaky case's loss error goes from 1.43e-4 to 9.2e-8 for 0.0-0.3 ms
// (docs/design/linear_cross_entropy.md).
template <typename T>
at::Tensor target_logits(const Problem& p) {
  if (p.rows == 0) return at::Tensor();
  at::Tensor out = at::empty({p.rows}, p.x2d.options().dtype(at::kFloat));
  launch_target_logits<T>(p.x2d.const_data_ptr<T>(), p.weight.const_data_ptr<T>(), p.target.const_data_ptr<int64_t>(),
                          p.rows, p.hidden, p.vocab, p.cfg.ignore_index, out.mutable_data_ptr<float>());
  return out;
}

// Development knobs (benchmarking the chunk plan, common/env.h): FUSEFORGE_LCE_SUB_ROWS,
// FUSEFORGE_LCE_WORKSPACE_MIB (default strategy), FUSEFORGE_LCE_LOWMEM_COLS (low-memory strategy).
Plan plan_rows(const Problem& p, bool want_weight_grad, bool bf16_logits, bool in_place) {
  Plan plan;
  plan.bf16_logits = bf16_logits;
  plan.in_place = in_place;
  const int64_t esize = p.x2d.element_size();
  const int64_t budget = env_positive_int("FUSEFORGE_LCE_WORKSPACE_MIB", kWorkspaceBudget >> 20) << 20;
  const int64_t rows = std::max<int64_t>(p.rows, 1);
  if (in_place) {
    // GEMM1 writes bf16 logits straight into the super-chunk's dz rows and the cluster kernel turns
    // them into dz in place: no staging, so the whole budget is dz rows (3072 at V = 128256), and by
    // default one GEMM1 a super-chunk (larger products run faster).
    int64_t s = std::clamp<int64_t>(budget / (esize * p.vocab) / 256 * 256, 256, kMaxSuperRows);
    s = std::min(s, rows);
    plan.sub_rows = std::min(dev_positive_int("FUSEFORGE_LCE_SUB_ROWS", s), s);
    plan.super_rows = s / plan.sub_rows * plan.sub_rows;
  } else {
    // A staging chunk of logits: 512 float32 rows (256 for V > 196608), or twice the rows in bf16.
    const int64_t logit_bytes = bf16_logits ? 2 : 4;
    const int64_t default_rows = (p.vocab > 196608 ? 256 : 512) * (4 / logit_bytes);
    plan.sub_rows = std::min<int64_t>(dev_positive_int("FUSEFORGE_LCE_SUB_ROWS", default_rows), rows);
    const int64_t staging = logit_bytes * plan.sub_rows * p.vocab;
    int64_t s = (budget - staging) / (esize * p.vocab);
    s = std::clamp<int64_t>(s / plan.sub_rows * plan.sub_rows, plan.sub_rows, kMaxSuperRows);
    plan.super_rows = std::min<int64_t>(s, ceil_div(rows, plan.sub_rows) * plan.sub_rows);
  }
  const int64_t passes = ceil_div(p.rows, plan.super_rows);
  plan.fp32_weight_acc = want_weight_grad && p.x2d.scalar_type() != at::kFloat && passes > kMaxRoundedPasses;
  return plan;
}

// Logits of rows x (vocab columns [v0, v0 + cols)) in float32 into `out` (contiguous rows x cols).
void logits_gemm(at::Tensor& out, const at::Tensor& x_rows, const at::Tensor& w_rows) {
  if (x_rows.scalar_type() == at::kFloat) {
    at::mm_out(out, x_rows, w_rows.t());
  } else {
    at::mm_out(out, x_rows, w_rows.t(), at::kFloat);  // bf16/fp16 inputs, float32 accumulate and output
  }
}

// acc (+)= a @ b with acc float32 and a, b in the input dtype.
void gemm_accumulate_fp32(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b, bool first) {
  if (a.scalar_type() == at::kFloat) {
    if (first) at::mm_out(acc, a, b);
    else acc.addmm_(a, b);
  } else {
    if (first) at::mm_out(acc, a, b, at::kFloat);
    else at::addmm_out(acc, acc, a, b, at::kFloat, 1, 1);
  }
}

// A launch starting at row r0: the per-row inputs (targets, exact target logits, gradient weights)
// advanced to it.
template <typename T>
StreamParams<T> at_row(StreamParams<T> q, int64_t r0) {
  q.target += r0;
  if (q.target_logit) q.target_logit += r0;
  if (q.row_sumz) q.row_sumz += r0;
  if (q.row_scale) q.row_scale += r0;
  if (q.entropy_scale) q.entropy_scale += r0;
  if (q.target_residual) q.target_residual += r0;
  return q;
}

// (StreamParams: the cluster kernel takes its RowParams part.)
template <typename T>
StreamParams<T> base_params(const Problem& p, const std::optional<at::Tensor>& row_scale,
                            const std::optional<at::Tensor>& scalar_scale, const at::Tensor& target_logit) {
  StreamParams<T> rp;
  rp.target = p.target.const_data_ptr<int64_t>();
  rp.target_logit = target_logit.defined() ? target_logit.const_data_ptr<float>() : nullptr;
  rp.bias = p.bias.defined() ? p.bias.const_data_ptr<T>() : nullptr;
  rp.vocab = p.vocab;
  rp.ignore_index = p.cfg.ignore_index;
  rp.label_smoothing = static_cast<float>(p.cfg.label_smoothing);
  rp.z_loss = static_cast<float>(p.cfg.z_loss);
  rp.softcap = static_cast<float>(p.cfg.softcap);
  rp.row_scale = row_scale.has_value() ? row_scale->const_data_ptr<float>() : nullptr;
  rp.scalar_scale = scalar_scale.has_value() ? scalar_scale->const_data_ptr<float>() : nullptr;
  return rp;
}

struct Outputs {
  at::Tensor row_losses, stats, grad_x, grad_weight, grad_bias;  // stats (2, N): lse, nll
  at::Tensor entropy;                                             // (N,) when asked for
};

// Gradient weights: row_scale (per row) and/or scalar_scale (device scalar) multiply dz.
struct GradSpec {
  bool enabled = false;
  GradRequest want;
  std::optional<at::Tensor> row_scale, scalar_scale;
  std::optional<at::Tensor> stats_in;  // known (lse, nll) rows (recomputing backward)
  EntropyGrad entropy;                 // the forward's entropies and their gradient (recomputing backward)
};

// The entropy's pointers: its gradient (per row, advanced by at_row) and the forward's values
// (advanced with lse_in where they are used).
template <typename T>
void set_entropy_grad(StreamParams<T>& rp, const GradSpec& g) {
  if (!g.entropy.defined()) return;
  rp.entropy_in = g.entropy.entropy.const_data_ptr<float>();
  rp.entropy_scale = g.entropy.grad.const_data_ptr<float>();
}

void allocate_grads(const Problem& p, const GradSpec& g, Outputs& o) {
  if (!g.enabled) return;
  const auto opts = p.x2d.options();
  if (g.want.x) o.grad_x = at::empty({p.rows, p.hidden}, opts);
  if (g.want.weight) o.grad_weight = at::empty({p.vocab, p.hidden}, opts);
  if (g.want.bias) o.grad_bias = at::empty({p.vocab}, opts);
}

template <typename T>
void run_default(const Problem& p, const GradSpec& g, Outputs& o) {
  allocate_grads(p, g, o);
  // The cluster kernel needs compute capability 9.0 (thread block clusters); below, e.g. on an A100,
  // the stream kernel takes every row.
  // The entropy (per-token losses only) is the stream kernel's.
  const bool cluster = p.vocab % 4 == 0 && p.vocab <= kClusterMaxVocab && !g.stats_in.has_value() &&
                       !o.entropy.defined() && cluster_kernel_runnable();
  // Development knob FUSEFORGE_LCE_PERSISTENT: 1, as many clusters as the GPU holds, each looping over
  // rows; 0, one cluster a row.
  const bool persistent = dev_flag("FUSEFORGE_LCE_PERSISTENT", true);
  // With bf16 inputs the cluster kernel reads cuBLAS's bf16 logits (float32 accumulation, one
  // rounding): 2 bytes a logit written and read instead of 4. The exact float32 target logit keeps
  // the loss and the target's gradient; the other logits' rounding moves neither the loss error nor
  // the gradient error against float64 (emulated on the benchmark's inputs, normal and peaky). Used for a reduced loss (mean,
  // sum) whose gradients come from the same pass (in place, in the dz rows) or are not wanted at all;
  // not for per-token losses (their bf16-logit error, up to 5e-4 relative on large logits, does not
  // average out) nor where a recomputing backward reads float32 logits against this pass's lse.
  const bool bf16_cluster = std::is_same_v<T, at::BFloat16> && cluster && p.cfg.reduction != Reduction::kNone;
  const bool in_place = bf16_cluster && g.enabled;
  Plan plan = plan_rows(p, g.enabled && g.want.weight, in_place || (bf16_cluster && !g.want.any()), in_place);
  // Per-token gradients (16-bit): every row's dz has its own weight, and its largest entry, the
  // target's, is the one whose rounding to T the gradients would carry (sqrt(2) the error of the
  // outputs' own rounding). The stream kernel keeps that rounding's residual and the host adds it
  // back in float32: grad_x through a float32 product, grad_W and grad_b in float32 accumulators.
  constexpr bool kLowp = !std::is_same_v<T, float>;
  const bool compensate = kLowp && g.enabled && g.row_scale.has_value() && !cluster;
  if (compensate && g.want.weight) plan.fp32_weight_acc = true;
  const auto f32 = p.x2d.options().dtype(at::kFloat);
  at::Tensor staging = plan.in_place ? at::Tensor()
                                     : at::empty({plan.sub_rows * p.vocab}, plan.bf16_logits ? p.x2d.options() : f32);
  at::Tensor dz_buf, w_acc, b_acc;
  if (g.enabled) {
    dz_buf = at::empty({plan.super_rows, p.vocab}, p.x2d.options());
    if (g.want.weight && plan.fp32_weight_acc) w_acc = at::empty({p.vocab, p.hidden}, f32);
    if (g.want.bias) b_acc = at::zeros({p.vocab}, f32);
  }
  at::Tensor residual, gx_acc;
  if (compensate) {
    residual = at::empty({p.rows}, f32);
    if (g.want.x) gx_acc = at::empty({plan.super_rows, p.hidden}, f32);
  }
  at::Tensor& w_out = plan.fp32_weight_acc ? w_acc : o.grad_weight;
  const at::Tensor exact_zt = target_logits<T>(p);
  StreamParams<T> rp = base_params<T>(p, g.row_scale, g.scalar_scale, exact_zt);
  set_entropy_grad(rp, g);
  if (compensate) rp.target_residual = residual.mutable_data_ptr<float>();
  rp.cols = p.vocab;
  rp.ld_logits = p.vocab;
  rp.ld_dz = p.vocab;
  // Label smoothing reads sum(z) over every logit: from bf16 logits each one's rounding would reach
  // the loss (9e-5 relative measured on larger logits), so the sum is formed exactly instead.
  at::Tensor row_sumz;
  if (plan.bf16_logits && p.cfg.label_smoothing > 0.0 && !(p.cfg.softcap > 0.0) && p.rows > 0) {
    at::Tensor colsum = at::sum(p.weight, {0}, false, at::kFloat);  // (H,)
    row_sumz = at::empty({p.rows}, colsum.options());
    for (int64_t r0 = 0; r0 < p.rows; r0 += plan.sub_rows) {  // float32 x a sub-chunk at a time
      const int64_t rn = std::min(plan.sub_rows, p.rows - r0);
      at::Tensor out = row_sumz.narrow(0, r0, rn);
      at::mv_out(out, p.x2d.narrow(0, r0, rn).to(at::kFloat), colsum);
    }
    if (p.bias.defined()) row_sumz.add_(at::sum(p.bias, {0}, false, at::kFloat));
    rp.row_sumz = row_sumz.const_data_ptr<float>();
  }
  if (g.stats_in.has_value()) {
    rp.lse_in = (*g.stats_in)[0].const_data_ptr<float>();
    rp.nll_in = (*g.stats_in)[1].const_data_ptr<float>();
  }
  bool first_pass = true;
  for (int64_t s0 = 0; s0 < p.rows; s0 += plan.super_rows) {
    const int64_t s_rows = std::min(plan.super_rows, p.rows - s0);
    for (int64_t c0 = s0; c0 < s0 + s_rows; c0 += plan.sub_rows) {
      const int64_t c_rows = std::min(plan.sub_rows, s0 + s_rows - c0);
      StreamParams<T> q = at_row(rp, c0);
      if (plan.bf16_logits) {  // in place: into this sub-chunk's dz rows, turned into dz
        at::Tensor logits = plan.in_place ? dz_buf.narrow(0, c0 - s0, c_rows)
                                          : staging.narrow(0, 0, c_rows * p.vocab).view({c_rows, p.vocab});
        at::mm_out(logits, p.x2d.narrow(0, c0, c_rows), p.weight.t());
        q.logits_lowp = logits.const_data_ptr<T>();
      } else {
        at::Tensor logits = staging.narrow(0, 0, c_rows * p.vocab).view({c_rows, p.vocab});
        logits_gemm(logits, p.x2d.narrow(0, c0, c_rows), p.weight);
        q.logits = logits.const_data_ptr<float>();
      }
      q.rows = c_rows;
      if (q.lse_in) {
        q.lse_in += c0;
        q.nll_in += c0;
        if (q.entropy_in) q.entropy_in += c0;
      } else {
        q.lse_out = o.stats[0].mutable_data_ptr<float>() + c0;
        q.nll_out = o.stats[1].mutable_data_ptr<float>() + c0;
        q.loss_out = o.row_losses.mutable_data_ptr<float>() + c0;
        if (o.entropy.defined()) q.entropy_out = o.entropy.mutable_data_ptr<float>() + c0;
      }
      q.dz = g.enabled ? dz_buf.mutable_data_ptr<T>() + (c0 - s0) * p.vocab : nullptr;
      if (cluster && (q.dz || plan.bf16_logits)) {
        launch_row_softmax_cluster<T>(q, persistent);
      } else {
        launch_row_softmax_stream<T>(q);
      }
    }
    if (!g.enabled) continue;
    const at::Tensor dz = dz_buf.narrow(0, 0, s_rows);
    const at::Tensor x_rows = p.x2d.narrow(0, s0, s_rows);
    if (g.want.x) {
      at::Tensor gx_rows = o.grad_x.narrow(0, s0, s_rows);
      if (compensate) {
        if constexpr (kLowp) {  // (the residual launchers exist for 16-bit types only)
          at::Tensor acc = gx_acc.narrow(0, 0, s_rows);
          at::mm_out(acc, dz, p.weight, at::kFloat);
          launch_add_target_rows<T>(acc.const_data_ptr<float>(), p.weight.const_data_ptr<T>(),
                                    p.target.const_data_ptr<int64_t>() + s0, residual.const_data_ptr<float>() + s0,
                                    s_rows, p.hidden, p.vocab, gx_rows.mutable_data_ptr<T>());
        }
      } else {
        at::mm_out(gx_rows, dz, p.weight);
      }
    }
    if (g.want.weight) {
      if (plan.fp32_weight_acc) {
        gemm_accumulate_fp32(w_out, dz.t(), x_rows, first_pass);
      } else if (first_pass) {
        at::mm_out(w_out, dz.t(), x_rows);
      } else {
        w_out.addmm_(dz.t(), x_rows);  // cuBLAS beta = 1: float32 inside, one rounding to T
      }
    }
    if (g.want.bias) b_acc.add_(at::sum(dz, {0}, false, at::kFloat));
    first_pass = false;
  }
  if (!g.enabled) return;
  if constexpr (kLowp) {
    if (compensate && (g.want.weight || g.want.bias) && p.rows > 0) {
      const auto [sorted, order] = at::sort(p.target, /*stable=*/true, /*dim=*/0, /*descending=*/false);
      launch_scatter_target_rows<T>(sorted.const_data_ptr<int64_t>(), order.const_data_ptr<int64_t>(),
                                    residual.const_data_ptr<float>(), p.x2d.const_data_ptr<T>(), p.rows, p.hidden,
                                    p.vocab, g.want.weight ? w_acc.mutable_data_ptr<float>() : nullptr,
                                    g.want.bias ? b_acc.mutable_data_ptr<float>() : nullptr);
    }
  }
  if (g.want.weight) {
    if (p.rows == 0) o.grad_weight.zero_();
    else if (plan.fp32_weight_acc) o.grad_weight.copy_(w_acc);
  }
  if (g.want.bias) o.grad_bias.copy_(b_acc);
}

template <typename T>
void run_low_memory(const Problem& p, const GradSpec& g, Outputs& o) {
  const auto f32 = p.x2d.options().dtype(at::kFloat);
  const at::Tensor exact_zt = target_logits<T>(p);
  StreamParams<T> rp = base_params<T>(p, g.row_scale, g.scalar_scale, exact_zt);
  set_entropy_grad(rp, g);

  if (!g.stats_in.has_value()) {  // pass 1: lse and loss from running per-row statistics
    // Large enough tiles for full-speed products (2048 x 8192 at most); freed before the gradients
    // are allocated, so they do not add to the peak.
    const int64_t tile_cols = std::min<int64_t>(kLowMemStatsCols, p.vocab);
    const int64_t tile_rows = std::clamp<int64_t>(kLowMemStatsBytes / (4 * tile_cols), 1, std::max<int64_t>(p.rows, 1));
    at::Tensor tile = at::empty({tile_rows * tile_cols}, f32);
    const bool entropy = o.entropy.defined();
    at::Tensor run = at::empty({entropy ? 5 : 4, p.rows}, f32);
    for (int64_t n0 = 0; n0 < p.rows; n0 += tile_rows) {
      const int64_t rn = std::min(tile_rows, p.rows - n0);
      for (int64_t v0 = 0; v0 < p.vocab; v0 += tile_cols) {
        const int64_t vc = std::min(tile_cols, p.vocab - v0);
        at::Tensor logits = tile.narrow(0, 0, rn * vc).view({rn, vc});
        logits_gemm(logits, p.x2d.narrow(0, n0, rn), p.weight.narrow(0, v0, vc));
        StreamParams<T> q = at_row(rp, n0);  // (no gradient in this pass: the weights go unread)
        q.logits = logits.const_data_ptr<float>();
        q.ld_logits = vc;
        q.rows = rn;
        q.cols = vc;
        q.col_begin = v0;
        q.run_max = run[0].mutable_data_ptr<float>() + n0;
        q.run_sum = run[1].mutable_data_ptr<float>() + n0;
        q.run_sumz = run[2].mutable_data_ptr<float>() + n0;
        q.run_zt = run[3].mutable_data_ptr<float>() + n0;
        if (entropy) {
          q.run_ent = run[4].mutable_data_ptr<float>() + n0;
          q.entropy_out = o.entropy.mutable_data_ptr<float>() + n0;
        }
        q.first_tile = v0 == 0;
        q.last_tile = v0 + vc == p.vocab;
        q.lse_out = o.stats[0].mutable_data_ptr<float>() + n0;
        q.nll_out = o.stats[1].mutable_data_ptr<float>() + n0;
        q.loss_out = o.row_losses.mutable_data_ptr<float>() + n0;
        launch_row_softmax_stream<T>(q);
      }
    }
  }
  if (!g.enabled) return;
  allocate_grads(p, g, o);
  const at::Tensor& stats = g.stats_in.has_value() ? *g.stats_in : o.stats;
  const float* lse = stats[0].const_data_ptr<float>();
  const float* nll = stats[1].const_data_ptr<float>();
  constexpr bool kFp32 = std::is_same_v<T, float>;
  // Row blocks: grad_W gets one rounding to T a block (cuBLAS beta = 1, float32 inside), so at most
  // kMaxRoundedPasses blocks, the default strategy's bound; grad_x is exact per block (float32
  // accumulator over the vocabulary chunks). The logits of a chunk are cuBLAS's T output (float32
  // accumulation, one rounding; the target's logit is the exact float32 one), turned into dz in place.
  const int64_t rows = std::max<int64_t>(p.rows, 1);
  const int64_t block = std::min(rows, std::max(ceil_div(ceil_div(rows, kMaxRoundedPasses), 128) * 128, kLowMemMinRows));
  // Development knob FUSEFORGE_LCE_LOWMEM_COLS: the vocabulary chunk.
  const int64_t cols = std::min<int64_t>(dev_positive_int("FUSEFORGE_LCE_LOWMEM_COLS", kLowMemCols), p.vocab);
  at::Tensor tile = at::empty({block * cols}, p.x2d.options());
  at::Tensor gx_acc, b_acc;
  if (g.want.x && !kFp32) gx_acc = at::empty({block, p.hidden}, f32);
  if (g.want.bias) b_acc = at::zeros({p.vocab}, f32);
  for (int64_t n0 = 0; n0 < p.rows; n0 += block) {
    const int64_t rn = std::min(block, p.rows - n0);
    const at::Tensor x_rows = p.x2d.narrow(0, n0, rn);
    at::Tensor gx_rows;
    if (g.want.x) gx_rows = kFp32 ? o.grad_x.narrow(0, n0, rn) : gx_acc.narrow(0, 0, rn);
    for (int64_t v0 = 0; v0 < p.vocab; v0 += cols) {
      const int64_t vc = std::min(cols, p.vocab - v0);
      const at::Tensor w_rows = p.weight.narrow(0, v0, vc);
      at::Tensor dz = tile.narrow(0, 0, rn * vc).view({rn, vc});
      at::mm_out(dz, x_rows, w_rows.t());  // the logits, until the kernel below
      StreamParams<T> q = at_row(rp, n0);
      if constexpr (kFp32) {
        q.logits = dz.const_data_ptr<float>();
      } else {
        q.logits_lowp = dz.const_data_ptr<T>();
      }
      q.ld_logits = vc;
      q.dz = dz.mutable_data_ptr<T>();
      q.ld_dz = vc;
      q.rows = rn;
      q.cols = vc;
      q.col_begin = v0;
      q.lse_in = lse + n0;
      q.nll_in = nll + n0;
      if (q.entropy_in) q.entropy_in += n0;
      launch_row_softmax_stream<T>(q);
      if (g.want.weight) {
        at::Tensor gw_rows = o.grad_weight.narrow(0, v0, vc);
        if (n0 == 0) at::mm_out(gw_rows, dz.t(), x_rows);
        else gw_rows.addmm_(dz.t(), x_rows);
      }
      if (g.want.x) gemm_accumulate_fp32(gx_rows, dz, w_rows, v0 == 0);
      if (g.want.bias) b_acc.narrow(0, v0, vc).add_(at::sum(dz, {0}, false, at::kFloat));
    }
    if (g.want.x && !kFp32) o.grad_x.narrow(0, n0, rn).copy_(gx_rows);
  }
  if (g.want.weight && p.rows == 0) o.grad_weight.zero_();
  if (g.want.bias) o.grad_bias.copy_(b_acc);
}

// entropy: the rows' entropies too (forward of per-token losses).
Outputs run(const Problem& p, const GradSpec& g, bool low_memory, bool entropy = false) {
  Outputs o;
  const auto f32 = p.x2d.options().dtype(at::kFloat);
  o.row_losses = at::empty({p.rows}, f32);
  o.stats = g.stats_in.has_value() ? *g.stats_in : at::empty({2, p.rows}, f32);
  if (entropy) o.entropy = at::empty({p.rows}, f32);
  FUSEFORGE_DISPATCH_HALF_FLOAT(p.x2d.scalar_type(), "linear_cross_entropy_cuda", [&] {
    if (low_memory) run_low_memory<scalar_t>(p, g, o);
    else run_default<scalar_t>(p, g, o);
  });
  return o;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fwd_cuda(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& target, const std::optional<at::Tensor>& bias,
    int64_t ignore_index, c10::string_view reduction, double label_smoothing, double z_loss, double softcap,
    bool low_memory, bool grad_x, bool grad_weight, bool grad_bias, bool entropy) {
  const Problem p = prepare(x, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss, softcap,
                            /*allow_double=*/false);
  check_entropy_request(p, entropy);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor inv_count = inverse_valid_count(p);
  GradSpec g;
  g.want = GradRequest{grad_x, grad_weight, grad_bias && p.bias.defined()};
  g.enabled = g.want.any() && p.cfg.reduction != Reduction::kNone;
  // float16 gradients of probabilities ~1/V times 1/count would underflow: for float16 the mean's
  // 1/count is applied by the backward instead (grad_scale).
  const bool fold_mean = p.cfg.reduction == Reduction::kMean && x.scalar_type() != at::kHalf;
  if (g.enabled && fold_mean) g.scalar_scale = inv_count;
  Outputs o = run(p, g, low_memory, entropy);
  const at::Tensor loss = shape_loss(o.row_losses, inv_count, p);
  const at::Tensor grad_scale = (g.enabled && p.cfg.reduction == Reduction::kMean && !fold_mean)
                                    ? inv_count.reshape({})
                                    : at::ones({}, x.options().dtype(at::kFloat));
  at::Tensor gx = o.grad_x.defined() ? o.grad_x.view(x.sizes()) : o.grad_x;
  const at::Tensor ent = entropy ? o.entropy.view(p.batch_shape) : at::empty({0}, o.stats.options());
  return {loss, o.stats, or_empty(gx, x), or_empty(o.grad_weight, x), or_empty(o.grad_bias, x), grad_scale, ent};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(
    const at::Tensor& grad_loss, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, const at::Tensor& lse, int64_t ignore_index, c10::string_view reduction,
    double label_smoothing, double z_loss, double softcap, bool low_memory, bool grad_x, bool grad_weight,
    bool grad_bias, const std::optional<at::Tensor>& entropy, const std::optional<at::Tensor>& grad_entropy) {
  const Problem p = prepare(x, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss, softcap,
                            /*allow_double=*/false);
  const c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == 2 && lse.size(1) == p.rows && lse.scalar_type() == at::kFloat,
              "lse must be the (2, ", p.rows, ") float32 row statistics linear_cross_entropy_fwd returned, got ",
              lse.scalar_type(), " of shape ", lse.sizes());
  check_same_device(x, "x", grad_loss, "grad_loss");
  check_same_device(x, "x", lse, "lse");
  GradSpec g;
  g.want = GradRequest{grad_x, grad_weight, grad_bias && p.bias.defined()};
  g.enabled = g.want.any();
  g.stats_in = lse.contiguous();
  g.entropy = entropy_grad_inputs(p, x, entropy, grad_entropy);
  if (p.cfg.reduction == Reduction::kNone) {
    TORCH_CHECK(grad_loss.sizes() == p.batch_shape, "grad_loss must have the loss's shape ", p.batch_shape,
                ", got ", grad_loss.sizes());
    g.row_scale = grad_loss.reshape({-1}).to(at::kFloat).contiguous();
  } else {
    TORCH_CHECK(grad_loss.numel() == 1, "grad_loss must be a scalar for reduction '", std::string(reduction),
                "', got shape ", grad_loss.sizes());
    at::Tensor s = grad_loss.reshape({1}).to(at::kFloat);
    if (p.cfg.reduction == Reduction::kMean) s = s * inverse_valid_count(p);
    g.scalar_scale = s.contiguous();
  }
  Outputs o = run(p, g, low_memory);
  at::Tensor gx = o.grad_x.defined() ? o.grad_x.view(x.sizes()) : o.grad_x;
  return {or_empty(gx, x), or_empty(o.grad_weight, x), or_empty(o.grad_bias, x)};
}

void scale_grads_cuda(at::Tensor& grad_x, at::Tensor& grad_weight, at::Tensor& grad_bias, const at::Tensor& grad_loss,
                      const at::Tensor& grad_scale) {
  TORCH_CHECK(grad_loss.numel() == 1, "grad_loss must be a scalar, got shape ", grad_loss.sizes());
  TORCH_CHECK(grad_scale.numel() == 1, "grad_scale must be a scalar, got shape ", grad_scale.sizes());
  const c10::cuda::CUDAGuard guard(grad_loss.device());
  const at::Tensor a = grad_loss.reshape({1}).to(at::kFloat);
  const at::Tensor b = grad_scale.reshape({1}).to(at::kFloat);
  for (at::Tensor* g : {&grad_x, &grad_weight, &grad_bias}) {
    if (g->numel() == 0) continue;
    TORCH_CHECK(g->is_contiguous() && g->is_cuda(), "the gradients to scale must be contiguous CUDA tensors");
    check_same_device(grad_loss, "grad_loss", *g, "gradient");
    FUSEFORGE_DISPATCH_HALF_FLOAT(g->scalar_type(), "linear_cross_entropy_scale_grads", [&] {
      launch_scale<scalar_t>(g->mutable_data_ptr<scalar_t>(), g->numel(), a.const_data_ptr<float>(),
                             b.const_data_ptr<float>());
    });
  }
}

// The rows ops: the stream kernel over a caller's logits (16-bit ones read as they are), whole rows.
template <typename T>
StreamParams<T> rows_params(const at::Tensor& logits, const int64_t* target, const at::Tensor& bias,
                            int64_t ignore_index, double softcap, const float* target_logit) {
  StreamParams<T> q;
  if constexpr (std::is_same_v<T, float>) {
    q.logits = logits.const_data_ptr<float>();
  } else {
    q.logits_lowp = logits.const_data_ptr<T>();
  }
  q.ld_logits = q.ld_dz = q.cols = q.vocab = logits.size(1);
  q.rows = logits.size(0);
  q.target = target;
  q.target_logit = target_logit;
  q.bias = bias.defined() ? bias.const_data_ptr<T>() : nullptr;
  q.ignore_index = ignore_index;
  q.softcap = static_cast<float>(softcap);
  return q;
}

at::Tensor rows_stats_cuda(const at::Tensor& logits, const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& target, const std::optional<at::Tensor>& bias, int64_t ignore_index,
                           double softcap) {
  const Problem p = prepare_rows(logits, x, weight, target, bias, ignore_index, softcap, /*allow_double=*/false);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor stats = at::empty({3, p.rows}, x.options().dtype(at::kFloat));
  if (p.rows == 0) return stats;
  FUSEFORGE_DISPATCH_HALF_FLOAT(x.scalar_type(), "linear_cross_entropy_rows_stats", [&] {
    float* zt = stats[2].mutable_data_ptr<float>();
    launch_target_logits<scalar_t>(p.x2d.const_data_ptr<scalar_t>(), p.weight.const_data_ptr<scalar_t>(),
                                   p.target.const_data_ptr<int64_t>(), p.rows, p.hidden, p.vocab, ignore_index, zt);
    StreamParams<scalar_t> q =
        rows_params<scalar_t>(logits, p.target.const_data_ptr<int64_t>(), p.bias, ignore_index, softcap, zt);
    q.lse_out = stats[0].mutable_data_ptr<float>();
    q.nll_out = stats[1].mutable_data_ptr<float>();
    launch_row_softmax_stream<scalar_t>(q);
  });
  return stats;
}

void rows_grad_cuda(at::Tensor& logits, const at::Tensor& stats, const at::Tensor& target,
                    const std::optional<at::Tensor>& bias, const at::Tensor& row_scale, int64_t ignore_index,
                    double softcap) {
  const RowsGradArgs a = check_rows_grad(logits, stats, target, bias, row_scale, softcap, /*allow_double=*/false);
  const c10::cuda::CUDAGuard guard(logits.device());
  if (logits.numel() == 0) return;
  FUSEFORGE_DISPATCH_HALF_FLOAT(logits.scalar_type(), "linear_cross_entropy_rows_grad", [&] {
    StreamParams<scalar_t> q = rows_params<scalar_t>(logits, a.target.const_data_ptr<int64_t>(), a.bias, ignore_index,
                                                     softcap, stats[2].const_data_ptr<float>());
    q.lse_in = stats[0].const_data_ptr<float>();
    q.nll_in = stats[1].const_data_ptr<float>();
    q.row_scale = row_scale.const_data_ptr<float>();
    q.dz = logits.mutable_data_ptr<scalar_t>();  // in place: each thread reads its columns before writing them
    launch_row_softmax_stream<scalar_t>(q);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fuseforge, CUDA, m) {
  m.impl("linear_cross_entropy_rows_stats", &rows_stats_cuda);
  m.impl("linear_cross_entropy_rows_grad_", &rows_grad_cuda);
  m.impl("linear_cross_entropy_fwd", &fwd_cuda);
  m.impl("linear_cross_entropy_bwd", &bwd_cuda);
  m.impl("linear_cross_entropy_scale_grads_", &scale_grads_cuda);
}

}  // namespace fuseforge::linear_cross_entropy
