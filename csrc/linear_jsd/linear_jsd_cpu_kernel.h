// linear_jsd's CPU row kernel, compiled once per CPU build (common/cpu_isa.h). A row's two logit rows
// (<= 2 * vocab * 4 bytes, cache-resident for common vocabularies) are read in four passes: (1) both
// maxima; (2) both sums of exp(z - max), hence both log-sum-exps; (3) the row's divergence and, for
// the gradient, u = Q (g - g_ref) and Q stored over the two rows; (4) dz = u - Q sum(u). The forward
// KL's gradient is Q - P, written in pass (3). Vector arithmetic in M (float; double for float64)
// with at::vec::Vectorized, per-row scalars in double. Rows are split across threads.
//
// Everything is in log space: log Q = s / T - lse_s and log P = t / T - lse_t are formed first, and
// log M = log(beta P + (1 - beta) Q) from the larger of the two, so P log P and Q log M stay exact
// (0 where a probability underflows) for any logits. The reverse KL's and the JSD's gradient is the
// softmax Jacobian applied to g = d loss / d Q: dz = Q (g - sum(Q g)). g_ref, g at the student's
// argmax (computed by the same vector code, so exactly the value that logit gets), is subtracted
// first: sum(Q g) then no longer cancels against the argmax's g when Q is nearly one-hot, and the
// (vanishing) gradients of a saturated student keep their relative accuracy.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/cpu_vec.h"
#include "linear_jsd/linear_jsd_cpu.h"

