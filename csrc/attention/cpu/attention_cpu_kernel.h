// attention's CPU kernels, compiled once per CPU build (common/cpu_isa.h): FlashAttention-2 on tiles
// that stay in L1/L2, the arithmetic in M (float32, or float64 for float64 inputs) with
// at::vec::Vectorized<M>.
//
// Forward: one task per (batch, query head, block of kBlockQ queries); it walks the key tiles (kBlockK
// keys) that any of its rows may see, S = Q K^T, Z = scale S (or softcap tanh(scale S / softcap)),
// online softmax of Z (running row max m and sum l, the output accumulator rescaled when m grows),
// O += P V. The mask (attention_cpu.h: a window around the bottom-right diagonal, causal being
// window (-1, 0)) gives each row a range of keys [lo(i), hi(i)), both ends nondecreasing in i, so a
// block visits only the tiles of [lo(first row), hi(last row)): O(S w) work for a window of w keys,
// not O(S^2). lse = m + log l.
//
// Backward: one task per (batch, kv head, chunk of key blocks); for each key block it loops over the
// query heads of its group and the rows that see the block (a range, from both ends of the window),
// recomputes P = exp(Z - lse) and builds dS = P (dP - D) dZ/dS with D_i = rowsum(dO * O) and
// dZ/dS = scale (times 1 - tanh^2 with a softcap), accumulating dV += P^T dO and
// dK += dS^T Q in tile buffers (so dK, dV of a GQA group are summed in a fixed order, written once),
// and dQ += dS K into a per-chunk dQ buffer (or into grad_q itself when there is one chunk). The
// chunk count depends on the shape only, never on the thread count, so every result is bitwise
// the same for any number of threads, and no task writes what another writes (no atomics).
//
// Matrix products: a register-blocked micro-kernel (kMR rows x kNV vectors of C kept in registers,
// one broadcast of A and kNV loads of B a step). It takes A with any row and column stride, so the
// transposed operands P^T and dS^T are read in place; only K^T and V^T (the B operand of S and dP)
// are packed: the forward packs all of K^T once a call, the backward K^T and V^T once per key block.
// Chosen over ATen GEMMs on from_blob tiles (~5 us a call, about a 64 x 64 x 64 tile's arithmetic):
// at 2 threads it runs the demo's shape ~2.5x faster than SDPA's CPU flash kernel. 64 x 64 tiles
// measured best (64 x 128 and 32 x 64 were slower at the demo's shape or at S = 1024).
#pragma once
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attention/cpu/attention_cpu.h"
#include "common/cpu_vec.h"


