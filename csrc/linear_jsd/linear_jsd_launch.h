// linear_jsd's launch interface, shared by the host code (linear_jsd_cuda.cpp, compiled by the C++
// compiler) and the kernels (linear_jsd_rows.cu): the row kernel's parameters and its launcher.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace fuseforge::linear_jsd {

// A chunk of rows: the student's and the teacher's float32 logits (not yet divided by the
// temperature), row stride ld; dz, when wanted, in T (row stride ld_dz). For float32 inputs dz may
// be the student's logits themselves: every logit is read by the thread that overwrites it.
template <typename T>
struct RowParams {
  const float* student = nullptr;
  const float* teacher = nullptr;
  int64_t ld = 0;
  T* dz = nullptr;  // or nullptr: no gradient
  int64_t ld_dz = 0;
  const int64_t* target = nullptr;  // or nullptr: no row is skipped
  int64_t rows = 0, vocab = 0;
  int64_t ignore_index = -100;
  int mode = 2;  // Mode: 0 forward KL, 1 reverse KL, 2 JSD
  float beta = 0.5f, inv_temperature = 1.f;
  const float* row_scale = nullptr;     // per-row gradient weight, or nullptr
  const float* scalar_scale = nullptr;  // one device float (1/count, grad_loss), or nullptr
  float* loss_out = nullptr;            // rows, or nullptr
};

constexpr int kRowThreads = 256;

// Defined in linear_jsd_rows.cu for float, at::Half, at::BFloat16: one block a row, on the current
// stream, never synchronizing.
template <typename T>
void launch_rows(const RowParams<T>& p);

}  // namespace fuseforge::linear_jsd