namespace fuseforge::linear_jsd::FUSEFORGE_CPU_NS {
namespace {

template <typename M>
using Vec = at::vec::Vectorized<M>;

// Elements a task at least: below this, threads cost more than they save.
constexpr int64_t kGrainElems = 1 << 14;

// The lanes' sum in double, in lane order.
template <typename M>
double lanes_sum(const Vec<M>& v) {
  alignas(64) M buf[Vec<M>::size()];
  v.store(buf);
  double s = 0;
  for (int64_t i = 0; i < Vec<M>::size(); ++i) s += static_cast<double>(buf[i]);
  return s;
}

// log(beta exp(lp) + (1 - beta) exp(lq)) from the larger log-probability: max + log(w_big + w_small
// exp(-|lp - lq|)), so neither probability needs to be representable.
template <typename M>
Vec<M> log_mix(const Vec<M>& lp, const Vec<M>& lq, const Vec<M>& beta, const Vec<M>& one_minus_beta) {
  const Vec<M> d = lp - lq;
  const Vec<M> p_larger = d >= Vec<M>(M(0));
  const Vec<M> big = Vec<M>::blendv(one_minus_beta, beta, p_larger);
  const Vec<M> small = Vec<M>::blendv(beta, one_minus_beta, p_larger);
  const Vec<M> e = (Vec<M>(M(0)) - d.abs()).exp();
  return at::vec::maximum(lp, lq) + at::vec::fmadd(small, e, big).log();
}

// The reverse KL's (mode 1) and the JSD's (mode 2) per-logit pieces: Q, g = d loss / d Q up to a
// constant, and the loss term.
//   reverse KL: loss = Q (log Q - log P), g = log Q - log P;
//   JSD: loss = beta P (log P - log M) + Q g, g = (1 - beta) (log Q - log M).
template <typename M>
void terms(int mode, const Vec<M>& lq, const Vec<M>& lp, const Vec<M>& beta, const Vec<M>& one_minus_beta,
           Vec<M>& q, Vec<M>& g, Vec<M>& loss) {
  q = lq.exp();
  if (mode == 1) {
    g = lq - lp;
    loss = q * g;
  } else {
    const Vec<M> lm = log_mix(lp, lq, beta, one_minus_beta);
    g = one_minus_beta * (lq - lm);
    loss = beta * lp.exp() * (lp - lm) + q * g;
  }
}

template <typename M>
void row(const CpuRowArgs& a, int64_t r) {
  using V = Vec<M>;
  constexpr int64_t W = V::size();
  const int64_t vocab = a.vocab;
  M* s = static_cast<M*>(a.student) + r * vocab;
  M* t = static_cast<M*>(a.teacher) + r * vocab;
  const bool grad = a.grad_rows != nullptr;
  if (a.target != nullptr && a.target[r] == a.ignore_index) {  // no loss, no gradient, no arithmetic
    if (a.row_loss) static_cast<M*>(a.row_loss)[r] = M(0);
    if (grad) fill(s, vocab, M(0));
    return;
  }
  const M inv_t = static_cast<M>(a.inv_temperature);
  const V it(inv_t);
  const V ninf(-std::numeric_limits<M>::infinity()), zero(M(0));

  // (1) maxima of s / T and t / T.
  V ms = ninf, mt = ninf;
  for (int64_t i = 0; i < vocab; i += W) {
    const int64_t n = std::min(W, vocab - i);
    ms = at::vec::maximum(ms, V::set(ninf, V::loadu(s + i, n) * it, n));
    mt = at::vec::maximum(mt, V::set(ninf, V::loadu(t + i, n) * it, n));
  }
  const M max_s = lanes_max(ms), max_t = lanes_max(mt);
  const V vms(max_s), vmt(max_t);
  // (2) sums of exp(z / T - max).
  V es = zero, et = zero;
  for (int64_t i = 0; i < vocab; i += W) {
    const int64_t n = std::min(W, vocab - i);
    es = es + V::set(zero, (V::loadu(s + i, n) * it - vms).exp(), n);
    et = et + V::set(zero, (V::loadu(t + i, n) * it - vmt).exp(), n);
  }
  const double lse_s = static_cast<double>(max_s) + std::log(lanes_sum(es));
  const double lse_t = static_cast<double>(max_t) + std::log(lanes_sum(et));
  const V vlse_s(static_cast<M>(lse_s)), vlse_t(static_cast<M>(lse_t));

  // g_ref: g at the first logit where s / T is the maximum.
  const double beta = a.beta;
  const V vbeta(static_cast<M>(beta)), vomb(static_cast<M>(1.0 - beta));
  V g_ref = zero;
  if (a.mode != 0) {
    int64_t arg = 0;
    while (arg + 1 < vocab && !(s[arg] * inv_t == max_s)) ++arg;
    V q, loss;
    terms(a.mode, V(s[arg]) * it - vlse_s, V(t[arg]) * it - vlse_t, vbeta, vomb, q, g_ref, loss);
  }

  // (3) the divergence; with a gradient, u = Q (g - g_ref) over s and Q over t.
  const double gw = grad ? static_cast<double>(static_cast<const M*>(a.grad_rows)[r * a.grad_rows_stride]) : 0.0;
  const V gscale(static_cast<M>(gw * a.inv_temperature));
  V vloss = zero, vu = zero;
  for (int64_t i = 0; i < vocab; i += W) {
    const int64_t n = std::min(W, vocab - i);
    const V lq = V::loadu(s + i, n) * it - vlse_s;
    const V lp = V::loadu(t + i, n) * it - vlse_t;
    if (a.mode == 0) {  // KL(P || Q) = sum P (log P - log Q); d / d s = (Q - P) / T
      const V p = lp.exp();
      vloss = vloss + V::set(zero, p * (lp - lq), n);
      if (grad) ((lq.exp() - p) * gscale).store(s + i, n);
      continue;
    }
    V q, g, loss;
    terms(a.mode, lq, lp, vbeta, vomb, q, g, loss);
    const V u = q * (g - g_ref);
    vloss = vloss + V::set(zero, loss, n);
    vu = vu + V::set(zero, u, n);
    if (grad) {
      u.store(s + i, n);
      q.store(t + i, n);
    }
  }
  if (a.row_loss) static_cast<M*>(a.row_loss)[r] = static_cast<M>(lanes_sum(vloss));
  if (!grad || a.mode == 0) return;

  // (4) d loss / d s = (u - Q sum(u)) / T, times the row's weight.
  const V vsum_u(static_cast<M>(lanes_sum(vu)));
  for (int64_t i = 0; i < vocab; i += W) {
    const int64_t n = std::min(W, vocab - i);
    ((V::loadu(s + i, n) - V::loadu(t + i, n) * vsum_u) * gscale).store(s + i, n);
  }
}

template <typename M>
void rows_typed(const CpuRowArgs& a) {
  const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(1, a.vocab));
  at::parallel_for(0, a.rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) row<M>(a, r);
  });
}

}  // namespace

void rows(const CpuRowArgs& a) {
  if (a.rows == 0) return;
  if (a.dtype == c10::kDouble) {
    rows_typed<double>(a);
  } else {
    TORCH_CHECK(a.dtype == c10::kFloat, "linear_jsd CPU row kernel: math type must be float32 or float64");
    rows_typed<float>(a);
  }
}

}  // namespace fuseforge::linear_jsd::FUSEFORGE_CPU_NS