namespace fuseforge::attention::FUSEFORGE_CPU_NS {
namespace {

template <typename M>
using Vec = at::vec::Vectorized<M>;

// Register block of the micro-kernel: kMR x kNV accumulators plus kNV B vectors and one broadcast
// within the register file (32 zmm with AVX-512, 16 ymm with AVX2).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kMR = 6, kNV = 4;
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int kMR = 6, kNV = 2;
#else
constexpr int kMR = 4, kNV = 2;
#endif

// Tile sizes: 64 x 64 float tiles (16 KB) keep S, P and the operands of a step in L1/L2.
constexpr int64_t kBlockQ = 64;
constexpr int64_t kBlockK = 64;
// Backward tasks wanted at least: fewer (batch x kv head) pairs than this split the keys into
// chunks (each with its own dQ buffer). A constant, not the thread count, so results do not depend
// on the number of threads.
constexpr int64_t kMinBackwardTasks = 8;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// C[MR x NV*W] (+)= A[MR x K] B[K x NV*W]; A(r, k) = a[r * rsa + k * csa], B(k, :) at b + k * ldb.
template <typename M, int MR, int NV>
inline void micro_kernel(int64_t kdim, const M* a, int64_t rsa, int64_t csa, const M* b, int64_t ldb, M* c,
                         int64_t ldc, bool accumulate) {
  using V = Vec<M>;
  constexpr int64_t W = V::size();
  V acc[MR][NV];
  if (accumulate) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = V::loadu(c + r * ldc + v * W);
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = V(M(0));
  }
  for (int64_t k = 0; k < kdim; ++k) {
    V bv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) bv[v] = V::loadu(b + k * ldb + v * W);
    const M* ak = a + k * csa;
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const V ar(ak[r * rsa]);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[r][v] = at::vec::fmadd(ar, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[r][v].store(c + r * ldc + v * W);
}

template <typename M, int MR>
inline void micro_kernel_nv(int nv, int64_t kdim, const M* a, int64_t rsa, int64_t csa, const M* b, int64_t ldb,
                            M* c, int64_t ldc, bool accumulate) {
  switch (nv) {
    case 1: return micro_kernel<M, MR, 1>(kdim, a, rsa, csa, b, ldb, c, ldc, accumulate);
    case 2: return micro_kernel<M, MR, (kNV >= 2 ? 2 : 1)>(kdim, a, rsa, csa, b, ldb, c, ldc, accumulate);
    case 3: return micro_kernel<M, MR, (kNV >= 3 ? 3 : 1)>(kdim, a, rsa, csa, b, ldb, c, ldc, accumulate);
    default: return micro_kernel<M, MR, (kNV >= 4 ? 4 : 1)>(kdim, a, rsa, csa, b, ldb, c, ldc, accumulate);
  }
}

// C[m x n] (+)= A[m x kdim] B[kdim x n]; n a multiple of the vector width (callers pad B and C).
// kdim == 0 with accumulate=false zeroes C.
template <typename M>
void gemm(int64_t m, int64_t n, int64_t kdim, const M* a, int64_t rsa, int64_t csa, const M* b, int64_t ldb, M* c,
          int64_t ldc, bool accumulate) {
  constexpr int64_t W = Vec<M>::size();
  for (int64_t j = 0; j < n; j += kNV * W) {
    const int nv = static_cast<int>(std::min<int64_t>(kNV, (n - j) / W));
    for (int64_t i = 0; i < m; i += kMR) {
      const int mr = static_cast<int>(std::min<int64_t>(kMR, m - i));
      const M* ai = a + i * rsa;
      M* ci = c + i * ldc + j;
      switch (mr) {
        case 1: micro_kernel_nv<M, 1>(nv, kdim, ai, rsa, csa, b + j, ldb, ci, ldc, accumulate); break;
        case 2: micro_kernel_nv<M, 2>(nv, kdim, ai, rsa, csa, b + j, ldb, ci, ldc, accumulate); break;
        case 3: micro_kernel_nv<M, 3>(nv, kdim, ai, rsa, csa, b + j, ldb, ci, ldc, accumulate); break;
        case 4: micro_kernel_nv<M, 4>(nv, kdim, ai, rsa, csa, b + j, ldb, ci, ldc, accumulate); break;
        case 5: micro_kernel_nv<M, (kMR >= 5 ? 5 : 1)>(nv, kdim, ai, rsa, csa, b + j, ldb, ci, ldc, accumulate); break;
        default: micro_kernel_nv<M, (kMR >= 6 ? 6 : 1)>(nv, kdim, ai, rsa, csa, b + j, ldb, ci, ldc, accumulate);
      }
    }
  }
}

template <typename M>
inline M reduce_max(const Vec<M>& x) {
  alignas(64) M t[Vec<M>::size()];
  x.store(t);
  M r = t[0];
  for (int64_t i = 1; i < Vec<M>::size(); ++i) r = t[i] > r ? t[i] : r;
  return r;
}

template <typename M>
inline M reduce_sum(const Vec<M>& x) {
  alignas(64) M t[Vec<M>::size()];
  x.store(t);
  M r = t[0];
  for (int64_t i = 1; i < Vec<M>::size(); ++i) r += t[i];
  return r;
}

// Rows [j0, j0 + jn) of a (S, D) operand as a (D x np) matrix (K^T, V^T), columns jn..np zero.
template <typename M>
void pack_transposed(const M* src, int64_t ld, int64_t jn, int64_t np, int64_t d, M* dst) {
  for (int64_t x = 0; x < d; ++x) {  // contiguous writes; the strided reads stay within jn rows (L1)
    M* out = dst + x * np;
    for (int64_t j = 0; j < jn; ++j) out[j] = src[j * ld + x];
    for (int64_t j = jn; j < np; ++j) out[j] = M(0);
  }
}

// rows x d rows of src (row stride ld) as a B operand with dp (a multiple of the vector width)
// columns: src itself when d == dp, else copied into buf with zero columns d..dp. Returns the row stride.
template <typename M>
const M* padded_rows(const M* src, int64_t ld, int64_t rows, int64_t d, int64_t dp, M* buf, int64_t& ld_out) {
  if (d == dp) {
    ld_out = ld;
    return src;
  }
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(buf + r * dp, src + r * ld, sizeof(M) * d);
    fill(buf + r * dp + d, dp - d, M(0));
  }
  ld_out = dp;
  return buf;
}

// The mask of attention_cpu.h as ranges: query row i sees keys [lo(i), hi(i)) and key j is seen by
// rows [row_begin(j), row_end(j + 1)); all four nondecreasing. An unbounded side (-1) or a bound past
// Sq + Sk becomes Sq + Sk, which masks nothing and keeps the sums far from overflow.
struct Window {
  int64_t sq, sk, off, left, right;
  Window(int64_t window_left, int64_t window_right, int64_t seqlen_q, int64_t seqlen_k)
      : sq(seqlen_q), sk(seqlen_k), off(seqlen_k - seqlen_q) {
    const int64_t wide = seqlen_q + seqlen_k;
    left = window_left < 0 || window_left > wide ? wide : window_left;
    right = window_right < 0 || window_right > wide ? wide : window_right;
  }
  int64_t lo(int64_t i) const { return std::clamp<int64_t>(i + off - left, 0, sk); }
  int64_t hi(int64_t i) const { return std::clamp<int64_t>(i + off + right + 1, 0, sk); }
  // Rows that see a key of [j0, j1) (j0 < j1): hi(i) > j0 and lo(i) < j1.
  int64_t row_begin(int64_t j0) const { return std::clamp<int64_t>(j0 - off - right, 0, sq); }
  int64_t row_end(int64_t j1) const { return std::clamp<int64_t>(j1 - off + left, 0, sq); }
};

// x where a <= c + lane < e, else fill (for the vectors at the ends of a row's visible range).
template <typename M>
inline Vec<M> keep_between(const Vec<M>& x, int64_t c, int64_t a, int64_t e, M fill) {
  using V = Vec<M>;
  const V idx = V::arange(M(c), M(1));
  const V keep = (idx >= V(M(a))) & (idx < V(M(e)));
  return V::blendv(V(fill), x, keep);
}

template <typename M, bool kSoftcap>
void forward_typed(const CpuForwardArgs& a) {
  using V = Vec<M>;
  constexpr int64_t W = V::size();
  const CpuShape& s = a.shape;
  const int64_t D = s.head_dim, Dp = round_up(D, W), Sq = s.seqlen_q, Sk = s.seqlen_k;
  const int64_t group = s.heads_q / s.heads_kv;
  const int64_t nqb = ceil_div(Sq, kBlockQ), tasks = s.batch * s.heads_q * nqb;
  const Window win(a.window_left, a.window_right, Sq, Sk);
  const M scale = static_cast<M>(a.scale);
  // Softcap: z = cap * tanh(s * (scale / cap)).
  const M cap = static_cast<M>(a.softcap), pre = kSoftcap ? static_cast<M>(a.scale / a.softcap) : M(0);
  const M neg_inf = -std::numeric_limits<M>::infinity();
  const M* q = static_cast<const M*>(a.q.ptr);
  const M* k = static_cast<const M*>(a.k.ptr);
  const M* v = static_cast<const M*>(a.v.ptr);
  M* out = static_cast<M*>(a.out.ptr);
  M* lse = static_cast<M*>(a.lse);
  const int64_t BKp = round_up(kBlockK, W);

  // K^T of every (batch, kv head), (D x Skp) each, columns Sk..Skp zero: packed once here rather than
  // once per query block (the transposes cost as much as a tenth of the tile products).
  const int64_t Skp = round_up(Sk, W), nkb = ceil_div(Sk, kBlockK);
  Buffer<M> kt_all(s.batch * s.heads_kv * D * Skp);
  at::parallel_for(0, s.batch * s.heads_kv * nkb, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t kb = t % nkb, bh = t / nkb, b = bh / s.heads_kv, hk = bh % s.heads_kv;
      const int64_t j0 = kb * kBlockK, jn = std::min(kBlockK, Sk - j0);
      M* dst = kt_all.data() + bh * D * Skp + j0;
      const M* src = k + b * a.k.sb + hk * a.k.sh + j0 * a.k.ss;
      // Contiguous writes; the strided reads stay within the tile's 64 rows (L1).
      for (int64_t x = 0; x < D; ++x)
        for (int64_t j = 0; j < jn; ++j) dst[x * Skp + j] = src[j * a.k.ss + x];
      if (kb == nkb - 1)
        for (int64_t x = 0; x < D; ++x) fill(dst + x * Skp + jn, Skp - j0 - jn, M(0));
    }
  });

  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    Buffer<M> sbuf(kBlockQ * BKp), oacc(kBlockQ * Dp), vbuf(D == Dp ? 0 : kBlockK * Dp);
    M m_row[kBlockQ], l_row[kBlockQ];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t qb = t % nqb, h = (t / nqb) % s.heads_q, b = t / (nqb * s.heads_q), hk = h / group;
      const int64_t r0 = qb * kBlockQ, rn = std::min(kBlockQ, Sq - r0);
      const M* qp = q + b * a.q.sb + h * a.q.sh + r0 * a.q.ss;
      const M* ktp = kt_all.data() + (b * s.heads_kv + hk) * D * Skp;
      const M* vp = v + b * a.v.sb + hk * a.v.sh;
      // Keys any row of the block sees: [kbegin, kend), the tiles starting at kbegin rounded down to
      // the vector width.
      const int64_t kbegin = win.lo(r0) / W * W, kend = win.hi(r0 + rn - 1);
      fill(m_row, rn, neg_inf);
      fill(l_row, rn, M(0));
      fill(oacc.data(), rn * Dp, M(0));
      for (int64_t j0 = kbegin; j0 < kend; j0 += kBlockK) {
        const int64_t jn = std::min(kBlockK, kend - j0), np = round_up(jn, W);
        gemm<M>(rn, np, D, qp, a.q.ss, 1, ktp + j0, Skp, sbuf.data(), np, false);
        for (int64_t r = 0; r < rn; ++r) {
          M* row = sbuf.data() + r * np;
          // Columns [ka, ke) of the tile are visible to this row; vectors [ca, ce) hold them.
          const int64_t ka = std::clamp<int64_t>(win.lo(r0 + r) - j0, 0, jn);
          const int64_t ke = std::clamp<int64_t>(win.hi(r0 + r) - j0, 0, jn);
          if (ka >= ke) {  // this tile adds nothing to the row
            fill(row, np, M(0));
            continue;
          }
          const int64_t ca = ka / W * W, ce = round_up(ke, W);
          V mx(neg_inf);
          for (int64_t c = ca; c < ce; c += W) {
            V x;
            if constexpr (kSoftcap) x = (V::loadu(row + c) * V(pre)).tanh() * V(cap);
            else x = V::loadu(row + c) * V(scale);
            if (c < ka || c + W > ke) x = keep_between(x, c, ka, ke, neg_inf);
            x.store(row + c);
            mx = at::vec::maximum(mx, x);
          }
          const M tile_max = reduce_max(mx), m_new = tile_max > m_row[r] ? tile_max : m_row[r];
          // 0 while the row had seen nothing; the max seldom grows after the first tiles (skip the exp)
          const M alpha = m_new == m_row[r] ? M(1) : std::exp(m_row[r] - m_new);
          V sum(M(0));
          const V mv(m_new);
          for (int64_t c = ca; c < ce; c += W) {
            const V p = (V::loadu(row + c) - mv).exp_u20();  // exp(-inf) = 0 on masked columns
            p.store(row + c);
            sum = sum + p;
          }
          fill(row, ca, M(0));
          fill(row + ce, np - ce, M(0));
          l_row[r] = l_row[r] * alpha + reduce_sum(sum);
          m_row[r] = m_new;
          if (alpha != M(1)) {
            M* o = oacc.data() + r * Dp;
            for (int64_t c = 0; c < Dp; c += W) (V::loadu(o + c) * V(alpha)).store(o + c);
          }
        }
        int64_t ldv = 0;
        const M* vb = padded_rows(vp + j0 * a.v.ss, a.v.ss, jn, D, Dp, vbuf.data(), ldv);
        gemm<M>(rn, Dp, jn, sbuf.data(), np, 1, vb, ldv, oacc.data(), Dp, true);
      }
      M* op = out + b * a.out.sb + h * a.out.sh + r0 * a.out.ss;
      M* lp = lse + b * a.lse_sb + h * a.lse_sh + r0 * a.lse_ss;
      for (int64_t r = 0; r < rn; ++r) {
        M* orow = op + r * a.out.ss;
        if (l_row[r] > M(0)) {
          const V inv(M(1) / l_row[r]);
          const M* o = oacc.data() + r * Dp;
          for (int64_t c = 0; c < D; c += W) (V::loadu(o + c) * inv).store(orow + c, std::min<int64_t>(W, D - c));
          lp[r * a.lse_ss] = m_row[r] + std::log(l_row[r]);
        } else {  // no key visible: zeros, lse -inf
          fill(orow, D, M(0));
          lp[r * a.lse_ss] = neg_inf;
        }
      }
    }
  });
}

