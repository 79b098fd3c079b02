// linear_cross_entropy: argument checks shared by every implementation, and the CPU implementation
// (the reference the CUDA pipeline must match; float64 serves gradcheck). The CPU path works in
// row chunks: ATen's GEMMs into a reused chunk buffer, and between them one fused, vectorised row
// kernel (linear_cross_entropy_cpu_kernel.h), in float32 (float64 for float64 inputs).
#include "linear_cross_entropy/linear_cross_entropy.h"

#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "common/checks.h"
#include "common/cpu_isa.h"
#include "common/env.h"
#include "common/not_differentiable.h"
#include "linear_cross_entropy/linear_cross_entropy_cpu.h"

namespace fuseforge::linear_cross_entropy {

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
  // (The tests on dim and dtype spare the common case's reshape and to(): each is a dispatcher call.)
  p.x2d = (x.dim() == 2 ? x : x.reshape({-1, p.hidden})).contiguous();
  p.rows = p.x2d.size(0);
  p.weight = weight.contiguous();
  const at::Tensor t1 = target.dim() == 1 ? target : target.reshape({-1});
  p.target = (t1.scalar_type() == at::kLong ? t1 : t1.to(at::kLong)).contiguous();
  p.batch_shape = target.sizes();
  return p;
}

at::Tensor inverse_valid_count(const Problem& p) {
  const at::Tensor count = p.target.ne(p.cfg.ignore_index).sum().clamp_min(1);
  return at::reciprocal(count.to(stats_dtype(p.x2d.scalar_type())));
}

void check_entropy_request(const Problem& p, bool entropy) {
  TORCH_CHECK(!entropy || p.cfg.reduction == Reduction::kNone,
              "entropy is a per-token output: it needs reduction 'none', got another reduction");
}

EntropyGrad entropy_grad_inputs(const Problem& p, const at::Tensor& x, const std::optional<at::Tensor>& entropy,
                                const std::optional<at::Tensor>& grad_entropy) {
  EntropyGrad e;
  if (!grad_entropy.has_value() || !grad_entropy->defined()) return e;
  TORCH_CHECK(p.cfg.reduction == Reduction::kNone,
              "grad_entropy needs reduction 'none' (the entropy is a per-token output), got another reduction");
  TORCH_CHECK(entropy.has_value() && entropy->defined(),
              "grad_entropy needs entropy: the entropy rows linear_cross_entropy_fwd returned");
  const auto sd = stats_dtype(x.scalar_type());
  check_same_device(x, "x", *entropy, "entropy");
  check_same_device(x, "x", *grad_entropy, "grad_entropy");
  TORCH_CHECK(entropy->sizes() == p.batch_shape && entropy->scalar_type() == sd, "entropy must be the ", sd,
              " tensor of shape ", p.batch_shape, " linear_cross_entropy_fwd returned, got ", entropy->scalar_type(),
              " of shape ", entropy->sizes());
  TORCH_CHECK(grad_entropy->sizes() == p.batch_shape, "grad_entropy must have the entropy's shape ", p.batch_shape,
              ", got ", grad_entropy->sizes());
  e.entropy = entropy->reshape({-1}).contiguous();
  e.grad = grad_entropy->reshape({-1}).to(sd).contiguous();
  return e;
}

Problem prepare_rows(const at::Tensor& logits, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& target,
                     const std::optional<at::Tensor>& bias, int64_t ignore_index, double softcap, bool allow_double) {
  Problem p = prepare(x, weight, target, bias, ignore_index, "none", 0.0, 0.0, softcap, allow_double);
  check_same_device(p.x2d, "x", logits, "logits");
  TORCH_CHECK(logits.scalar_type() == p.x2d.scalar_type(), "logits must have the dtype of x (",
              p.x2d.scalar_type(), "), got ", logits.scalar_type());
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == p.rows && logits.size(1) == p.vocab, "logits must have shape (",
              p.rows, ", ", p.vocab, ") (x's rows, weight's rows), got ", logits.sizes());
  TORCH_CHECK(logits.is_contiguous(), "logits must be contiguous");
  return p;
}

