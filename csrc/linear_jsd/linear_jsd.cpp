// linear_jsd: argument checks shared by every implementation, and the CPU implementation (the
// reference the CUDA pipeline must match; float64 serves gradcheck). The CPU path works in row
// chunks: ATen's GEMMs for the student's and the teacher's logits into two reused chunk buffers, one
// vectorised row kernel (linear_jsd_cpu_kernel.h) between them and the gradient GEMMs, in float32
// (float64 for float64 inputs).
#include "linear_jsd/linear_jsd.h"

#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "common/checks.h"
#include "common/cpu_isa.h"
#include "common/env.h"
#include "common/not_differentiable.h"
#include "linear_jsd/linear_jsd_cpu.h"

namespace fuseforge::linear_jsd {

namespace {

void check_head(const at::Tensor& x, const char* x_name, const at::Tensor& w, const char* w_name) {
  TORCH_CHECK(x.dim() >= 1, x_name, " must have shape (..., hidden), got a 0-dim tensor");
  TORCH_CHECK(w.dim() == 2, w_name, " must have shape (vocab, hidden), got ", w.sizes());
  TORCH_CHECK(w.size(1) == x.size(-1), w_name, " must have shape (vocab, ", x.size(-1), ") (hidden = the last dim of ",
              x_name, "), got ", w.sizes());
}

}  // namespace

Problem prepare(const at::Tensor& student_x, const at::Tensor& student_weight, const at::Tensor& teacher_x,
                const at::Tensor& teacher_weight, const std::optional<at::Tensor>& target, double beta,
                double temperature, int64_t ignore_index, std::string_view reduction, bool allow_double) {
  Problem p;
  p.cfg.reduction = parse_reduction(reduction);
  TORCH_CHECK(beta >= 0.0 && beta <= 1.0, "beta must be in [0, 1], got ", beta);
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0.0, "temperature must be a finite number > 0, got ",
              temperature);
  p.cfg.beta = beta;
  p.cfg.temperature = temperature;
  p.cfg.ignore_index = ignore_index;
  p.cfg.mode = beta == 0.0 ? Mode::kForwardKL : beta == 1.0 ? Mode::kReverseKL : Mode::kJSD;

  check_dtype_supported(student_x, "student_x", allow_double);
  for (const auto& [t, name] : {std::pair{&student_weight, "student_weight"}, std::pair{&teacher_x, "teacher_x"},
                                std::pair{&teacher_weight, "teacher_weight"}}) {
    check_same_device(student_x, "student_x", *t, name);
    check_same_dtype(student_x, "student_x", *t, name);
  }
  check_head(student_x, "student_x", student_weight, "student_weight");
  check_head(teacher_x, "teacher_x", teacher_weight, "teacher_weight");
  TORCH_CHECK(student_weight.size(0) > 0, "student_weight must have at least one row (vocab > 0), got ",
              student_weight.sizes());
  TORCH_CHECK(teacher_weight.size(0) == student_weight.size(0), "teacher_weight must have the vocabulary of "
              "student_weight (", student_weight.size(0), " rows), got ", teacher_weight.sizes());
  const at::IntArrayRef batch = student_x.sizes().slice(0, student_x.dim() - 1);
  TORCH_CHECK(teacher_x.dim() == student_x.dim() && teacher_x.sizes().slice(0, teacher_x.dim() - 1) == batch,
              "teacher_x must have shape ", batch, " + (hidden,) (the leading dims of student_x), got ",
              teacher_x.sizes());
  if (target.has_value() && target->defined()) {
    check_same_device(student_x, "student_x", *target, "target");
    TORCH_CHECK(target->scalar_type() == at::kLong || target->scalar_type() == at::kInt,
                "target must be an int64 or int32 tensor (tokens equal to ignore_index are skipped), got ",
                target->scalar_type());
    TORCH_CHECK(target->sizes() == batch, "target must have shape ", batch, " (the leading dims of student_x), got ",
                target->sizes());
    const at::Tensor t1 = target->reshape({-1});
    p.target = (t1.scalar_type() == at::kLong ? t1 : t1.to(at::kLong)).contiguous();
  }
  p.vocab = student_weight.size(0);
  p.sx = student_x.reshape({-1, student_x.size(-1)}).contiguous();
  p.tx = teacher_x.reshape({-1, teacher_x.size(-1)}).contiguous();
  p.sw = student_weight.contiguous();
  p.tw = teacher_weight.contiguous();
  p.rows = p.sx.size(0);
  p.batch_shape = batch;
  return p;
}

at::Tensor inverse_valid_count(const Problem& p) {
  const auto dt = stats_dtype(p.sx.scalar_type());
  if (!p.target.defined()) {
    return at::full({}, 1.0 / static_cast<double>(std::max<int64_t>(1, p.rows)), p.sx.options().dtype(dt));
  }
  const at::Tensor count = p.target.ne(p.cfg.ignore_index).sum().clamp_min(1);
  return at::reciprocal(count.to(dt));
}

at::Tensor shape_loss(const at::Tensor& row_losses, const at::Tensor& inv_count, const Problem& p) {
  return reduce_rows(row_losses, inv_count, p.cfg.reduction, p.batch_shape);
}

