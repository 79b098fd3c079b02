// linear_cross_entropy's fused CPU row kernel, compiled once per CPU build (common/cpu_isa.h). A row
// of logits (<= vocab * 4 bytes, L2-resident) is read three times at most: (1) bias + softcap in place,
// max, sum of the logits; (2) sum exp(z - max) (kept in place when no softcap needs z later), and for
// the entropy sum exp(z - max) (z - max); (3) the gradient dz in place. Vector arithmetic in M
// (float; double for float64) with at::vec::Vectorized, per-row scalars in double. Rows are split
// across threads (each row is independent).
#pragma once
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "linear_cross_entropy/linear_cross_entropy_cpu.h"
#include "common/cpu_vec.h"


namespace fuseforge::linear_cross_entropy::FUSEFORGE_CPU_NS {
namespace {

template <typename M>
using Vec = at::vec::Vectorized<M>;

// Elements a task at least: below this, threads cost more than they save.
constexpr int64_t kGrainElems = 1 << 15;

// max(acc, v) without at::vec::maximum's NaN test (two more instructions a vector, on the dependency
// chain of a max pass): a NaN logit may be dropped from the row's max, but the pass that sums
// exp(z - max) over the same logits turns it into a NaN sum, so the row's loss (and gradient) is NaN
// all the same.
template <typename M>
Vec<M> max_of(const Vec<M>& acc, const Vec<M>& v) {
  return at::vec::clamp_min(v, acc);
}

// exp(x) for the row kernel's arguments, logits minus their max or minus the log-sum-exp (x <= ~0;
// valid for x <= 88). In float with AVX2/AVX-512 it is computed inline rather than by
// Vectorized<float>::exp (SLEEF's expf: a call per vector, its constants reloaded each time): at a
// 256-logit row the exp was ~85% of the row kernel, and this form has about twice its throughput
// (a max + exp-sum pass over 512 rows of 256 logits: 35 us instead of 64 on one Zen 4 core). Same
// accuracy: on every float in [-87.3, 88], at most 0.92 ulp from the exact value (SLEEF's u10 form:
// 0.99), 0.063 ulp on average (as SLEEF's). Results below 2^-126 (x < -87.3) are subnormal or
// flushed to 0 (0 for x <= -87.7; they cannot move a sum that holds exp(0) = 1); NaN stays NaN.
// x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, n ln2_hi exact for |n| <= 127); exp(r) =
// 1 + r + r^2 q(r) by Horner, q of degree 4 fitted for a relative error of 4e-9 on that interval;
// 2^n from the exponent field (n + 127) << 23, which the low bits of t = x log2(e) + (1.5 * 2^23 +
// 127) already hold (adding that constant rounds x log2(e) to an integer).
template <typename M>
Vec<M> exp_row(const Vec<M>& x) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<M, float>) {
    using V = Vec<float>;
    const V xc = at::vec::clamp_max(at::vec::clamp_min(x, V(-88.0f)), V(88.0f));  // NaN passes through
    const V round(12583039.0f);  // 1.5 * 2^23 + 127: adding it rounds to an integer, in the low mantissa bits
    const V t = at::vec::fmadd(xc, V(1.44269504088896341f), round);
    const V n = t - round;
    V r = at::vec::fmadd(n, V(-0.693359375f), xc);
    r = at::vec::fmadd(n, V(2.12194440e-4f), r);
    V q = at::vec::fmadd(V(0.0013879685f), r, V(0.008368694f));
    q = at::vec::fmadd(q, r, V(0.041667227f));
    q = at::vec::fmadd(q, r, V(0.16666521f));
    q = at::vec::fmadd(q, r, V(0.49999997f));
    q = at::vec::fmadd(q, r, V(1.0f));
    q = at::vec::fmadd(q, r, V(1.0f));
#if defined(CPU_CAPABILITY_AVX512)
    const V scale(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(t), 23)));
