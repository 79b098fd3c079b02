// linear_cross_entropy: argument checks shared by every implementation, and the CPU implementation
// (the reference the CUDA pipeline must match; float64 serves gradcheck). The CPU path works in
// row chunks with at:: ops in float32 (float64 for float64 inputs).
#include "linear_cross_entropy/linear_cross_entropy.h"

#include <torch/library.h>

#include <cmath>

#include "common/checks.h"

namespace fuseforge::linear_cross_entropy {

Reduction parse_reduction(std::string_view reduction) {
  if (reduction == "mean") return Reduction::kMean;
  if (reduction == "sum") return Reduction::kSum;
  if (reduction == "none") return Reduction::kNone;
  TORCH_CHECK(false, "reduction must be 'mean', 'sum' or 'none', got '", std::string(reduction), "'");
}

Problem prepare(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& target,
                const std::optional<at::Tensor>& bias, int64_t ignore_index, std::string_view reduction,
                double label_smoothing, double z_loss, double softcap, bool allow_double) {
  Problem p;
  p.cfg.reduction = parse_reduction(reduction);
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing < 1.0, "label_smoothing must be in [0, 1), got ",
              label_smoothing);
  TORCH_CHECK(std::isfinite(z_loss) && z_loss >= 0.0, "z_loss must be a finite number >= 0, got ", z_loss);
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0.0,
              "softcap must be a positive finite number (or None for no soft-capping), got ", softcap);
  p.cfg.ignore_index = ignore_index;
  p.cfg.label_smoothing = label_smoothing;
  p.cfg.z_loss = z_loss;
  p.cfg.softcap = softcap;

  check_dtype_supported(x, "x", allow_double);
  check_same_device(x, "x", weight, "weight");
  check_same_device(x, "x", target, "target");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight must have the dtype of x (", x.scalar_type(),
              "), got ", weight.scalar_type());
  TORCH_CHECK(x.dim() >= 1, "x must have shape (..., hidden), got a 0-dim tensor");
  TORCH_CHECK(weight.dim() == 2, "weight must have shape (vocab, hidden), got ", weight.sizes());
  TORCH_CHECK(weight.size(1) == x.size(-1), "weight must have shape (vocab, ", x.size(-1),
              ") (hidden = the last dim of x), got ", weight.sizes());
  TORCH_CHECK(weight.size(0) > 0, "weight must have at least one row (vocab > 0), got ", weight.sizes());
  TORCH_CHECK(target.scalar_type() == at::kLong || target.scalar_type() == at::kInt,
              "target must be an int64 or int32 tensor of class indices, got ", target.scalar_type());
  TORCH_CHECK(target.sizes() == x.sizes().slice(0, x.dim() - 1), "target must have shape ",
              x.sizes().slice(0, x.dim() - 1), " (the leading dims of x), got ", target.sizes());
  if (bias.has_value() && bias->defined()) {
    check_same_device(x, "x", *bias, "bias");
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), "bias must have the dtype of x (", x.scalar_type(),
                "), got ", bias->scalar_type());
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0), "bias must have shape (", weight.size(0),
                ",) (vocab), got ", bias->sizes());
    p.bias = bias->contiguous();
  }
  p.hidden = x.size(-1);
  p.vocab = weight.size(0);
  p.x2d = x.reshape({-1, p.hidden}).contiguous();
  p.rows = p.x2d.size(0);
  p.weight = weight.contiguous();
  p.target = target.reshape({-1}).to(at::kLong).contiguous();
  p.batch_shape = target.sizes();
  return p;
}

at::Tensor inverse_valid_count(const Problem& p) {
  const at::Tensor count = p.target.ne(p.cfg.ignore_index).sum().clamp_min(1);
  return at::reciprocal(count.to(stats_dtype(p.x2d.scalar_type())));
}

at::Tensor shape_loss(const at::Tensor& row_losses, const at::Tensor& inv_count, const Problem& p) {
  switch (p.cfg.reduction) {
    case Reduction::kNone:
      return row_losses.view(p.batch_shape);
    case Reduction::kSum:
      return row_losses.sum();
    case Reduction::kMean:
      return row_losses.sum() * inv_count;
  }
  return row_losses;
}

