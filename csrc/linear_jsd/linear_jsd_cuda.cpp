// linear_jsd CUDA implementation, host side: the chunk plan, the cuBLAS matrix products (through
// at::mm / at::addmm, float32 accumulation) and the row kernel's launches. No host sync: the mean's
// divisor stays a device scalar. Compiled by the C++ compiler, not nvcc.
//
// Per super-chunk of S rows (16-bit inputs with gradients; else S = c):
//   per sub-chunk of c rows:
//     student(c x V, float32) = x_s @ W_s^T ;  teacher(c x V, float32) = x_t @ W_t^T    (cuBLAS)
//     row losses and dz (c rows of the super-chunk's S x V dz, in T)                  (row kernel)
//   grad_x[S rows] = dz @ W_s ;  grad_W_s (+)= dz^T @ x_s                              (cuBLAS)
// Workspace: 8 c V bytes of float32 logits (kStagingBudget) and sizeof(T) S V of dz (kDzBudget);
// float32 inputs write dz over the student's logits (S = c, 8 c V <= kWorkspaceBudget). grad_W
// accumulates in cuBLAS (float32 inside, one rounding to T a super-chunk) for at most
// kMaxRoundedPasses super-chunks, else in a float32 V x Hs buffer.
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#include "common/checks.h"
#include "common/cuda_utils.h"
#include "common/dispatch.h"
#include "common/env.h"
#include "linear_jsd/linear_jsd.h"
#include "linear_jsd/linear_jsd_launch.h"