void check_grad_loss(const at::Tensor& grad_loss, const Problem& p) {
  if (p.cfg.reduction == Reduction::kNone) {
    TORCH_CHECK(grad_loss.sizes() == p.batch_shape, "grad_loss must have the loss's shape ", p.batch_shape,
                ", got ", grad_loss.sizes());
  } else {
    TORCH_CHECK(grad_loss.numel() == 1, "grad_loss must be a scalar for a reduced loss, got shape ",
                grad_loss.sizes());
  }
  check_same_device(p.sx, "student_x", grad_loss, "grad_loss");
}

namespace {

// Rows a chunk: 32 MiB of logits a model (two such buffers), within [16, 2048] rows.
// FUSEFORGE_JSD_CPU_CHUNK_ROWS overrides it (tests of the chunk boundaries, tuning).
constexpr int64_t kCpuChunkBytes = 32ll << 20;

int64_t cpu_chunk_rows(int64_t vocab, int64_t elem_bytes) {
  const int64_t rows = std::clamp<int64_t>(kCpuChunkBytes / std::max<int64_t>(1, vocab * elem_bytes), 16, 2048);
  return dev_positive_int("FUSEFORGE_JSD_CPU_CHUNK_ROWS", rows);
}

struct CpuOutputs {
  at::Tensor row_losses, grad_x, grad_weight;
};

// Per-row weights of the gradient: a (N,) tensor ("none"'s backward), or one number for every row.
struct RowWeights {
  at::Tensor per_row;
  double scalar = 1.0;
};

// 1 / max(1, tokens not skipped), read on the host (free on the CPU).
double inverse_valid_count_host(const Problem& p) {
  if (!p.target.defined()) return 1.0 / static_cast<double>(std::max<int64_t>(1, p.rows));
  const int64_t* t = p.target.const_data_ptr<int64_t>();
  int64_t valid = 0;
  for (int64_t i = 0; i < p.rows; ++i) valid += t[i] != p.cfg.ignore_index;
  return 1.0 / static_cast<double>(std::max<int64_t>(1, valid));
}

// Row chunks: student and teacher logits by ATen's GEMMs into reused buffers, the row kernel (row
// losses, and with weights the student's logit gradients in place), then grad_x rows = dz @ W_s and
// grad_W_s += dz^T x_s. Gradients are of sum_n weight_n * loss_n.
CpuOutputs run_cpu(const Problem& p, const std::optional<RowWeights>& weights, const GradRequest& want,
                   bool want_loss) {
  const auto dt = p.sx.scalar_type();
  const auto acc = stats_dtype(dt);
  const bool convert = dt != acc;  // bf16/fp16: chunks converted to float32, GEMMs in float32
  const auto opts = p.sx.options().dtype(acc);
  const bool grads = weights.has_value() && want.any();
  const int64_t hs = p.sx.size(1);

  CpuOutputs o;
  if (want_loss) o.row_losses = at::empty({p.rows}, opts);
  const at::Tensor sw = convert ? p.sw.to(acc) : p.sw;
  const at::Tensor tw = convert ? p.tw.to(acc) : p.tw;
  const int64_t chunk = std::max<int64_t>(
      1, std::min(p.rows, cpu_chunk_rows(p.vocab, static_cast<int64_t>(at::elementSize(acc)))));

  at::Tensor gx, gx_buf, gw;
  if (grads && want.x) {
    gx = at::empty({p.rows, hs}, p.sx.options());
    if (convert) gx_buf = at::empty({chunk, hs}, opts);
  }
  // In the math type: it accumulates over chunks (the first chunk's GEMM writes, later ones add).
  if (grads && want.weight) gw = p.rows ? at::empty({p.vocab, hs}, opts) : at::zeros({p.vocab, hs}, opts);
  const at::Tensor s_buf = at::empty({chunk, p.vocab}, opts);
  const at::Tensor t_buf = at::empty({chunk, p.vocab}, opts);
  at::Tensor row_weights;
  const double scalar_weight = grads ? weights->scalar : 0.0;
  const float scalar_weight_f = static_cast<float>(scalar_weight);
  const void* scalar_weight_p = acc == at::kDouble ? static_cast<const void*>(&scalar_weight)
                                                   : static_cast<const void*>(&scalar_weight_f);
  if (grads && weights->per_row.defined()) row_weights = weights->per_row.to(acc).contiguous();

  const int64_t esize = static_cast<int64_t>(at::elementSize(acc));
  for (int64_t r0 = 0; r0 < p.rows; r0 += chunk) {
    const int64_t r1 = std::min(p.rows, r0 + chunk), n = r1 - r0;
    const at::Tensor sxc = convert ? p.sx.slice(0, r0, r1).to(acc) : p.sx.slice(0, r0, r1);
    const at::Tensor txc = convert ? p.tx.slice(0, r0, r1).to(acc) : p.tx.slice(0, r0, r1);
    at::Tensor zs = s_buf.narrow(0, 0, n), zt = t_buf.narrow(0, 0, n);
    at::mm_out(zs, sxc, sw.t());
    at::mm_out(zt, txc, tw.t());

    CpuRowArgs a{};
    a.student = zs.data_ptr();
    a.teacher = zt.data_ptr();
    a.target = p.target.defined() ? p.target.const_data_ptr<int64_t>() + r0 : nullptr;
    a.row_loss = want_loss ? static_cast<char*>(o.row_losses.data_ptr()) + r0 * esize : nullptr;
    a.grad_rows = !grads ? nullptr
                  : row_weights.defined() ? static_cast<const char*>(row_weights.const_data_ptr()) + r0 * esize
                                          : scalar_weight_p;
    a.grad_rows_stride = row_weights.defined() ? 1 : 0;
    a.rows = n;
    a.vocab = p.vocab;
    a.ignore_index = p.cfg.ignore_index;
    a.mode = static_cast<int>(p.cfg.mode);
    a.beta = p.cfg.beta;
    a.inv_temperature = 1.0 / p.cfg.temperature;
    a.dtype = acc;
    FUSEFORGE_CPU_ISA_CALL(rows, a);
    if (!grads) continue;

    // zs now holds dz (zero rows for skipped tokens).
    if (gx.defined()) {
      if (convert) {
        at::Tensor gxc = gx_buf.narrow(0, 0, n);
        at::mm_out(gxc, zs, sw);
        gx.slice(0, r0, r1).copy_(gxc);
      } else {
        at::Tensor gxc = gx.slice(0, r0, r1);
        at::mm_out(gxc, zs, sw);
      }
    }
    if (gw.defined()) {
      if (r0 == 0) at::mm_out(gw, zs.t(), sxc);
      else gw.addmm_(zs.t(), sxc);
    }
  }
  if (gx.defined()) o.grad_x = gx;
  if (gw.defined()) o.grad_weight = convert ? gw.to(dt) : gw;
  return o;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fwd_cpu(
    const at::Tensor& student_x, const at::Tensor& student_weight, const at::Tensor& teacher_x,
    const at::Tensor& teacher_weight, const std::optional<at::Tensor>& target, double beta, double temperature,
    int64_t ignore_index, c10::string_view reduction, bool grad_x, bool grad_weight) {
  const Problem p = prepare(student_x, student_weight, teacher_x, teacher_weight, target, beta, temperature,
                            ignore_index, reduction, /*allow_double=*/true);
  const GradRequest want{grad_x, grad_weight};
  const double inv = inverse_valid_count_host(p);
  std::optional<RowWeights> weights;
  if (want.any() && p.cfg.reduction != Reduction::kNone) {
    weights = RowWeights{};
    weights->scalar = p.cfg.reduction == Reduction::kMean ? inv : 1.0;
  }
  CpuOutputs o = run_cpu(p, weights, want, /*want_loss=*/true);
  const at::Tensor inv_t = at::full({}, inv, o.row_losses.options());
  const at::Tensor loss = shape_loss(o.row_losses, inv_t, p);
  const at::Tensor gx = o.grad_x.defined() ? o.grad_x.view(student_x.sizes()) : o.grad_x;
  const at::Tensor grad_scale = at::ones({}, student_x.options().dtype(at::kFloat));
  return {loss, or_empty(gx, student_x), or_empty(o.grad_weight, student_x), grad_scale};
}

std::tuple<at::Tensor, at::Tensor> bwd_cpu(const at::Tensor& grad_loss, const at::Tensor& student_x,
                                           const at::Tensor& student_weight, const at::Tensor& teacher_x,
                                           const at::Tensor& teacher_weight, const std::optional<at::Tensor>& target,
                                           double beta, double temperature, int64_t ignore_index,
                                           c10::string_view reduction, bool grad_x, bool grad_weight) {
  const Problem p = prepare(student_x, student_weight, teacher_x, teacher_weight, target, beta, temperature,
                            ignore_index, reduction, /*allow_double=*/true);
  check_grad_loss(grad_loss, p);
  const at::Tensor g = grad_loss.to(stats_dtype(student_x.scalar_type()));
  RowWeights weights;
  if (p.cfg.reduction == Reduction::kNone) {
    weights.per_row = g.reshape({-1});
  } else {
    weights.scalar = g.item<double>();
    if (p.cfg.reduction == Reduction::kMean) weights.scalar *= inverse_valid_count_host(p);
  }
  CpuOutputs o = run_cpu(p, weights, GradRequest{grad_x, grad_weight}, /*want_loss=*/false);
  const at::Tensor gx = o.grad_x.defined() ? o.grad_x.view(student_x.sizes()) : o.grad_x;
  return {or_empty(gx, student_x), or_empty(o.grad_weight, student_x)};
}

}  // namespace

TORCH_LIBRARY_IMPL(fuseforge, CPU, m) {
  m.impl("linear_jsd_fwd", &fwd_cpu);
  m.impl("linear_jsd_bwd", &bwd_cpu);
}

// The backward ops have no backward of their own (common/not_differentiable.h).
TORCH_LIBRARY_IMPL(fuseforge, Autograd, m) {
  m.impl("linear_jsd_bwd", fuseforge::not_differentiable());
}

}  // namespace fuseforge::linear_jsd