namespace {

constexpr int64_t kCpuChunkRows = 1024;  // bounds the CPU path's logits workspace to 1024 x vocab

struct CpuOutputs {
  at::Tensor row_losses, stats, grad_x, grad_weight, grad_bias;  // stats (2, N): lse, nll = -log p(target)
};

// One pass over row chunks: per-row loss and lse, and when grad_rows is given, the gradients of
// sum_n grad_rows[n] * loss_n (grad_rows: per-row weights, already holding 1/count for "mean").
CpuOutputs run_cpu(const Problem& p, const std::optional<at::Tensor>& grad_rows, const GradRequest& want,
                   const std::optional<at::Tensor>& stats_in) {
  const auto acc = stats_dtype(p.x2d.scalar_type());
  const LossConfig& c = p.cfg;
  CpuOutputs o;
  o.row_losses = at::zeros({p.rows}, p.x2d.options().dtype(acc));
  o.stats = stats_in.has_value() ? *stats_in : at::zeros({2, p.rows}, p.x2d.options().dtype(acc));
  const at::Tensor w = p.weight.to(acc);
  const at::Tensor b = p.bias.defined() ? p.bias.to(acc) : at::Tensor();
  at::Tensor gx, gw, gb;
  if (grad_rows.has_value()) {
    if (want.x) gx = at::zeros({p.rows, p.hidden}, p.x2d.options().dtype(acc));
    if (want.weight) gw = at::zeros({p.vocab, p.hidden}, p.x2d.options().dtype(acc));
    if (want.bias) gb = at::zeros({p.vocab}, p.x2d.options().dtype(acc));
  }
  const at::Tensor valid = p.target.ne(c.ignore_index);
  const at::Tensor out_of_range = valid.logical_and(p.target.lt(0).logical_or(p.target.ge(p.vocab)));
  TORCH_CHECK(!out_of_range.any().item<bool>(), "target must hold class indices in [0, ", p.vocab,
              ") or ignore_index (", c.ignore_index, "); got an index out of that range");
  for (int64_t r0 = 0; r0 < p.rows; r0 += kCpuChunkRows) {
    const int64_t r1 = std::min(p.rows, r0 + kCpuChunkRows);
    const at::Tensor xc = p.x2d.slice(0, r0, r1).to(acc);
    const at::Tensor vc = valid.slice(0, r0, r1);
    const at::Tensor tc = at::where(vc, p.target.slice(0, r0, r1), at::zeros_like(p.target.slice(0, r0, r1)));
    at::Tensor z = at::mm(xc, w.t());
    if (b.defined()) z = z + b;
    at::Tensor capped = c.softcap > 0 ? at::tanh(z / c.softcap) * c.softcap : z;
    const at::Tensor zt = capped.gather(1, tc.unsqueeze(1)).squeeze(1);
    at::Tensor lse, nll;
    if (stats_in.has_value()) {
      lse = o.stats[0].slice(0, r0, r1);
      nll = o.stats[1].slice(0, r0, r1);
    } else {
      // nll = (max - z_t) + log(sum exp(z - max)): no cancellation of lse against z_t when the target
      // dominates.
      const at::Tensor mx = std::get<0>(capped.max(1));
      const at::Tensor log_sum = at::log(at::exp(capped - mx.unsqueeze(1)).sum(1));
      lse = mx + log_sum;
      nll = (mx - zt) + log_sum;
    }
    at::Tensor loss = (1.0 - c.label_smoothing) * nll;
    if (c.label_smoothing > 0) loss = loss + c.label_smoothing * (lse - capped.sum(1) / p.vocab);
    if (c.z_loss > 0) loss = loss + c.z_loss * lse * lse;
    const at::Tensor vmask = vc.to(acc);
    o.row_losses.slice(0, r0, r1).copy_(loss * vmask);
    if (!stats_in.has_value()) {
      o.stats[0].slice(0, r0, r1).copy_(lse * vmask);
      o.stats[1].slice(0, r0, r1).copy_(nll * vmask);
    }
    if (!grad_rows.has_value()) continue;
    const at::Tensor lse_col = lse.unsqueeze(1);
    const at::Tensor prob = at::exp(capped - lse_col);
    at::Tensor dz = c.z_loss > 0 ? prob * (1.0 + 2.0 * c.z_loss * lse_col) : prob.clone();
    // The target's p - 1 as expm1(-nll): exact for a confident model.
    at::Tensor target_grad = at::expm1(-nll) + c.label_smoothing;
    if (c.z_loss > 0) target_grad = target_grad + prob.gather(1, tc.unsqueeze(1)).squeeze(1) * (2.0 * c.z_loss) * lse;
    dz.scatter_(1, tc.unsqueeze(1), target_grad.unsqueeze(1));
    if (c.label_smoothing > 0) dz = dz - c.label_smoothing / p.vocab;
    if (c.softcap > 0) dz = dz * (1.0 - (capped / c.softcap).square());
    dz = dz * (grad_rows->slice(0, r0, r1) * vmask).unsqueeze(1);
    if (gx.defined()) gx.slice(0, r0, r1).copy_(at::mm(dz, w));
    if (gw.defined()) gw.add_(at::mm(dz.t(), xc));
    if (gb.defined()) gb.add_(dz.sum(0));
  }
  const auto dt = p.x2d.scalar_type();
  if (gx.defined()) o.grad_x = gx.to(dt);
  if (gw.defined()) o.grad_weight = gw.to(dt);
  if (gb.defined()) o.grad_bias = gb.to(dt);
  return o;
}

at::Tensor or_empty(const at::Tensor& t, const at::Tensor& like) {
  return t.defined() ? t : at::empty({0}, like.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fwd_cpu(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& target, const std::optional<at::Tensor>& bias,
    int64_t ignore_index, c10::string_view reduction, double label_smoothing, double z_loss, double softcap,
    bool low_memory, bool grad_x, bool grad_weight, bool grad_bias) {
  (void)low_memory;  // one CPU strategy
  const Problem p = prepare(x, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss, softcap,
                            /*allow_double=*/true);
  GradRequest want{grad_x, grad_weight, grad_bias && p.bias.defined()};
  const bool precompute = want.any() && p.cfg.reduction != Reduction::kNone;
  const at::Tensor inv_count = inverse_valid_count(p);
  std::optional<at::Tensor> grad_rows;
  if (precompute) {
    const at::Tensor one = at::ones({p.rows}, p.x2d.options().dtype(stats_dtype(x.scalar_type())));
    grad_rows = p.cfg.reduction == Reduction::kMean ? one * inv_count : one;
  }
  CpuOutputs o = run_cpu(p, grad_rows, want, std::nullopt);
  const at::Tensor loss = shape_loss(o.row_losses, inv_count, p);
  at::Tensor gx = o.grad_x.defined() ? o.grad_x.view(x.sizes()) : o.grad_x;
  return {loss,
          o.stats,
          or_empty(gx, x),
          or_empty(o.grad_weight, x),
          or_empty(o.grad_bias, x),
          at::ones({}, x.options().dtype(at::kFloat))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cpu(
    const at::Tensor& grad_loss, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, const at::Tensor& lse, int64_t ignore_index, c10::string_view reduction,
    double label_smoothing, double z_loss, double softcap, bool low_memory, bool grad_x, bool grad_weight,
    bool grad_bias) {
  (void)low_memory;
  const Problem p = prepare(x, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss, softcap,
                            /*allow_double=*/true);
  const auto acc = stats_dtype(x.scalar_type());
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == 2 && lse.size(1) == p.rows && lse.scalar_type() == acc,
              "lse must be the (2, ", p.rows, ") ", acc, " row statistics linear_cross_entropy_fwd returned, got ",
              lse.scalar_type(), " of shape ", lse.sizes());
  const at::Tensor g = grad_loss.to(acc);
  at::Tensor grad_rows;
  if (p.cfg.reduction == Reduction::kNone) {
    TORCH_CHECK(grad_loss.sizes() == p.batch_shape, "grad_loss must have the loss's shape ", p.batch_shape,
                ", got ", grad_loss.sizes());
    grad_rows = g.reshape({-1});
  } else {
    TORCH_CHECK(grad_loss.numel() == 1, "grad_loss must be a scalar for reduction '", std::string(reduction),
                "', got shape ", grad_loss.sizes());
    at::Tensor s = g.reshape({});
    if (p.cfg.reduction == Reduction::kMean) s = s * inverse_valid_count(p);
    grad_rows = s.expand({p.rows});
  }
  GradRequest want{grad_x, grad_weight, grad_bias && p.bias.defined()};
  CpuOutputs o = run_cpu(p, grad_rows, want, lse.contiguous());
  at::Tensor gx = o.grad_x.defined() ? o.grad_x.view(x.sizes()) : o.grad_x;
  return {or_empty(gx, x), or_empty(o.grad_weight, x), or_empty(o.grad_bias, x)};
}

void check_grad_shape(const at::Tensor& g, const char* name) {
  TORCH_CHECK(g.numel() == 0 || g.is_contiguous(), name, " must be contiguous");
}

void scale_grads_cpu(at::Tensor& grad_x, at::Tensor& grad_weight, at::Tensor& grad_bias, const at::Tensor& grad_loss,
                     const at::Tensor& grad_scale) {
  TORCH_CHECK(grad_loss.numel() == 1, "grad_loss must be a scalar, got shape ", grad_loss.sizes());
  TORCH_CHECK(grad_scale.numel() == 1, "grad_scale must be a scalar, got shape ", grad_scale.sizes());
  check_grad_shape(grad_x, "grad_x");
  check_grad_shape(grad_weight, "grad_weight");
  check_grad_shape(grad_bias, "grad_bias");
  // A 0-dim multiplier keeps each gradient's dtype; the product is formed in float64.
  const at::Tensor s = grad_loss.reshape({}).to(at::kDouble) * grad_scale.reshape({}).to(at::kDouble);
  for (at::Tensor* g : {&grad_x, &grad_weight, &grad_bias}) {
    if (g->numel()) g->mul_(s);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(fuseforge, CPU, m) {
  m.impl("linear_cross_entropy_fwd", &fwd_cpu);
  m.impl("linear_cross_entropy_bwd", &bwd_cpu);
  m.impl("linear_cross_entropy_scale_grads_", &scale_grads_cpu);
}

}  // namespace fuseforge::linear_cross_entropy
