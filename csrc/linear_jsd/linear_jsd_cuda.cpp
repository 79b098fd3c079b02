// linear_jsd CUDA implementation, host side: the chunk plan, the cuBLAS matrix products (through
// at::mm / at::addmm, float32 accumulation) and the row kernel's launches. No host sync: the mean's
// divisor stays a device scalar. Compiled by the C++ compiler, not nvcc.
//
// Per chunk of c rows:
//   student(c x V, float32) = x_s @ W_s^T ;  teacher(c x V, float32) = x_t @ W_t^T     (cuBLAS)
//   row losses and dz (c x V, in T; in place over the student's logits for float32)   (row kernel)
//   grad_x[c rows] = dz @ W_s ;  grad_W_s (+)= dz^T @ x_s                             (cuBLAS)
// Workspace (8 + sizeof(T)) c V bytes <= kWorkspaceBudget. grad_W accumulates in cuBLAS (float32
// inside, one rounding to T a chunk) for at most kMaxRoundedPasses chunks, else in a float32 V x Hs
// buffer.
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

constexpr int64_t kWorkspaceBudget = int64_t{768} << 20;  // bytes: the chunk's logits and dz
constexpr int64_t kMaxChunkRows = 8192;
constexpr int64_t kMaxRoundedPasses = 4;  // low-precision roundings of grad_W per element

struct GradSpec {
  bool enabled = false;
  GradRequest want;
  std::optional<at::Tensor> row_scale, scalar_scale;  // float32: (N,) per row / one device scalar
};

struct Outputs {
  at::Tensor row_losses, grad_x, grad_weight;
};

// Rows a chunk: the workspace budget over a row's bytes (both float32 logit rows, and dz in T for
// 16-bit inputs with gradients). Development knob FUSEFORGE_JSD_CHUNK_ROWS (tests, tuning).
int64_t chunk_rows(const Problem& p, bool separate_dz) {
  const int64_t row_bytes = p.vocab * (8 + (separate_dz ? p.sx.element_size() : 0));
  const int64_t fit = std::clamp<int64_t>(kWorkspaceBudget / row_bytes, 1, kMaxChunkRows);
  return std::clamp<int64_t>(dev_positive_int("FUSEFORGE_JSD_CHUNK_ROWS", fit), 1, std::max<int64_t>(p.rows, 1));
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
  const int64_t chunk = chunk_rows(p, g.enabled && !kFloat);
  const int64_t passes = ceil_div(p.rows, chunk);
  const bool fp32_weight_acc = g.enabled && g.want.weight && !kFloat && passes > kMaxRoundedPasses;
  const at::Tensor s_buf = at::empty({chunk * p.vocab}, f32);
  const at::Tensor t_buf = at::empty({chunk * p.vocab}, f32);
  at::Tensor dz_buf, w_acc;
  if (g.enabled) {
    dz_buf = kFloat ? s_buf : at::empty({chunk * p.vocab}, p.sx.options());  // float32: dz over the logits
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

  for (int64_t r0 = 0; r0 < p.rows; r0 += chunk) {
    const int64_t n = std::min(chunk, p.rows - r0);
    at::Tensor zs = s_buf.narrow(0, 0, n * p.vocab).view({n, p.vocab});
    at::Tensor zt = t_buf.narrow(0, 0, n * p.vocab).view({n, p.vocab});
    const at::Tensor x_rows = p.sx.narrow(0, r0, n);
    logits_gemm(zs, x_rows, p.sw);
    logits_gemm(zt, p.tx.narrow(0, r0, n), p.tw);

    RowParams<T> q = rp;
    q.student = zs.const_data_ptr<float>();
    q.teacher = zt.const_data_ptr<float>();
    q.rows = n;
    q.target = p.target.defined() ? p.target.const_data_ptr<int64_t>() + r0 : nullptr;
    q.row_scale = g.row_scale.has_value() ? g.row_scale->const_data_ptr<float>() + r0 : nullptr;
    q.loss_out = o.row_losses.defined() ? o.row_losses.mutable_data_ptr<float>() + r0 : nullptr;
    q.dz = g.enabled ? static_cast<T*>(dz_buf.mutable_data_ptr()) : nullptr;
    launch_rows<T>(q);
    if (!g.enabled) continue;

    const at::Tensor dz = dz_buf.narrow(0, 0, n * p.vocab).view({n, p.vocab});
    if (g.want.x) {
      at::Tensor gx_rows = o.grad_x.narrow(0, r0, n);
      at::mm_out(gx_rows, dz, p.sw);
    }
    if (g.want.weight) {
      const bool first = r0 == 0;
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