RowsGradArgs check_rows_grad(const at::Tensor& logits, const at::Tensor& stats, const at::Tensor& target,
                             const std::optional<at::Tensor>& bias, const at::Tensor& row_scale, double softcap,
                             bool allow_double) {
  check_dtype_supported(logits, "logits", allow_double);
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "logits must be a contiguous (rows, vocab) tensor, got ",
              logits.sizes(), logits.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0.0,
              "softcap must be a positive finite number (or 0 for no soft-capping), got ", softcap);
  const int64_t rows = logits.size(0);
  const auto sd = stats_dtype(logits.scalar_type());
  check_same_device(logits, "logits", stats, "stats");
  check_same_device(logits, "logits", row_scale, "row_scale");
  check_same_device(logits, "logits", target, "target");
  TORCH_CHECK(target.dim() == 1 && target.size(0) == rows &&
                  (target.scalar_type() == at::kLong || target.scalar_type() == at::kInt),
              "target must be an int64 or int32 tensor of shape (", rows, ",) (logits' rows), got ",
              target.scalar_type(), " of shape ", target.sizes());
  TORCH_CHECK(stats.dim() == 2 && stats.size(0) == 3 && stats.size(1) == rows && stats.scalar_type() == sd,
              "stats must be the (3, ", rows, ") ", sd, " statistics linear_cross_entropy_rows_stats returned, got ",
              stats.scalar_type(), " of shape ", stats.sizes());
  TORCH_CHECK(row_scale.dim() == 1 && row_scale.size(0) == rows && row_scale.scalar_type() == sd,
              "row_scale must be a (", rows, ",) ", sd, " tensor, got ", row_scale.scalar_type(), " of shape ",
              row_scale.sizes());
  RowsGradArgs a;
  a.target = (target.scalar_type() == at::kLong ? target : target.to(at::kLong)).contiguous();
  if (bias.has_value() && bias->defined()) {
    check_same_device(logits, "logits", *bias, "bias");
    TORCH_CHECK(bias->scalar_type() == logits.scalar_type() && bias->dim() == 1 && bias->size(0) == logits.size(1),
                "bias must be a (", logits.size(1), ",) ", logits.scalar_type(), " tensor (logits' columns), got ",
                bias->scalar_type(), " of shape ", bias->sizes());
    a.bias = bias->contiguous();
  }
  return a;
}

at::Tensor shape_loss(const at::Tensor& row_losses, const at::Tensor& inv_count, const Problem& p) {
  return reduce_rows(row_losses, inv_count, p.cfg.reduction, p.batch_shape);
}

