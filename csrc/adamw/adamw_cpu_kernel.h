// AdamW's CPU update on vectors (adamw_cpu.h), compiled once per CPU build (common/cpu_isa.h). The
// AVX2/AVX-512 builds compute adamw_element's CPU form with at::vec (each operation IEEE-rounded
// and the three fmas fused, so the result is the scalar path's, bit for bit); the baseline build
// runs adamw_element itself (at::vec's baseline fmadd is not fused).
//
// The work goes in tiles of kCpuTile elements. Compact states (adamw_lowbit.h) are decoded into
// float buffers for the tile's update and encoded back after it: bfloat16 with stochastic rounding,
// int8 with each 256-element block's new absmax and then its codes. Those conversions are scalar
// loops (the compiler vectorizes some); the update between them is the float32 states' one.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>

#include "adamw/adamw_cpu.h"
#include "adamw/adamw_lowbit.h"
#include "common/cpu_vec.h"

namespace fuseforge::adamw::FUSEFORGE_CPU_NS {
namespace {

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
constexpr bool kVectorPath = true;
#else
constexpr bool kVectorPath = false;
#endif

static_assert(kCpuTile % kQuantBlock == 0, "a tile holds whole int8 blocks");

// The update of cn elements held as floats (p, g, m, v, vmax updated in place; vmax only with amsgrad).
template <bool kAmsgrad>
void update_tile(float* p, float* g, float* m, float* v, float* vmax, int64_t cn, const StepScalars<float>& s) {
  if constexpr (!kVectorPath) {
    for (int64_t i = 0; i < cn; ++i) {
      float vm = kAmsgrad ? vmax[i] : 0.f;
      adamw_element<float, kAmsgrad>(p[i], g[i], m[i], v[i], vm, s);
      if constexpr (kAmsgrad) vmax[i] = vm;
    }
  } else {
    using V = CpuVec<float>;
    constexpr int64_t W = V::size();
    const V neg_lr_wd(s.neg_lr_wd), omb1(s.one_minus_beta1), omb2(s.one_minus_beta2), eps(s.eps);
    const V step_size(s.step_size), bc2_sqrt(s.bc2_sqrt), grad_scale(s.grad_scale);
    for (int64_t i = 0; i < cn; i += W) {
      const int64_t k = std::min(W, cn - i);
      V gv = V::loadu(g + i, k);
      if (s.unscale) {
        gv = gv / grad_scale;
        gv.store(g + i, k);
      }
      const V d = s.maximize ? gv.neg() : gv;
      V pv = V::loadu(p + i, k);
      pv = at::vec::fmadd(neg_lr_wd, pv, pv);
      V mv = V::loadu(m + i, k), vv = V::loadu(v + i, k);
      mv = at::vec::fmadd(omb1, d - mv, mv);
      vv = at::vec::fmadd(omb2, d * d - vv, vv);
      V second = vv;
      if constexpr (kAmsgrad) {
        const V old = V::loadu(vmax + i, k);
        second = V::blendv(vv, old, old > vv);  // vmax > v ? vmax : v, as the scalar form
        second.store(vmax + i, k);
      }
      const V denom = second.sqrt() / bc2_sqrt + eps;
      pv = pv - (step_size * mv) / denom;
      pv.store(p + i, k);
      mv.store(m + i, k);
      vv.store(v + i, k);
    }
  }
}

// int8 moments of elements [at, at + cn) (at a multiple of kQuantBlock) to floats and back.
void decode_int8(const TensorMeta& t, int64_t at, int64_t cn, float* m, float* v) {
  const auto* mq = static_cast<const uint8_t*>(t.exp_avg) + at;
  const auto* vq = static_cast<const uint8_t*>(t.exp_avg_sq) + at;
  for (int64_t q0 = 0; q0 < cn; q0 += kQuantBlock) {
    const int64_t qn = std::min(kQuantBlock, cn - q0), block = (at + q0) / kQuantBlock;
    const float ms = decode_scale<ExpAvgCode>(t.exp_avg_absmax[block]);
    const float vs = decode_scale<ExpAvgSqCode>(t.exp_avg_sq_absmax[block]);
    for (int64_t i = q0; i < q0 + qn; ++i) {
      m[i] = decode_exp_avg(mq[i], ms);
      v[i] = decode_exp_avg_sq(vq[i], vs);
    }
  }
}

void encode_int8(const TensorMeta& t, int64_t at, int64_t cn, const float* m, const float* v) {
  auto* mq = static_cast<uint8_t*>(t.exp_avg) + at;
  auto* vq = static_cast<uint8_t*>(t.exp_avg_sq) + at;
  for (int64_t q0 = 0; q0 < cn; q0 += kQuantBlock) {
    const int64_t qn = std::min(kQuantBlock, cn - q0), block = (at + q0) / kQuantBlock;
    uint32_t m_key = 0, v_key = 0;
    for (int64_t i = q0; i < q0 + qn; ++i) {
      m_key = std::max(m_key, magnitude_key(m[i]));
      v_key = std::max(v_key, magnitude_key(v[i]));
    }
    const float m_max = bits_float(m_key), v_max = bits_float(v_key);
    t.exp_avg_absmax[block] = m_max;
    t.exp_avg_sq_absmax[block] = v_max;
    const float ms = encode_scale<ExpAvgCode>(m_max), vs = encode_scale<ExpAvgSqCode>(v_max);
    for (int64_t i = q0; i < q0 + qn; ++i) {
      mq[i] = encode_exp_avg(m[i], ms);
      vq[i] = encode_exp_avg_sq(v[i], vs);
    }
  }
}

void decode_bf16(const void* src, int64_t at, int64_t cn, float* dst) {
  const auto* b = static_cast<const uint16_t*>(src) + at;
  for (int64_t i = 0; i < cn; ++i) dst[i] = bf16_bits_to_float(b[i]);
}

// exp_avg takes the high 16 bits of an element's random word, exp_avg_sq (and max_exp_avg_sq, so
// that it stays equal to exp_avg_sq where it took its value) the low 16.
template <bool kAmsgrad>
void encode_bf16(const TensorMeta& t, int64_t at, int64_t cn, const float* m, const float* v, const float* vmax,
                 uint32_t step) {
  auto* mb = static_cast<uint16_t*>(t.exp_avg) + at;
  auto* vb = static_cast<uint16_t*>(t.exp_avg_sq) + at;
  auto* xb = kAmsgrad ? static_cast<uint16_t*>(t.max_exp_avg_sq) + at : nullptr;
  for (int64_t i = 0; i < cn; ++i) {
    const uint32_t r = rounding_bits(static_cast<uint64_t>(at + i), step);
    mb[i] = float_to_bf16_stochastic(m[i], r >> 16);
    vb[i] = float_to_bf16_stochastic(v[i], r);
    if constexpr (kAmsgrad) xb[i] = float_to_bf16_stochastic(vmax[i], r);
  }
}

template <typename T, StateFormat kFormat, bool kMaster, bool kAmsgrad>
void update_typed(const TensorMeta& t, T* grad, int64_t begin, int64_t n, const StepScalars<float>& s) {
  T* param = static_cast<T*>(t.param) + begin;
  T* g_ptr = grad + begin;
  float* master = kMaster ? static_cast<float*>(t.master) + begin : nullptr;
  alignas(64) float pb[kCpuTile], gb[kCpuTile], mb[kCpuTile], vb[kCpuTile], xb[kCpuTile];
  for (int64_t c0 = 0; c0 < n; c0 += kCpuTile) {
    const int64_t cn = std::min(kCpuTile, n - c0);
    const int64_t at = begin + c0;  // the tile's first element in the tensor
    float* p = kMaster ? master + c0 : math_dst(param + c0, pb);
    if constexpr (!kMaster) as_math(param + c0, pb, cn);  // no copy for float32 (p is param)
    float* g = math_dst(g_ptr + c0, gb);
    as_math(g_ptr + c0, gb, cn);
    float *m = mb, *v = vb, *vmax = xb;
    if constexpr (kFormat == StateFormat::kFull) {
      m = static_cast<float*>(t.exp_avg) + at;
      v = static_cast<float*>(t.exp_avg_sq) + at;
      if constexpr (kAmsgrad) vmax = static_cast<float*>(t.max_exp_avg_sq) + at;
    } else if constexpr (kFormat == StateFormat::kBFloat16) {
      decode_bf16(t.exp_avg, at, cn, mb);
      decode_bf16(t.exp_avg_sq, at, cn, vb);
      if constexpr (kAmsgrad) decode_bf16(t.max_exp_avg_sq, at, cn, xb);
    } else {
      decode_int8(t, at, cn, mb, vb);
    }
    update_tile<kAmsgrad>(p, g, m, v, vmax, cn, s);
    if constexpr (kFormat == StateFormat::kBFloat16) encode_bf16<kAmsgrad>(t, at, cn, mb, vb, xb, s.step_index);
    if constexpr (kFormat == StateFormat::kInt8) encode_int8(t, at, cn, mb, vb);
    store_math(p, param + c0, cn);  // float16/bfloat16: the param rounded from p (or the master)
    if (s.unscale) store_math(g, g_ptr + c0, cn);
  }
}

template <typename T, StateFormat kFormat>
void update_format(const TensorMeta& t, T* g, int64_t begin, int64_t n, const StepScalars<float>& s) {
  const bool master = t.master != nullptr;
  if constexpr (kFormat == StateFormat::kInt8) {  // no amsgrad with int8 states (rejected by the host)
    if (master) update_typed<T, kFormat, true, false>(t, g, begin, n, s);
    else update_typed<T, kFormat, false, false>(t, g, begin, n, s);
  } else {
    const bool amsgrad = t.max_exp_avg_sq != nullptr;
    if (master) {
      if (amsgrad) update_typed<T, kFormat, true, true>(t, g, begin, n, s);
      else update_typed<T, kFormat, true, false>(t, g, begin, n, s);
    } else {
      if (amsgrad) update_typed<T, kFormat, false, true>(t, g, begin, n, s);
      else update_typed<T, kFormat, false, false>(t, g, begin, n, s);
    }
  }
}

template <typename T>
void update_dtype(const TensorMeta& t, void* grad, int64_t begin, int64_t n, const StepScalars<float>& s) {
  T* g = static_cast<T*>(grad);
  switch (static_cast<StateFormat>(t.state_format)) {
    case StateFormat::kBFloat16: update_format<T, StateFormat::kBFloat16>(t, g, begin, n, s); break;
    case StateFormat::kInt8: update_format<T, StateFormat::kInt8>(t, g, begin, n, s); break;
    default: update_format<T, StateFormat::kFull>(t, g, begin, n, s); break;
  }
}

}  // namespace

void update_chunk(const TensorMeta& t, void* grad, int64_t begin, int64_t n, const StepScalars<float>& s) {
  switch (static_cast<ParamDtype>(t.dtype)) {
    case ParamDtype::kHalf: update_dtype<c10::Half>(t, grad, begin, n, s); break;
    case ParamDtype::kBFloat16: update_dtype<c10::BFloat16>(t, grad, begin, n, s); break;
    default: update_dtype<float>(t, grad, begin, n, s); break;
  }
}

}  // namespace fuseforge::adamw::FUSEFORGE_CPU_NS