namespace fuseforge::linear_jsd {
namespace {

constexpr int64_t kWorkspaceBudget = int64_t{768} << 20;  // bytes: float32 inputs' logits (dz in place)
constexpr int64_t kDzBudget = int64_t{512} << 20;         // bytes: 16-bit inputs' dz rows
constexpr int64_t kStagingCap = int64_t{1} << 30;         // bytes: 16-bit inputs' float32 logits, at most
constexpr int64_t kSmallVocabStaging = int64_t{256} << 20;  // bytes: more rows than that where they fit (small V)
constexpr int64_t kMaxChunkRows = 8192;
// Low-precision roundings of grad_W per element before a float32 accumulator (4 V Hs bytes) is used
// instead: 16 at 512 MiB of dz rows covers 32768 tokens at V = 128256 (Liger-Kernel's fused JSD
// rounds once every 256-512 rows).
constexpr int64_t kMaxRoundedPasses = 16;

struct GradSpec {
  bool enabled = false;
  GradRequest want;
  std::optional<at::Tensor> row_scale, scalar_scale;  // float32: (N,) per row / one device scalar
};

struct Outputs {
  at::Tensor row_losses, grad_x, grad_weight;
};

struct Plan {
  int64_t sub_rows = 1, super_rows = 1;  // logit rows a GEMM pair; dz rows a gradient GEMM pair
};

// Logit rows a sub-chunk. 16-bit inputs with gradients: 512, or 768 from 16384 tokens on (halved above
// V = 196608): larger logit products run faster (32768 x 4096 x 128256: 261 rows 265 ms, 512 rows
// 252-257, 768 rows 240-243), and below 16384 tokens 768 rows would cost more memory than
// Liger-Kernel's fused JSD takes; more rows where 256 MiB holds more (small vocabularies); at most
// kStagingCap. Otherwise (float32; no gradients) the workspace budget's rows, a multiple of 128.
// A super-chunk's dz rows: from kDzBudget, but up to twice that where it keeps grad_W's roundings
// within kMaxRoundedPasses (no float32 accumulator), a whole number of sub-chunks.
// Development knobs (tests, tuning): FUSEFORGE_JSD_CHUNK_ROWS (sub-chunk), FUSEFORGE_JSD_SUPER_ROWS
// (super-chunk, rounded down to a multiple of the sub-chunk).
Plan plan_rows(const Problem& p, bool separate_dz) {
  constexpr int64_t kRowTile = 128;
  const int64_t rows = std::max<int64_t>(p.rows, 1);
  int64_t fit;
  if (separate_dz) {
    fit = (p.rows >= 16384 ? 768 : 512) / (p.vocab > 196608 ? 2 : 1);
    fit = std::max(fit, std::min<int64_t>(kSmallVocabStaging / (8 * p.vocab), kMaxChunkRows) / kRowTile * kRowTile);
    fit = std::min<int64_t>(fit, std::max<int64_t>(kStagingCap / (8 * p.vocab), 1));
  } else {
    fit = std::clamp<int64_t>(kWorkspaceBudget / (8 * p.vocab), 1, kMaxChunkRows);
    if (fit >= kRowTile) fit = fit / kRowTile * kRowTile;
  }
  Plan plan;
  plan.sub_rows = std::clamp<int64_t>(dev_positive_int("FUSEFORGE_JSD_CHUNK_ROWS", fit), 1, rows);
  plan.super_rows = plan.sub_rows;
  if (separate_dz) {
    const int64_t sub = plan.sub_rows;
    const int64_t dz_fit = std::clamp<int64_t>(kDzBudget / (p.sx.element_size() * p.vocab), 1, kMaxChunkRows);
    const int64_t rounded_fit = std::max(dz_fit / sub * sub, sub);
    const int64_t for_passes = ceil_div(ceil_div(rows, kMaxRoundedPasses), sub) * sub;  // rows for <= 16 passes
    const int64_t s = for_passes <= 2 * dz_fit ? std::max(rounded_fit, for_passes) : rounded_fit;
    const int64_t chosen = std::clamp<int64_t>(dev_positive_int("FUSEFORGE_JSD_SUPER_ROWS", s), sub, rows);
    plan.super_rows = std::max<int64_t>(chosen / sub * sub, sub);
  }
  return plan;
}

// Float32 logits of x_rows @ w^T into out (contiguous rows x V).
void logits_gemm(at::Tensor& out, const at::Tensor& x_rows, const at::Tensor& w) {
  if (x_rows.scalar_type() == at::kFloat) {
    at::mm_out(out, x_rows, w.t());
  } else {
    at::mm_out(out, x_rows, w.t(), at::kFloat);  // bf16/fp16 inputs, float32 accumulate and output
  }
}

template <typename T>
void run_typed(const Problem& p, const GradSpec& g, Outputs& o) {
  constexpr bool kFloat = std::is_same_v<T, float>;
  const auto f32 = p.sx.options().dtype(at::kFloat);
  const int64_t hs = p.sx.size(1);
  if (g.enabled) {
    if (g.want.x) o.grad_x = at::empty({p.rows, hs}, p.sx.options());
    if (g.want.weight) o.grad_weight = at::empty({p.vocab, hs}, p.sx.options());
  }
  const Plan plan = plan_rows(p, g.enabled && !kFloat);
  const int64_t passes = ceil_div(p.rows, plan.super_rows);
  const bool fp32_weight_acc = g.enabled && g.want.weight && !kFloat && passes > kMaxRoundedPasses;
  const at::Tensor s_buf = at::empty({plan.sub_rows * p.vocab}, f32);
  const at::Tensor t_buf = at::empty({plan.sub_rows * p.vocab}, f32);
  at::Tensor dz_buf, w_acc;
  if (g.enabled) {
    // float32: dz over the student's logits (super = sub)
    dz_buf = kFloat ? s_buf : at::empty({plan.super_rows * p.vocab}, p.sx.options());
    if (fp32_weight_acc) w_acc = at::empty({p.vocab, hs}, f32);
  }

  RowParams<T> rp;
  rp.ld = p.vocab;
  rp.ld_dz = p.vocab;
  rp.vocab = p.vocab;
  rp.ignore_index = p.cfg.ignore_index;
  rp.mode = static_cast<int>(p.cfg.mode);
  rp.beta = static_cast<float>(p.cfg.beta);
  rp.inv_temperature = static_cast<float>(1.0 / p.cfg.temperature);
  rp.scalar_scale = g.scalar_scale.has_value() ? g.scalar_scale->const_data_ptr<float>() : nullptr;

  for (int64_t s0 = 0; s0 < p.rows; s0 += plan.super_rows) {
    const int64_t s_rows = std::min(plan.super_rows, p.rows - s0);
    for (int64_t r0 = s0; r0 < s0 + s_rows; r0 += plan.sub_rows) {
      const int64_t n = std::min(plan.sub_rows, s0 + s_rows - r0);
      at::Tensor zs = s_buf.narrow(0, 0, n * p.vocab).view({n, p.vocab});
      at::Tensor zt = t_buf.narrow(0, 0, n * p.vocab).view({n, p.vocab});
      logits_gemm(zs, p.sx.narrow(0, r0, n), p.sw);
      logits_gemm(zt, p.tx.narrow(0, r0, n), p.tw);

      RowParams<T> q = rp;
      q.student = zs.const_data_ptr<float>();
      q.teacher = zt.const_data_ptr<float>();
      q.rows = n;
      q.target = p.target.defined() ? p.target.const_data_ptr<int64_t>() + r0 : nullptr;
      q.row_scale = g.row_scale.has_value() ? g.row_scale->const_data_ptr<float>() + r0 : nullptr;
      q.loss_out = o.row_losses.defined() ? o.row_losses.mutable_data_ptr<float>() + r0 : nullptr;
      q.dz = g.enabled ? static_cast<T*>(dz_buf.mutable_data_ptr()) + (r0 - s0) * p.vocab : nullptr;
      launch_rows<T>(q);
    }
    if (!g.enabled) continue;

    const at::Tensor dz = dz_buf.narrow(0, 0, s_rows * p.vocab).view({s_rows, p.vocab});
    const at::Tensor x_rows = p.sx.narrow(0, s0, s_rows);
    if (g.want.x) {
      at::Tensor gx_rows = o.grad_x.narrow(0, s0, s_rows);
      at::mm_out(gx_rows, dz, p.sw);
    }
    if (g.want.weight) {
      const bool first = s0 == 0;
      if (fp32_weight_acc) {
        if (first) at::mm_out(w_acc, dz.t(), x_rows, at::kFloat);
        else at::addmm_out(w_acc, w_acc, dz.t(), x_rows, at::kFloat, 1, 1);
      } else if (first) {
        at::mm_out(o.grad_weight, dz.t(), x_rows);
      } else {
        o.grad_weight.addmm_(dz.t(), x_rows);  // cuBLAS beta = 1: float32 inside, one rounding to T
      }
    }
  }
  if (g.enabled && g.want.weight) {
    if (p.rows == 0) o.grad_weight.zero_();
    else if (fp32_weight_acc) o.grad_weight.copy_(w_acc);
  }
}

Outputs run(const Problem& p, const GradSpec& g, bool want_loss) {
  Outputs o;
  if (want_loss) o.row_losses = at::empty({p.rows}, p.sx.options().dtype(at::kFloat));
  FUSEFORGE_DISPATCH_HALF_FLOAT(p.sx.scalar_type(), "linear_jsd_cuda", [&] { run_typed<scalar_t>(p, g, o); });
  return o;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fwd_cuda(
    const at::Tensor& student_x, const at::Tensor& student_weight, const at::Tensor& teacher_x,
    const at::Tensor& teacher_weight, const std::optional<at::Tensor>& target, double beta, double temperature,
    int64_t ignore_index, c10::string_view reduction, bool grad_x, bool grad_weight) {
  const Problem p = prepare(student_x, student_weight, teacher_x, teacher_weight, target, beta, temperature,
                            ignore_index, reduction, /*allow_double=*/false);
  const c10::cuda::CUDAGuard guard(student_x.device());
  const at::Tensor inv_count = inverse_valid_count(p);
  GradSpec g;
  g.want = GradRequest{grad_x, grad_weight};
  g.enabled = g.want.any() && p.cfg.reduction != Reduction::kNone;
  // float16 gradients of probabilities times 1/count would underflow: for float16 the mean's 1/count
  // is applied by the backward instead (grad_scale).
  const bool fold_mean = p.cfg.reduction == Reduction::kMean && student_x.scalar_type() != at::kHalf;
  if (g.enabled && fold_mean) g.scalar_scale = inv_count.reshape({1});
  Outputs o = run(p, g, /*want_loss=*/true);
  const at::Tensor loss = shape_loss(o.row_losses, inv_count, p);
  const at::Tensor grad_scale = (g.enabled && p.cfg.reduction == Reduction::kMean && !fold_mean)
                                    ? inv_count.reshape({})
                                    : at::ones({}, student_x.options().dtype(at::kFloat));
  const at::Tensor gx = o.grad_x.defined() ? o.grad_x.view(student_x.sizes()) : o.grad_x;
  return {loss, or_empty(gx, student_x), or_empty(o.grad_weight, student_x), grad_scale};
}

std::tuple<at::Tensor, at::Tensor> bwd_cuda(const at::Tensor& grad_loss, const at::Tensor& student_x,
                                            const at::Tensor& student_weight, const at::Tensor& teacher_x,
                                            const at::Tensor& teacher_weight, const std::optional<at::Tensor>& target,
                                            double beta, double temperature, int64_t ignore_index,
                                            c10::string_view reduction, bool grad_x, bool grad_weight) {
  const Problem p = prepare(student_x, student_weight, teacher_x, teacher_weight, target, beta, temperature,
                            ignore_index, reduction, /*allow_double=*/false);
  check_grad_loss(grad_loss, p);
  const c10::cuda::CUDAGuard guard(student_x.device());
  GradSpec g;
  g.want = GradRequest{grad_x, grad_weight};
  g.enabled = g.want.any();
  if (p.cfg.reduction == Reduction::kNone) {
    g.row_scale = grad_loss.reshape({-1}).to(at::kFloat).contiguous();
  } else {
    at::Tensor s = grad_loss.reshape({1}).to(at::kFloat);
    if (p.cfg.reduction == Reduction::kMean) s = s * inverse_valid_count(p);
    g.scalar_scale = s.contiguous();
  }
  Outputs o = run(p, g, /*want_loss=*/false);
  const at::Tensor gx = o.grad_x.defined() ? o.grad_x.view(student_x.sizes()) : o.grad_x;
  return {or_empty(gx, student_x), or_empty(o.grad_weight, student_x)};
}

}  // namespace

TORCH_LIBRARY_IMPL(fuseforge, CUDA, m) {
  m.impl("linear_jsd_fwd", &fwd_cuda);
  m.impl("linear_jsd_bwd", &bwd_cuda);
}

}  // namespace fuseforge::linear_jsd
