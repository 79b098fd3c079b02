// AdamW's CPU update on vectors (adamw_cpu.h), compiled once per CPU build (common/cpu_isa.h). The
// AVX2/AVX-512 builds compute adamw_element's CPU form with at::vec (each operation IEEE-rounded
// and the three fmas fused, so the result is the scalar path's, bit for bit); the baseline build
// runs adamw_element itself (at::vec's baseline fmadd is not fused).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>

#include "adamw/adamw_cpu.h"
#include "common/cpu_vec.h"

namespace fuseforge::adamw::FUSEFORGE_CPU_NS {
namespace {

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
constexpr bool kVectorPath = true;
#else
constexpr bool kVectorPath = false;
#endif

template <typename T, bool kMaster, bool kAmsgrad>
void update_typed(const TensorMeta& t, T* grad, int64_t begin, int64_t n, const StepScalars<float>& s) {
  T* param = static_cast<T*>(t.param) + begin;
  T* g_ptr = grad + begin;
  float* m_ptr = static_cast<float*>(t.exp_avg) + begin;
  float* v_ptr = static_cast<float*>(t.exp_avg_sq) + begin;
  float* vmax_ptr = kAmsgrad ? static_cast<float*>(t.max_exp_avg_sq) + begin : nullptr;
  float* master = kMaster ? static_cast<float*>(t.master) + begin : nullptr;
  if constexpr (!kVectorPath) {
    for (int64_t i = 0; i < n; ++i) {
      float p = kMaster ? master[i] : static_cast<float>(param[i]);
      float g = static_cast<float>(g_ptr[i]);
      float vm = kAmsgrad ? vmax_ptr[i] : 0.f;
      adamw_element<float, kAmsgrad>(p, g, m_ptr[i], v_ptr[i], vm, s);
      if constexpr (kMaster) master[i] = p;
      param[i] = static_cast<T>(p);
      if (s.unscale) g_ptr[i] = static_cast<T>(g);
      if constexpr (kAmsgrad) vmax_ptr[i] = vm;
    }
  } else {
    using V = CpuVec<float>;
    constexpr int64_t W = V::size();
    const V neg_lr_wd(s.neg_lr_wd), omb1(s.one_minus_beta1), omb2(s.one_minus_beta2), eps(s.eps);
    const V step_size(s.step_size), bc2_sqrt(s.bc2_sqrt), grad_scale(s.grad_scale);
    alignas(64) float pb[kCpuTile], gb[kCpuTile];
    for (int64_t c0 = 0; c0 < n; c0 += kCpuTile) {
      const int64_t cn = std::min(kCpuTile, n - c0);
      float* p = kMaster ? master + c0 : math_dst(param + c0, pb);
      if constexpr (!kMaster) as_math(param + c0, pb, cn);  // no copy for float32 (p is param)
      float* g = math_dst(g_ptr + c0, gb);
      as_math(g_ptr + c0, gb, cn);
      for (int64_t i = 0; i < cn; i += W) {
        const int64_t k = std::min(W, cn - i);
        float* m = m_ptr + c0 + i;
        float* v = v_ptr + c0 + i;
        V gv = V::loadu(g + i, k);
        if (s.unscale) {
          gv = gv / grad_scale;
          gv.store(g + i, k);
        }
        const V d = s.maximize ? gv.neg() : gv;
        V pv = V::loadu(p + i, k);
        pv = at::vec::fmadd(neg_lr_wd, pv, pv);
        V mv = V::loadu(m, k), vv = V::loadu(v, k);
        mv = at::vec::fmadd(omb1, d - mv, mv);
        vv = at::vec::fmadd(omb2, d * d - vv, vv);
        V second = vv;
        if constexpr (kAmsgrad) {
          const V old = V::loadu(vmax_ptr + c0 + i, k);
          second = V::blendv(vv, old, old > vv);  // vmax > v ? vmax : v, as the scalar form
          second.store(vmax_ptr + c0 + i, k);
        }
        const V denom = second.sqrt() / bc2_sqrt + eps;
        pv = pv - (step_size * mv) / denom;
        pv.store(p + i, k);
        mv.store(m, k);
        vv.store(v, k);
      }
      store_math(p, param + c0, cn);  // float16/bfloat16: the param rounded from p (or the master)
      if (s.unscale) store_math(g, g_ptr + c0, cn);
    }
  }
}

template <typename T>
void update_dtype(const TensorMeta& t, void* grad, int64_t begin, int64_t n, const StepScalars<float>& s) {
  T* g = static_cast<T*>(grad);
  const bool master = t.master != nullptr, amsgrad = t.max_exp_avg_sq != nullptr;
  if (master) {
    if (amsgrad) update_typed<T, true, true>(t, g, begin, n, s);
    else update_typed<T, true, false>(t, g, begin, n, s);
  } else {
    if (amsgrad) update_typed<T, false, true>(t, g, begin, n, s);
    else update_typed<T, false, false>(t, g, begin, n, s);
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