namespace {

// Rows a chunk. Every chunk's GEMMs read all of the weight W (V x H; MKL packs it again in every
// call) for rows x V x H multiply-adds, and every chunk's addmm reads and writes the V x H weight
// gradient, so short chunks spend their time on W: at 4096 x 1024 x 32000 float32 on 2 EPYC cores,
// 262-row chunks (32 MiB of logits) took 1.80 s forward and 5.09 s forward+backward, 1024-row ones
// 1.54 and 4.49 s (2048: no faster). A chunk therefore has min(1024, H) rows at least, which makes
// its logits no larger than W itself (nor the weight gradient a backward holds), or more when
// 32 MiB of logits hold more (small vocabularies: cache-resident chunks), within [128, 2048].
// FUSEFORGE_LCE_CPU_CHUNK_ROWS overrides it (tuning).
constexpr int64_t kCpuChunkBytes = 32ll << 20;
constexpr int64_t kCpuChunkWeightRows = 1024;
constexpr int64_t kCpuChunkMinRows = 128;
constexpr int64_t kCpuChunkMaxRows = 2048;

int64_t cpu_chunk_rows(int64_t vocab, int64_t hidden, int64_t elem_bytes) {
  const int64_t fit = kCpuChunkBytes / std::max<int64_t>(1, vocab * elem_bytes);
  const int64_t rows = std::clamp(std::max(fit, std::min(kCpuChunkWeightRows, hidden)), kCpuChunkMinRows,
                                  kCpuChunkMaxRows);
  return dev_positive_int("FUSEFORGE_LCE_CPU_CHUNK_ROWS", rows);
}

struct CpuOutputs {
  at::Tensor row_losses, stats, grad_x, grad_weight, grad_bias;  // stats (2, N): lse, nll = -log p(target)
  at::Tensor entropy;                                             // (N,) when asked for
};

// The gradients' per-row weights: a (N,) tensor, or one number for every row.
struct RowWeights {
  at::Tensor per_row;   // defined: per-row weights (reduction "none")
  double scalar = 1.0;  // else: 1/count for "mean" (grad_loss folded in for the backward)
};

// The raised error for a target outside [0, vocab) that is not ignore_index (on the CPU a host check
// costs nothing; CUDA makes such rows NaN instead). Returns 1 / max(1, number of targets that are
// not ignore_index), inverse_valid_count's value, without its five tensor ops.
double check_targets(const Problem& p) {
  const int64_t* t = p.target.data_ptr<int64_t>();
  int64_t valid = 0;
  for (int64_t i = 0; i < p.rows; ++i) {
    const int64_t v = t[i];
    if (v == p.cfg.ignore_index) continue;
    TORCH_CHECK(v >= 0 && v < p.vocab, "target must hold class indices in [0, ", p.vocab, ") or ignore_index (",
                p.cfg.ignore_index, "); got an index out of that range (", v, " at flattened position ", i, ")");
    ++valid;
  }
  return 1.0 / static_cast<double>(std::max<int64_t>(1, valid));
}

// One pass over row chunks: x_c @ W^T into a reused chunk buffer (ATen's GEMM, its own threads), the
// fused row kernel (row losses and lse/nll, and when weights are given the logit gradients in place),
// then grad_x rows = dz @ W and grad_W += dz^T @ x_c. Gradients are of sum_n weight_n * loss_n.
// stats_in: lse/nll from the forward (the recomputing backward), else computed and returned.
// want_entropy: the rows' entropies too (forward); ent: the forward's entropies and their upstream
// gradient, which the logit gradients then include (backward).
CpuOutputs run_cpu(const Problem& p, const std::optional<RowWeights>& weights, const GradRequest& want,
                   const std::optional<at::Tensor>& stats_in, bool want_entropy = false, const EntropyGrad& ent = {}) {
  const auto dt = p.x2d.scalar_type();
  const auto acc = stats_dtype(dt);
  const bool convert = dt != acc;  // bf16/fp16: chunks converted to float32, GEMMs in float32
  const auto opts = p.x2d.options().dtype(acc);
  const LossConfig& c = p.cfg;
  const bool grads = weights.has_value() && want.any();

  CpuOutputs o;
  if (!stats_in.has_value()) o.row_losses = at::empty({p.rows}, opts);
  o.stats = stats_in.has_value() ? *stats_in : at::empty({2, p.rows}, opts);
  if (want_entropy) o.entropy = at::empty({p.rows}, opts);
  const at::Tensor& entropy_rows = want_entropy ? o.entropy : ent.entropy;
  const at::Tensor w = convert ? p.weight.to(acc) : p.weight;
  const at::Tensor b = p.bias.defined() ? p.bias.to(acc).contiguous() : at::Tensor();
  const int64_t chunk = std::min(p.rows, cpu_chunk_rows(p.vocab, p.hidden, static_cast<int64_t>(at::elementSize(acc))));

  at::Tensor gx, gx_buf, gw, gb, x_buf;
  if (grads && want.x) {
    gx = at::empty({p.rows, p.hidden}, p.x2d.options());
    if (convert) gx_buf = at::empty({chunk, p.hidden}, opts);
  }
  // The math type: they accumulate over chunks (the first chunk's GEMM writes, later ones add).
  if (grads && want.weight) gw = p.rows ? at::empty({p.vocab, p.hidden}, opts) : at::zeros({p.vocab, p.hidden}, opts);
  if (grads && want.bias) gb = p.rows ? at::empty({p.vocab}, opts) : at::zeros({p.vocab}, opts);
  if (convert) x_buf = at::empty({chunk, p.hidden}, opts);
  const at::Tensor logits = at::empty({chunk, p.vocab}, opts);
  at::Tensor row_weights;
  int64_t weight_stride = 0;
  // One weight for every row: kept here in the math type (no tensor for it).
  const double scalar_weight = grads ? weights->scalar : 0.0;
  const float scalar_weight_f = static_cast<float>(scalar_weight);
  const void* scalar_weight_p = acc == at::kDouble ? static_cast<const void*>(&scalar_weight)
                                                   : static_cast<const void*>(&scalar_weight_f);
  if (grads && weights->per_row.defined()) {
    row_weights = weights->per_row.to(acc).contiguous();
    weight_stride = 1;
  }

  // Whole tensors rather than slices when one chunk covers every row (each slice, narrow or
  // transpose is a dispatcher call: a few microseconds a call at the demo's size).
  const bool one_chunk = chunk == p.rows;
  const at::Tensor wt = w.t();
  char* const lse_all = static_cast<char*>(o.stats.data_ptr());
  char* const nll_all = lse_all + p.rows * static_cast<int64_t>(at::elementSize(acc));
  for (int64_t r0 = 0; r0 < p.rows; r0 += chunk) {
    const int64_t r1 = std::min(p.rows, r0 + chunk), n = r1 - r0;
    const at::Tensor xr = one_chunk ? p.x2d : p.x2d.slice(0, r0, r1);
    const at::Tensor xc = convert ? (one_chunk ? x_buf : x_buf.narrow(0, 0, n)).copy_(xr) : xr;
    at::Tensor zc = n == chunk ? logits : logits.narrow(0, 0, n);
    at::mm_out(zc, xc, wt);

    CpuRowArgs a{};
    a.logits = zc.data_ptr();
    a.bias = b.defined() ? b.data_ptr() : nullptr;
    a.target = p.target.data_ptr<int64_t>() + r0;
    a.row_loss = o.row_losses.defined() ? static_cast<char*>(o.row_losses.data_ptr()) + r0 * zc.element_size()
                                        : nullptr;
    a.lse = lse_all + r0 * zc.element_size();
    a.nll = nll_all + r0 * zc.element_size();
    a.stats_in = stats_in.has_value();
    a.entropy = entropy_rows.defined() ? static_cast<char*>(entropy_rows.data_ptr()) + r0 * zc.element_size() : nullptr;
    a.entropy_grad_rows =
        grads && ent.defined() ? static_cast<const char*>(ent.grad.data_ptr()) + r0 * zc.element_size() : nullptr;
    a.grad_rows = !grads ? nullptr
                  : weight_stride ? static_cast<const char*>(row_weights.data_ptr()) + r0 * zc.element_size()
                                  : scalar_weight_p;
    a.grad_rows_stride = weight_stride;
    a.rows = n;
    a.vocab = p.vocab;
    a.ignore_index = c.ignore_index;
    a.label_smoothing = c.label_smoothing;
    a.z_loss = c.z_loss;
    a.softcap = c.softcap;
    a.dtype = acc;
    FUSEFORGE_CPU_ISA_CALL(rows, a);
    if (!grads) continue;

    // zc now holds dz (zero rows for ignored targets).
    if (gx.defined()) {
      if (convert) {
        at::Tensor gxc = n == chunk ? gx_buf : gx_buf.narrow(0, 0, n);
        at::mm_out(gxc, zc, w);
        (one_chunk ? gx : gx.slice(0, r0, r1)).copy_(gxc);
      } else {
        at::Tensor gxc = one_chunk ? gx : gx.slice(0, r0, r1);
        at::mm_out(gxc, zc, w);
      }
    }
    const bool first = r0 == 0;
    if (gw.defined()) {
      const at::Tensor dzt = zc.t();
      if (first) at::mm_out(gw, dzt, xc);
      else gw.addmm_(dzt, xc);
    }
    if (gb.defined()) {
      if (first) at::sum_out(gb, zc, {0});
      else gb.add_(zc.sum(0));
    }
  }
  if (gx.defined()) o.grad_x = gx;
  if (gw.defined()) o.grad_weight = convert ? gw.to(dt) : gw;
  if (gb.defined()) o.grad_bias = convert ? gb.to(dt) : gb;
  return o;
}

// shape_loss on the host: the row losses summed in double, in row order (deterministic), and scaled
// by inv for "mean", without the tensor ops (sum, scalar_tensor, mul) for one number.
at::Tensor reduce_loss_cpu(const at::Tensor& row_losses, double inv, const Problem& p) {
  if (p.cfg.reduction == Reduction::kNone) return row_losses.view(p.batch_shape);
  at::Tensor loss = at::empty({}, row_losses.options());
  AT_DISPATCH_FLOATING_TYPES(row_losses.scalar_type(), "linear_cross_entropy_cpu_loss", [&] {
    const scalar_t* l = row_losses.const_data_ptr<scalar_t>();
    double s = 0;
    for (int64_t i = 0; i < p.rows; ++i) s += static_cast<double>(l[i]);
    if (p.cfg.reduction == Reduction::kMean) s *= inv;
    *loss.data_ptr<scalar_t>() = static_cast<scalar_t>(s);
  });
  return loss;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fwd_cpu(
    const at::Tensor& x, const at::Tensor& weight, const at::Tensor& target, const std::optional<at::Tensor>& bias,
    int64_t ignore_index, c10::string_view reduction, double label_smoothing, double z_loss, double softcap,
    bool low_memory, bool grad_x, bool grad_weight, bool grad_bias, bool entropy) {
  (void)low_memory;  // one CPU strategy
  const Problem p = prepare(x, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss, softcap,
                            /*allow_double=*/true);
  check_entropy_request(p, entropy);
  GradRequest want{grad_x, grad_weight, grad_bias && p.bias.defined()};
  const bool precompute = want.any() && p.cfg.reduction != Reduction::kNone;
  const double inv = check_targets(p);
  std::optional<RowWeights> weights;
  if (precompute) {
    weights = RowWeights{};
    weights->scalar = p.cfg.reduction == Reduction::kMean ? inv : 1.0;
  }
  CpuOutputs o = run_cpu(p, weights, want, std::nullopt, entropy);
  const at::Tensor loss = reduce_loss_cpu(o.row_losses, inv, p);
  at::Tensor gx = !o.grad_x.defined() || x.dim() == 2 ? o.grad_x : o.grad_x.view(x.sizes());
  at::Tensor grad_scale = at::empty({}, x.options().dtype(at::kFloat));
  *grad_scale.data_ptr<float>() = 1.0f;
  const at::Tensor ent = entropy ? o.entropy.view(p.batch_shape) : at::empty({0}, o.stats.options());
  return {loss, o.stats, or_empty(gx, x), or_empty(o.grad_weight, x), or_empty(o.grad_bias, x), grad_scale, ent};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cpu(
    const at::Tensor& grad_loss, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& target,
    const std::optional<at::Tensor>& bias, const at::Tensor& lse, int64_t ignore_index, c10::string_view reduction,
    double label_smoothing, double z_loss, double softcap, bool low_memory, bool grad_x, bool grad_weight,
    bool grad_bias, const std::optional<at::Tensor>& entropy, const std::optional<at::Tensor>& grad_entropy) {
  (void)low_memory;
  const Problem p = prepare(x, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss, softcap,
                            /*allow_double=*/true);
  const EntropyGrad ent = entropy_grad_inputs(p, x, entropy, grad_entropy);
  const auto acc = stats_dtype(x.scalar_type());
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == 2 && lse.size(1) == p.rows && lse.scalar_type() == acc,
              "lse must be the (2, ", p.rows, ") ", acc, " row statistics linear_cross_entropy_fwd returned, got ",
              lse.scalar_type(), " of shape ", lse.sizes());
  const at::Tensor g = grad_loss.to(acc);
  const double inv = check_targets(p);
  RowWeights weights;
  if (p.cfg.reduction == Reduction::kNone) {
    TORCH_CHECK(grad_loss.sizes() == p.batch_shape, "grad_loss must have the loss's shape ", p.batch_shape,
                ", got ", grad_loss.sizes());
    weights.per_row = g.reshape({-1});
  } else {
    TORCH_CHECK(grad_loss.numel() == 1, "grad_loss must be a scalar for reduction '", std::string(reduction),
                "', got shape ", grad_loss.sizes());
    weights.scalar = g.item<double>();
    if (p.cfg.reduction == Reduction::kMean) weights.scalar *= inv;
  }
  GradRequest want{grad_x, grad_weight, grad_bias && p.bias.defined()};
  CpuOutputs o = run_cpu(p, weights, want, lse.contiguous(), /*want_entropy=*/false, ent);
  at::Tensor gx = !o.grad_x.defined() || x.dim() == 2 ? o.grad_x : o.grad_x.view(x.sizes());
  return {or_empty(gx, x), or_empty(o.grad_weight, x), or_empty(o.grad_bias, x)};
}

// A one-element CPU tensor's value, read in place (no reshape/to/item dispatcher calls).
double host_scalar(const at::Tensor& t) {
  double v = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "linear_cross_entropy_scalar",
                                  [&] { v = static_cast<double>(*t.const_data_ptr<scalar_t>()); });
  return v;
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
  // The product in float64; reading it on the host costs nothing on the CPU, and a factor of 1 (the
  // usual loss.backward()) skips the passes over the gradients.
  const double s = host_scalar(grad_loss) * host_scalar(grad_scale);
  if (s == 1.0) return;
  for (at::Tensor* g : {&grad_x, &grad_weight, &grad_bias}) {
    if (g->numel()) g->mul_(s);
  }
}

// ---- rows ops (ATen: a reference-grade path; the chunked sequence losses' CPU side) --------------
// The rows' valid mask and targets (ignored ones as 0), then their float-typed logits with the exact
// target logit in place, bias added and capped.
struct RowLogits {
  at::Tensor valid, t;  // (N,), (N, 1)
  at::Tensor raw, z;    // (N, V): before and after the cap
};

RowLogits row_targets(const at::Tensor& target, int64_t ignore_index) {
  RowLogits r;
  r.valid = target.ne(ignore_index);
  r.t = at::where(r.valid, target, at::zeros_like(target)).unsqueeze(1);
  return r;
}

void set_row_logits(RowLogits& r, const at::Tensor& logits, const at::Tensor& target_logit, const at::Tensor& bias,
                    double softcap) {
  const auto sd = stats_dtype(logits.scalar_type());
  r.raw = logits.to(sd).scatter(1, r.t, target_logit.unsqueeze(1));
  if (bias.defined()) r.raw = r.raw + bias.to(sd);
  r.z = softcap > 0.0 ? at::tanh(r.raw / softcap) * softcap : r.raw;
}

at::Tensor rows_stats_cpu(const at::Tensor& logits, const at::Tensor& x, const at::Tensor& weight,
                          const at::Tensor& target, const std::optional<at::Tensor>& bias, int64_t ignore_index,
                          double softcap) {
  const Problem p = prepare_rows(logits, x, weight, target, bias, ignore_index, softcap, /*allow_double=*/true);
  check_targets(p);
  const auto sd = stats_dtype(logits.scalar_type());
  RowLogits r = row_targets(p.target, ignore_index);
  const at::Tensor zt = (p.x2d.to(sd) * p.weight.index_select(0, r.t.squeeze(1)).to(sd)).sum(1);
  set_row_logits(r, logits, zt, p.bias, softcap);
  const at::Tensor lse = at::logsumexp(r.z, {1});
  const at::Tensor nll = lse - r.z.gather(1, r.t).squeeze(1);
  const at::Tensor zero = at::zeros_like(lse);
  return at::stack({at::where(r.valid, lse, zero), at::where(r.valid, nll, zero), at::where(r.valid, zt, zero)});
}

void rows_grad_cpu(at::Tensor& logits, const at::Tensor& stats, const at::Tensor& target,
                   const std::optional<at::Tensor>& bias, const at::Tensor& row_scale, int64_t ignore_index,
                   double softcap) {
  const RowsGradArgs a = check_rows_grad(logits, stats, target, bias, row_scale, softcap, /*allow_double=*/true);
  RowLogits r = row_targets(a.target, ignore_index);
  set_row_logits(r, logits, stats[2], a.bias, softcap);
  // p - onehot, the target's p - 1 as expm1(-nll) (exact where p is close to 1)
  at::Tensor g = at::exp(r.z - stats[0].unsqueeze(1));
  g.scatter_(1, r.t, at::expm1(-stats[1]).unsqueeze(1));
  if (softcap > 0.0) g.mul_(1.0 - at::tanh(r.raw / softcap).square());
  g.mul_(row_scale.unsqueeze(1));
  logits.copy_(at::where(r.valid.unsqueeze(1), g, at::zeros_like(g)));
}

}  // namespace

TORCH_LIBRARY_IMPL(fuseforge, CPU, m) {
  m.impl("linear_cross_entropy_rows_stats", &rows_stats_cpu);
  m.impl("linear_cross_entropy_rows_grad_", &rows_grad_cpu);
  m.impl("linear_cross_entropy_fwd", &fwd_cpu);
  m.impl("linear_cross_entropy_bwd", &bwd_cpu);
  m.impl("linear_cross_entropy_scale_grads_", &scale_grads_cpu);
}

// The backward ops have no backward of their own (common/not_differentiable.h).
TORCH_LIBRARY_IMPL(fuseforge, Autograd, m) {
  m.impl("linear_cross_entropy_bwd", fuseforge::not_differentiable());
}

}  // namespace fuseforge::linear_cross_entropy
