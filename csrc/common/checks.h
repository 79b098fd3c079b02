// Input checks shared by every op: each error names the argument and what was expected.
#pragma once
#include <ATen/ATen.h>

namespace fuseforge {

inline void check_floating(const at::Tensor& t, const char* name) {
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), name,
              " must be a floating-point tensor (float32, float16 or bfloat16), got ", t.scalar_type());
}

// float32/float16/bfloat16 (+ float64 when allow_double) on `name`.
inline void check_dtype_supported(const at::Tensor& t, const char* name, bool allow_double) {
  const auto st = t.scalar_type();
  const bool ok = st == at::kFloat || st == at::kHalf || st == at::kBFloat16 || (allow_double && st == at::kDouble);
  TORCH_CHECK(ok, name, " must be float32, float16 or bfloat16",
              allow_double ? " (or float64 on the CPU)" : " (float64 only on the CPU)", ", got ", st, " on ",
              t.device());
}

inline void check_same_dtype(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), b_name, " must have the dtype of ", a_name, " (",
              a.scalar_type(), "), got ", b.scalar_type());
}

inline void check_same_device(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name) {
  TORCH_CHECK(a.device() == b.device(), b_name, " must be on the device of ", a_name, " (", a.device(),
              "), got ", b.device());
}

inline void check_same_shape(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name) {
  TORCH_CHECK(a.sizes() == b.sizes(), b_name, " must have the shape of ", a_name, " ", a.sizes(), ", got ",
              b.sizes());
}

inline void check_device_type(const at::Tensor& t, const char* name, at::DeviceType type) {
  TORCH_CHECK(t.device().type() == type, name, " must be a ", c10::DeviceTypeName(type), " tensor, got one on ",
              t.device());
}

}  // namespace fuseforge