#else
    const V scale(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(t), 23)));
#endif
    return q * scale;
  }
#endif
  return x.exp();
}

// The lanes' sum in double, pairwise (a dependency chain of log2(lanes) adds, not one per lane).
template <typename M>
double hsum(const Vec<M>& v) {
  constexpr int64_t W = Vec<M>::size();
  alignas(64) M buf[W];
  v.store(buf);
  double s[W];
  for (int64_t i = 0; i < W; ++i) s[i] = static_cast<double>(buf[i]);
  for (int64_t h = W / 2; h > 0; h /= 2)
    for (int64_t i = 0; i < h; ++i) s[i] += s[i + h];
  return s[0];
}

// kEntropy: the row's entropy H = log S - A / S, S = sum exp(z - max), A = sum exp(z - max) (z - max)
// (no cancellation: log S >= 0 and -A / S >= 0), written with lse; in the gradient pass, with
// entropy_grad_rows, dH/dz_j = -p_j (log p_j + H) weighted by the row's entropy gradient.
template <typename M, bool kEntropy>
void row(const CpuRowArgs& a, int64_t r) {
  using V = Vec<M>;
  constexpr int64_t W = V::size();
  const int64_t vocab = a.vocab;
  M* z = static_cast<M*>(a.logits) + r * vocab;
  M* lse_p = static_cast<M*>(a.lse);
  M* nll_p = static_cast<M*>(a.nll);
  const int64_t t = a.target[r];
  if (t == a.ignore_index) {  // no loss, no gradient (and no arithmetic that could turn 0 * inf into NaN)
    if (a.row_loss) static_cast<M*>(a.row_loss)[r] = M(0);
    if (!a.stats_in) lse_p[r] = nll_p[r] = M(0);
    if constexpr (kEntropy) {
      if (!a.stats_in) static_cast<M*>(a.entropy)[r] = M(0);
    }
    if (a.grad_rows) fill(z, vocab, M(0));
    return;
  }
  const M* bias = static_cast<const M*>(a.bias);
  const bool softcap = a.softcap > 0;
  const bool smoothing = a.label_smoothing > 0;
  const V cap(static_cast<M>(a.softcap));

  // (1) bias and softcap in place; max and sum of the capped logits (the forward's statistics).
  const bool transform = bias || softcap;
  const bool need_stats = !a.stats_in;
  const V ninf(-std::numeric_limits<M>::infinity()), zero(M(0));
  V vmax = ninf, vsum = zero;
  if (!transform && !smoothing && need_stats) {  // the max only: plain loads, no per-vector branches
    V vmax1 = ninf;
    int64_t i = 0;
    for (; i + 2 * W <= vocab; i += 2 * W) {
      vmax = max_of(vmax, V::loadu(z + i));
      vmax1 = max_of(vmax1, V::loadu(z + i + W));
    }
    for (; i + W <= vocab; i += W) vmax = max_of(vmax, V::loadu(z + i));
    if (i < vocab) vmax = max_of(vmax, V::set(ninf, V::loadu(z + i, vocab - i), vocab - i));
    vmax = max_of(vmax, vmax1);
  } else if (transform || need_stats) {
    // Two independent accumulators each (a row of a small vocabulary is a few vectors: the chain of
    // dependent max/add latencies, not the loads, bounds it); combined in a fixed order.
    V vmax1 = ninf, vsum1 = zero;
    auto step = [&](int64_t i, int64_t n, V& mx, V& sm) {
      V v = V::loadu(z + i, n);
      if (bias) v = v + V::loadu(bias + i, n);
      if (softcap) v = cap * (v / cap).tanh();
      if (transform) v.store(z + i, n);
      if (n == W) {
        mx = max_of(mx, v);
        if (smoothing) sm = sm + v;
      } else {  // the tail: lanes past the row hold no logit
        mx = max_of(mx, V::set(ninf, v, n));
        if (smoothing) sm = sm + V::set(zero, v, n);
      }
    };
    int64_t i = 0;
    for (; i + 2 * W <= vocab; i += 2 * W) {
      step(i, W, vmax, vsum);
      step(i + W, W, vmax1, vsum1);
    }
    for (; i < vocab; i += W) step(i, std::min(W, vocab - i), vmax, vsum);
    vmax = max_of(vmax, vmax1);
    vsum = vsum + vsum1;
  }
  const double zt = static_cast<double>(z[t]);  // the target's logit, exactly as the GEMM (+ bias, cap) made it
  double lse, nll;
  const bool entropy_grad = kEntropy && a.entropy_grad_rows != nullptr;
  // Without softcap the gradient needs only exp(z - max), not z: pass (2) keeps it in place, and pass
  // (3) scales it instead of computing a second exp.
  const bool keep_exp = need_stats && a.grad_rows && !softcap && !entropy_grad;
  double inv_sum = 0;
  double entropy = 0;
  if (need_stats) {
    // nll = (max - z_t) + log(sum exp(z - max)): no cancellation of lse against z_t when the target dominates.
    const M mx = lanes_max(vmax);
    const V vmx(mx);
    // (z - max) * exp(z - max) with z - max clamped to a finite value: 0, not NaN, for a -inf logit.
    const V lowest(std::numeric_limits<M>::lowest());
    V vs = zero, vs1 = zero, va = zero, va1 = zero;
    int64_t i = 0;
    for (; i + 2 * W <= vocab; i += 2 * W) {  // two accumulators, as pass (1)
      const V d0 = V::loadu(z + i) - vmx;
      const V d1 = V::loadu(z + i + W) - vmx;
      const V e0 = exp_row<M>(d0);
      const V e1 = exp_row<M>(d1);
      if (keep_exp) {
        e0.store(z + i);
        e1.store(z + i + W);
      }
      vs = vs + e0;
      vs1 = vs1 + e1;
      if constexpr (kEntropy) {
        va = at::vec::fmadd(e0, at::vec::clamp_min(d0, lowest), va);
        va1 = at::vec::fmadd(e1, at::vec::clamp_min(d1, lowest), va1);
      }
    }
    for (; i < vocab; i += W) {
      const int64_t n = std::min(W, vocab - i);
      const V d = V::loadu(z + i, n) - vmx;
      const V e = exp_row<M>(d);
      if (keep_exp) e.store(z + i, n);
      vs = vs + (n == W ? e : V::set(zero, e, n));
      if constexpr (kEntropy) {
        const V ed = e * at::vec::clamp_min(d, lowest);
        va = va + (n == W ? ed : V::set(zero, ed, n));
      }
    }
    const double sum = hsum(vs + vs1);
    inv_sum = 1.0 / sum;
    const double log_sum = std::log(sum);
    lse = static_cast<double>(mx) + log_sum;
    nll = (static_cast<double>(mx) - zt) + log_sum;
    lse_p[r] = static_cast<M>(lse);
    nll_p[r] = static_cast<M>(nll);
    if constexpr (kEntropy) {
      entropy = log_sum - hsum(va + va1) * inv_sum;
      static_cast<M*>(a.entropy)[r] = static_cast<M>(entropy);
    }
    if (a.row_loss) {
      double loss = (1.0 - a.label_smoothing) * nll;
      if (smoothing) loss += a.label_smoothing * (lse - hsum(vsum) / static_cast<double>(vocab));
      if (a.z_loss > 0) loss += a.z_loss * lse * lse;
      static_cast<M*>(a.row_loss)[r] = static_cast<M>(loss);
    }
  } else {
    lse = static_cast<double>(lse_p[r]);
    nll = static_cast<double>(nll_p[r]);
    if constexpr (kEntropy) entropy = static_cast<double>(static_cast<const M*>(a.entropy)[r]);
  }
  if (!a.grad_rows) return;

  // (3) dz = (softmax * (1 + 2 z_loss lse) - smoothing / V) * (1 - (z / cap)^2) * g, in place; the
  // target's p - 1 as expm1(-nll) (exact for a confident model), set after the vector pass.
  const double g = static_cast<double>(static_cast<const M*>(a.grad_rows)[r * a.grad_rows_stride]);
  const double scale = a.z_loss > 0 ? 1.0 + 2.0 * a.z_loss * lse : 1.0;
  const double shift = a.label_smoothing / static_cast<double>(vocab);
  const V vlse(static_cast<M>(lse)), vscale(static_cast<M>(scale)), vshift(static_cast<M>(shift)),
      vg(static_cast<M>(g)), one(M(1));
  // With the entropy's gradient: dz += g_H * (-p (log p + H)), log p = z - lse.
  const double g_entropy =
      entropy_grad ? static_cast<double>(static_cast<const M*>(a.entropy_grad_rows)[r]) : 0.0;
  if (keep_exp) {  // z holds exp(z - max): softmax = that / sum
    const V vp(static_cast<M>(scale * inv_sum));
    for (int64_t i = 0; i < vocab; i += W) {
      const int64_t n = std::min(W, vocab - i);
      ((V::loadu(z + i, n) * vp - vshift) * vg).store(z + i, n);
    }
  } else if (entropy_grad) {
    const V vent(static_cast<M>(entropy)), vge(static_cast<M>(g_entropy));
    for (int64_t i = 0; i < vocab; i += W) {
      const int64_t n = std::min(W, vocab - i);
      const V c = V::loadu(z + i, n);
      const V logp = c - vlse;
      const V prob = exp_row<M>(logp);
      V d = (prob * vscale - vshift) * vg - prob * (logp + vent) * vge;
      if (softcap) {
        const V u = c / cap;
        d = d * (one - u * u);
      }
      d.store(z + i, n);
    }
  } else {
    for (int64_t i = 0; i < vocab; i += W) {
      const int64_t n = std::min(W, vocab - i);
      const V c = V::loadu(z + i, n);
      V d = exp_row<M>(c - vlse) * vscale - vshift;
      if (softcap) {
        const V u = c / cap;
        d = d * (one - u * u);
      }
      (d * vg).store(z + i, n);
    }
  }
  double dt = std::expm1(-nll) + a.label_smoothing;
  if (a.z_loss > 0) dt += std::exp(zt - lse) * (2.0 * a.z_loss) * lse;
  dt -= shift;
  const double u = softcap ? zt / a.softcap : 0.0;
  const double cap_grad = 1.0 - u * u;
  if (softcap) dt *= cap_grad;
  double dz_t = dt * g;
  // The target's -p (log p + H) with log p = -nll (exact where p is close to 1).
  if (entropy_grad) dz_t -= g_entropy * std::exp(-nll) * (entropy - nll) * cap_grad;
  z[t] = static_cast<M>(dz_t);
}

template <typename M>
void rows_typed(const CpuRowArgs& a) {
  const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, a.vocab));
  at::parallel_for(0, a.rows, grain, [&](int64_t r0, int64_t r1) {
    if (a.entropy) {
      for (int64_t r = r0; r < r1; ++r) row<M, true>(a, r);
    } else {
      for (int64_t r = r0; r < r1; ++r) row<M, false>(a, r);
    }
  });
}

}  // namespace

void rows(const CpuRowArgs& a) {
  if (a.rows == 0) return;
  if (a.dtype == c10::kDouble) {
    rows_typed<double>(a);
  } else {
    TORCH_CHECK(a.dtype == c10::kFloat, "linear_cross_entropy CPU row kernel: math type must be float32 or float64");
    rows_typed<float>(a);
  }
}

}  // namespace fuseforge::linear_cross_entropy::FUSEFORGE_CPU_NS
