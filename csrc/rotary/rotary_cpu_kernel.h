// rotary's vectorized CPU kernel, compiled once per CPU build (common/cpu_isa.h). Tokens are split
// across threads; a token's cos/sin table (R / 2 entries) serves all its q and k heads. The angle is
// one float32 multiply, as Hugging Face's position_ids.float() * inv_freq. The rotation is in the
// math type M (float; double for float64 inputs) with at::vec::Vectorized<M>, each output
// x1 * cos - x2 * sin (no fma: -ffp-contract=off), as the scalar reference; interleaved pairs are
// split into even and odd vectors (deinterleave2) and joined back after.
#pragma once
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "common/cpu_vec.h"
#include "common/cpu_vec_tile.h"
#include "rotary/rotary_cpu.h"

namespace fuseforge::rotary::FUSEFORGE_CPU_NS {
namespace {

template <typename M>
using Vec = CpuVec<M>;

// Positions of the table entries f..f+n at angle pos * inv_freq[f]: cos * scaling and
// sin * sin_scaling. float on AVX2/AVX-512: SLEEF's sincos (1 ulp; torch's own cos/sin of the
// eager rope are SLEEF's too); otherwise (float64, the baseline build) libm's in double.
template <typename M>
void cos_sin_table(float pos, const float* inv_freq, int64_t n, double scaling, double sin_scaling, M* cos_tab,
                   M* sin_tab) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<M, float>) {
    using V = Vec<float>;
    constexpr int64_t W = V::size();
    const V p(pos), cs(static_cast<float>(scaling)), ss(static_cast<float>(sin_scaling));
    for (int64_t f = 0; f < n; f += W) {
      const int64_t k = std::min<int64_t>(V::size(), n - f);
      const V angle = p * V::loadu(inv_freq + f, k);
#if defined(CPU_CAPABILITY_AVX512)
      const Sleef___m512_2 sc = Sleef_sincosf16_u10(static_cast<__m512>(angle));
#else
      const Sleef___m256_2 sc = Sleef_sincosf8_u10(static_cast<__m256>(angle));
#endif
      (V(sc.y) * cs).store(cos_tab + f, k);
      (V(sc.x) * ss).store(sin_tab + f, k);
    }
    return;
  }
#endif
  for (int64_t f = 0; f < n; ++f) {
    const double angle = static_cast<double>(pos * inv_freq[f]);
    cos_tab[f] = static_cast<M>(std::cos(angle) * scaling);
    sin_tab[f] = static_cast<M>(std::sin(angle) * sin_scaling);
  }
}

// One head of D values in M: the R rotary dims from the tables, dims R..D-1 copied.
template <typename M>
void rotate_head(const M* x, M* y, const M* cos_tab, const M* sin_tab, int64_t rot_half, int64_t head_dim,
                 bool interleaved) {
  using V = Vec<M>;
  constexpr int64_t W = V::size();
  int64_t i = 0;
  if (interleaved) {
    for (; i + W <= rot_half; i += W) {
      const auto [x1, x2] = at::vec::deinterleave2(V::loadu(x + 2 * i), V::loadu(x + 2 * i + W));
      const V c = V::loadu(cos_tab + i), s = V::loadu(sin_tab + i);
      const auto [lo, hi] = at::vec::interleave2(V(x1 * c - x2 * s), V(x2 * c + x1 * s));
      lo.store(y + 2 * i);
      hi.store(y + 2 * i + W);
    }
    for (; i < rot_half; ++i) {
      const M x1 = x[2 * i], x2 = x[2 * i + 1];
      y[2 * i] = x1 * cos_tab[i] - x2 * sin_tab[i];
      y[2 * i + 1] = x2 * cos_tab[i] + x1 * sin_tab[i];
    }
  } else {
    for (; i < rot_half; i += W) {
      const int64_t k = std::min<int64_t>(V::size(), rot_half - i);
      const V x1 = V::loadu(x + i, k), x2 = V::loadu(x + rot_half + i, k);
      const V c = V::loadu(cos_tab + i, k), s = V::loadu(sin_tab + i, k);
      (x1 * c - x2 * s).store(y + i, k);
      (x2 * c + x1 * s).store(y + rot_half + i, k);
    }
  }
  for (int64_t d = 2 * rot_half; d < head_dim; ++d) y[d] = x[d];
}

template <typename Tin, typename Tout>
void rotate_typed(const CpuArgs& a) {
  // float64 inputs (gradcheck) compute in float64, the others in float32.
  using M = std::conditional_t<std::is_same_v<Tin, double>, double, float>;
  const Tin* q = static_cast<const Tin*>(a.q);
  const Tin* k = static_cast<const Tin*>(a.k);
  Tout* qo = static_cast<Tout*>(a.q_out);
  Tout* ko = static_cast<Tout*>(a.k_out);
  const double sin_scaling = a.inverse ? -a.scaling : a.scaling;
  const int64_t per_token = std::max<int64_t>(1, (a.heads_q + a.heads_k) * a.head_dim);
  at::parallel_for(0, a.batch * a.seq, std::max<int64_t>(1, 32768 / per_token), [&](int64_t begin, int64_t end) {
    Buffer<M> cos_tab(a.rot_half), sin_tab(a.rot_half), xbuf(a.head_dim), ybuf(a.head_dim);
    for (int64_t token = begin; token < end; ++token) {
      const int64_t b = token / a.seq, s = token % a.seq;
      const int64_t pos_offset = b * a.pos_stride_b + s * a.pos_stride_s;
      const int64_t pos_int = a.positions_int64 ? static_cast<const int64_t*>(a.positions)[pos_offset]
                                                : static_cast<const int32_t*>(a.positions)[pos_offset];
      cos_sin_table(static_cast<float>(pos_int), a.inv_freq, a.rot_half, a.scaling, sin_scaling, cos_tab.data(),
                    sin_tab.data());
      auto heads = [&](const Tin* src, const int64_t* stride, int64_t n_heads, Tout* dst) {
        for (int64_t h = 0; h < n_heads; ++h) {
          const M* x = tile_to_math(src + b * stride[0] + h * stride[1] + s * stride[2], xbuf.data(), a.head_dim);
          Tout* y_dst = dst + (token * n_heads + h) * a.head_dim;
          M* y = math_dst(y_dst, ybuf.data());
          rotate_head(x, y, cos_tab.data(), sin_tab.data(), a.rot_half, a.head_dim, a.interleaved);
          tile_from_math(y, y_dst, a.head_dim);
        }
      };
      heads(q, a.q_stride, a.heads_q, qo);
      heads(k, a.k_stride, a.heads_k, ko);
    }
  });
}

}  // namespace

void rotate(const CpuArgs& a) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.dtype, "rotary_cpu", [&] {
    using in_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.out_dtype, "rotary_cpu_out",
                                    [&] { rotate_typed<in_t, scalar_t>(a); });
  });
}

}  // namespace fuseforge::rotary::FUSEFORGE_CPU_NS