template <typename M, bool kSoftcap>
void backward_typed(const CpuBackwardArgs& a) {
  using V = Vec<M>;
  constexpr int64_t W = V::size();
  const CpuShape& s = a.shape;
  const int64_t B = s.batch, Hq = s.heads_q, Hk = s.heads_kv, Sq = s.seqlen_q, Sk = s.seqlen_k;
  const int64_t D = s.head_dim, Dp = round_up(D, W), group = Hq / Hk;
  const Window win(a.window_left, a.window_right, Sq, Sk);
  const M scale = static_cast<M>(a.scale);
  const M cap = static_cast<M>(a.softcap), pre = kSoftcap ? static_cast<M>(a.scale / a.softcap) : M(0);
  const M neg_inf = -std::numeric_limits<M>::infinity();
  const M* q = static_cast<const M*>(a.q.ptr);
  const M* k = static_cast<const M*>(a.k.ptr);
  const M* v = static_cast<const M*>(a.v.ptr);
  const M* go = static_cast<const M*>(a.grad_out.ptr);
  const M* o = static_cast<const M*>(a.out.ptr);
  const M* lse = static_cast<const M*>(a.lse);
  M* gq = static_cast<M*>(a.grad_q.ptr);
  M* gk = static_cast<M*>(a.grad_k.ptr);
  M* gv = static_cast<M*>(a.grad_v.ptr);

  // D_i = sum_d dO * O (= sum_j P dP), contiguous (B, Hq, Sq).
  const int64_t rows = B * Hq * Sq;
  Buffer<M> delta(rows);
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / D), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i % Sq, h = (i / Sq) % Hq, b = i / (Sq * Hq);
      const M* g = go + b * a.grad_out.sb + h * a.grad_out.sh + r * a.grad_out.ss;
      const M* x = o + b * a.out.sb + h * a.out.sh + r * a.out.ss;
      V acc(M(0));
      int64_t c = 0;
      for (; c + W <= D; c += W) acc = at::vec::fmadd(V::loadu(g + c), V::loadu(x + c), acc);
      M sum = reduce_sum(acc);
      for (; c < D; ++c) sum += g[c] * x[c];
      delta.data()[i] = sum;
    }
  });

  const int64_t nkb = ceil_div(Sk, kBlockK);
  const int64_t pairs = B * Hk;
  int64_t chunks = std::clamp<int64_t>(ceil_div(kMinBackwardTasks, pairs), 1, nkb);
  const int64_t blocks_per_chunk = ceil_div(nkb, chunks);
  chunks = ceil_div(nkb, blocks_per_chunk);
  // dQ straight into grad_q when one task owns each of its rows and rows need no padding.
  const bool direct_dq = chunks == 1 && D == Dp;
  Buffer<M> dq_buf(direct_dq ? 0 : chunks * rows * Dp);  // zero-initialised
  const int64_t BKp = round_up(kBlockK, W);

  at::parallel_for(0, pairs * chunks, 1, [&](int64_t t0, int64_t t1) {
    Buffer<M> kt(D * BKp), vt(D * BKp), pbuf(kBlockQ * BKp), dsbuf(kBlockQ * BKp);
    Buffer<M> dk(kBlockK * Dp), dv(kBlockK * Dp);
    Buffer<M> kpad(D == Dp ? 0 : kBlockK * Dp), qpad(D == Dp ? 0 : kBlockQ * Dp), gpad(D == Dp ? 0 : kBlockQ * Dp);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c = t % chunks, hk = (t / chunks) % Hk, b = t / (chunks * Hk);
      if (direct_dq) {  // this task owns these rows of grad_q
        for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
          for (int64_t r = 0; r < Sq; ++r) fill(gq + b * a.grad_q.sb + h * a.grad_q.sh + r * a.grad_q.ss, D, M(0));
      }
      const M* kp = k + b * a.k.sb + hk * a.k.sh;
      const M* vp = v + b * a.v.sb + hk * a.v.sh;
      const int64_t kb_end = std::min(nkb, (c + 1) * blocks_per_chunk);
      for (int64_t kb = c * blocks_per_chunk; kb < kb_end; ++kb) {
        const int64_t j0 = kb * kBlockK, jn = std::min(kBlockK, Sk - j0), np = round_up(jn, W);
        pack_transposed(kp + j0 * a.k.ss, a.k.ss, jn, np, D, kt.data());
        pack_transposed(vp + j0 * a.v.ss, a.v.ss, jn, np, D, vt.data());
        int64_t ldk = 0;
        const M* kb_rows = padded_rows(kp + j0 * a.k.ss, a.k.ss, jn, D, Dp, kpad.data(), ldk);
        fill(dk.data(), jn * Dp, M(0));
        fill(dv.data(), jn * Dp, M(0));
        // Query rows that see a key of the block: [rbegin, rend), in blocks of kBlockQ from rbegin.
        const int64_t rbegin = win.row_begin(j0), rend = win.row_end(j0 + jn);
        for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
          for (int64_t r0 = rbegin; r0 < rend; r0 += kBlockQ) {
            const int64_t rn = std::min(kBlockQ, rend - r0);
            const M* qp = q + b * a.q.sb + h * a.q.sh + r0 * a.q.ss;
            const M* gp = go + b * a.grad_out.sb + h * a.grad_out.sh + r0 * a.grad_out.ss;
            const M* lp = lse + b * a.lse_sb + h * a.lse_sh + r0 * a.lse_ss;
            const M* dp_row = delta.data() + (b * Hq + h) * Sq + r0;
            // P = exp(Z - lse), zero where masked or where the row sees nothing.
            gemm<M>(rn, np, D, qp, a.q.ss, 1, kt.data(), np, pbuf.data(), np, false);
            gemm<M>(rn, np, D, gp, a.grad_out.ss, 1, vt.data(), np, dsbuf.data(), np, false);  // dP
            for (int64_t r = 0; r < rn; ++r) {
              M* prow = pbuf.data() + r * np;
              M* dsrow = dsbuf.data() + r * np;
              const M l = lp[r * a.lse_ss];
              // Columns [ka, ke) of the tile are visible to this row; vectors [ca, ce) hold them.
              const int64_t ka = std::clamp<int64_t>(win.lo(r0 + r) - j0, 0, jn);
              const int64_t ke = std::clamp<int64_t>(win.hi(r0 + r) - j0, 0, jn);
              if (l == neg_inf || ka >= ke) {
                fill(prow, np, M(0));
                fill(dsrow, np, M(0));
                continue;
              }
              const int64_t ca = ka / W * W, ce = round_up(ke, W);
              const V lv(l), sv(scale), di(dp_row[r]);
              for (int64_t cc = ca; cc < ce; cc += W) {
                // dS = P (dP - D_i) dZ/dS (folded in here, so dQ and dK need no scale).
                V p, dzds;
                if constexpr (kSoftcap) {
                  const V t = (V::loadu(prow + cc) * V(pre)).tanh();
                  p = at::vec::fmsub(t, V(cap), lv).exp_u20();
                  dzds = sv - sv * t * t;
                } else {
                  p = at::vec::fmsub(V::loadu(prow + cc), sv, lv).exp_u20();
                  dzds = sv;
                }
                if (cc < ka || cc + W > ke) p = keep_between(p, cc, ka, ke, M(0));
                p.store(prow + cc);
                (p * (V::loadu(dsrow + cc) - di) * dzds).store(dsrow + cc);
              }
              fill(prow, ca, M(0));
              fill(prow + ce, np - ce, M(0));
              fill(dsrow, ca, M(0));
              fill(dsrow + ce, np - ce, M(0));
            }
            int64_t ldq = 0, ldg = 0;
            const M* q_rows = padded_rows(qp, a.q.ss, rn, D, Dp, qpad.data(), ldq);
            const M* g_rows = padded_rows(gp, a.grad_out.ss, rn, D, Dp, gpad.data(), ldg);
            gemm<M>(jn, Dp, rn, pbuf.data(), 1, np, g_rows, ldg, dv.data(), Dp, true);   // dV += P^T dO
            gemm<M>(jn, Dp, rn, dsbuf.data(), 1, np, q_rows, ldq, dk.data(), Dp, true);  // dK += dS^T Q
            if (direct_dq) {
              M* gqp = gq + b * a.grad_q.sb + h * a.grad_q.sh + r0 * a.grad_q.ss;
              gemm<M>(rn, Dp, jn, dsbuf.data(), np, 1, kb_rows, ldk, gqp, a.grad_q.ss, true);  // dQ += dS K
            } else {
              M* acc = dq_buf.data() + ((c * B + b) * Hq + h) * Sq * Dp + r0 * Dp;
              gemm<M>(rn, Dp, jn, dsbuf.data(), np, 1, kb_rows, ldk, acc, Dp, true);
            }
          }
        }
        M* gkp = gk + b * a.grad_k.sb + hk * a.grad_k.sh + j0 * a.grad_k.ss;
        M* gvp = gv + b * a.grad_v.sb + hk * a.grad_v.sh + j0 * a.grad_v.ss;
        for (int64_t j = 0; j < jn; ++j) {
          std::memcpy(gkp + j * a.grad_k.ss, dk.data() + j * Dp, sizeof(M) * D);
          std::memcpy(gvp + j * a.grad_v.ss, dv.data() + j * Dp, sizeof(M) * D);
        }
      }
    }
  });

  if (!direct_dq) {  // grad_q = the sum of the chunks' dQ, in chunk order
    at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / Dp), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t r = i % Sq, h = (i / Sq) % Hq, b = i / (Sq * Hq);
        M* dst = gq + b * a.grad_q.sb + h * a.grad_q.sh + r * a.grad_q.ss;
        for (int64_t cc = 0; cc < Dp; cc += W) {
          V acc = V::loadu(dq_buf.data() + i * Dp + cc);
          for (int64_t ch = 1; ch < chunks; ++ch) acc = acc + V::loadu(dq_buf.data() + (ch * rows + i) * Dp + cc);
          acc.store(dst + cc, std::min<int64_t>(W, D - cc));
        }
      }
    });
  }
}

}  // namespace

void forward(const CpuForwardArgs& a) {
  const CpuShape& s = a.shape;
  if (s.batch == 0 || s.heads_q == 0 || s.seqlen_q == 0) return;
  TORCH_CHECK(s.seqlen_k > 0 && s.heads_kv > 0, "attention CPU forward: called with no keys");
  const bool softcap = a.softcap > 0.0;
  if (a.dtype == c10::ScalarType::Double) {
    softcap ? forward_typed<double, true>(a) : forward_typed<double, false>(a);
  } else {
    TORCH_CHECK(a.dtype == c10::ScalarType::Float, "attention CPU kernels take float32 or float64, got ", a.dtype);
    softcap ? forward_typed<float, true>(a) : forward_typed<float, false>(a);
  }
}

void backward(const CpuBackwardArgs& a) {
  const CpuShape& s = a.shape;
  if (s.batch == 0 || s.heads_kv == 0 || s.seqlen_k == 0) return;
  const bool softcap = a.softcap > 0.0;
  if (a.dtype == c10::ScalarType::Double) {
    softcap ? backward_typed<double, true>(a) : backward_typed<double, false>(a);
  } else {
    TORCH_CHECK(a.dtype == c10::ScalarType::Float, "attention CPU kernels take float32 or float64, got ", a.dtype);
    softcap ? backward_typed<float, true>(a) : backward_typed<float, false>(a);
  }
}

}  // namespace fuseforge::attention::FUSEFORGE_CPU_NS
