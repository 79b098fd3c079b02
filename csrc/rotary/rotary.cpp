// rotary: input checks and the CPU implementation (the reference the CUDA kernel must match;
// float64 serves gradcheck).
#include "rotary/rotary.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "common/checks.h"
#include "common/dispatch.h"

namespace fuseforge::rotary {

namespace {

bool is_supported_out_dtype(at::ScalarType t, bool allow_double) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || (allow_double && t == at::kDouble);
}

// The kernels take any strides but need the last dim dense.
at::Tensor last_dim_dense(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

}  // namespace

Problem prepare(const at::Tensor& q, const at::Tensor& k, const at::Tensor& inv_freq, const at::Tensor& position_ids,
                std::optional<at::ScalarType> out_dtype, bool allow_double) {
  TORCH_CHECK(q.dim() == 4, "q must have shape (B, Hq, S, D), got ", q.sizes());
  TORCH_CHECK(k.dim() == 4, "k must have shape (B, Hk, S, D), got ", k.sizes());
  check_dtype_supported(q, "q", allow_double);
  check_same_dtype(q, "q", k, "k");
  check_same_device(q, "q", k, "k");
  check_same_device(q, "q", inv_freq, "inv_freq");
  check_same_device(q, "q", position_ids, "position_ids");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.size(3) == q.size(3),
              "k must have q's batch, sequence and head dims (", q.size(0), ", Hk, ", q.size(2), ", ", q.size(3),
              "), got ", k.sizes());
  TORCH_CHECK(inv_freq.dim() == 1 && inv_freq.scalar_type() == at::kFloat && inv_freq.numel() >= 1,
              "inv_freq must be a 1-D float32 tensor of R / 2 >= 1 elements, got ", inv_freq.scalar_type(),
              " of shape ", inv_freq.sizes());
  TORCH_CHECK(2 * inv_freq.numel() <= q.size(3), "inv_freq has ", inv_freq.numel(), " elements: R = ",
              2 * inv_freq.numel(), " rotary dims exceed the head dim D = ", q.size(3), " of q and k");
  const auto pos_type = position_ids.scalar_type();
  TORCH_CHECK(pos_type == at::kLong || pos_type == at::kInt, "position_ids must be int64 or int32, got ", pos_type);
  TORCH_CHECK(position_ids.dim() == 2 && position_ids.size(1) == q.size(2) &&
                  (position_ids.size(0) == q.size(0) || position_ids.size(0) == 1),
              "position_ids must have shape (B, S) = (", q.size(0), ", ", q.size(2), ") or (1, ", q.size(2),
              "), got ", position_ids.sizes());
  Problem p;
  p.out_dtype = out_dtype.value_or(q.scalar_type());
  TORCH_CHECK(is_supported_out_dtype(p.out_dtype, allow_double), "out_dtype must be float32, float16 or bfloat16",
              allow_double ? " (or float64 on the CPU)" : " (float64 only on the CPU)", ", got ", p.out_dtype);
  p.q = last_dim_dense(q);
  p.k = last_dim_dense(k);
  p.inv_freq = inv_freq.contiguous();
  p.position_ids = position_ids;
  p.batch = q.size(0);
  p.heads_q = q.size(1);
  p.seq = q.size(2);
  p.head_dim = q.size(3);
  p.heads_k = k.size(1);
  p.rot_half = inv_freq.numel();
  return p;
}

namespace {

int64_t position_at(const at::Tensor& position_ids, const void* data, int64_t offset) {
  return position_ids.scalar_type() == at::kLong ? static_cast<const int64_t*>(data)[offset]
                                                 : static_cast<const int32_t*>(data)[offset];
}

// One head: the R rotary dims from the token's cos/sin (M: the math type), then dims R..D-1 copied.
template <typename Tin, typename Tout, typename M>
void rotate_head(const Tin* x, Tout* y, const M* cos_tab, const M* sin_tab, int64_t rot_half, int64_t head_dim,
                 bool interleaved) {
  const int64_t first = interleaved ? 1 : rot_half;  // x[i1] pairs with x[i1 + first]
  for (int64_t i = 0; i < rot_half; ++i) {
    const int64_t i1 = interleaved ? 2 * i : i;
    const M x1 = static_cast<M>(x[i1]), x2 = static_cast<M>(x[i1 + first]);
    y[i1] = static_cast<Tout>(x1 * cos_tab[i] - x2 * sin_tab[i]);
    y[i1 + first] = static_cast<Tout>(x2 * cos_tab[i] + x1 * sin_tab[i]);
  }
  for (int64_t d = 2 * rot_half; d < head_dim; ++d) y[d] = static_cast<Tout>(static_cast<M>(x[d]));
}

template <typename Tin, typename Tout>
void rotary_cpu_typed(const Problem& p, double scaling, bool interleaved, bool inverse, at::Tensor& q_out,
                      at::Tensor& k_out) {
  // float64 inputs (gradcheck) compute in float64, the others in float32.
  using M = std::conditional_t<std::is_same_v<Tin, double>, double, float>;
  const Tin* q = p.q.const_data_ptr<Tin>();
  const Tin* k = p.k.const_data_ptr<Tin>();
  Tout* qo = q_out.mutable_data_ptr<Tout>();
  Tout* ko = k_out.mutable_data_ptr<Tout>();
  const float* inv_freq = p.inv_freq.const_data_ptr<float>();
  const void* positions = p.position_ids.const_data_ptr();
  const int64_t pos_sb = p.position_stride_b(), pos_ss = p.position_ids.stride(1);
  const double sin_scaling = inverse ? -scaling : scaling;
  const int64_t per_token = std::max<int64_t>(1, (p.heads_q + p.heads_k) * p.head_dim);
  at::parallel_for(0, p.batch * p.seq, std::max<int64_t>(1, 32768 / per_token), [&](int64_t begin, int64_t end) {
    std::vector<M> cos_tab(p.rot_half), sin_tab(p.rot_half);
    for (int64_t token = begin; token < end; ++token) {
      const int64_t b = token / p.seq, s = token % p.seq;
      const float pos = static_cast<float>(position_at(p.position_ids, positions, b * pos_sb + s * pos_ss));
      for (int64_t f = 0; f < p.rot_half; ++f) {
        // One float32 multiply, as Hugging Face's position_ids.float() * inv_freq (no fma: the CPU
        // build has -ffp-contract=off); cos and sin of that angle in float64.
        const double angle = static_cast<double>(pos * inv_freq[f]);
        cos_tab[f] = static_cast<M>(std::cos(angle) * scaling);
        sin_tab[f] = static_cast<M>(std::sin(angle) * sin_scaling);
      }
      for (int64_t h = 0; h < p.heads_q; ++h)
        rotate_head(q + b * p.q.stride(0) + h * p.q.stride(1) + s * p.q.stride(2),
                    qo + (token * p.heads_q + h) * p.head_dim, cos_tab.data(), sin_tab.data(), p.rot_half,
                    p.head_dim, interleaved);
      for (int64_t h = 0; h < p.heads_k; ++h)
        rotate_head(k + b * p.k.stride(0) + h * p.k.stride(1) + s * p.k.stride(2),
                    ko + (token * p.heads_k + h) * p.head_dim, cos_tab.data(), sin_tab.data(), p.rot_half,
                    p.head_dim, interleaved);
    }
  });
}

void rotary_cpu(const Problem& p, double scaling, bool interleaved, bool inverse, at::Tensor& q_out,
                at::Tensor& k_out) {
  FUSEFORGE_DISPATCH_FLOATING(p.q.scalar_type(), "rotary_cpu", [&] {
    using in_t = scalar_t;
    FUSEFORGE_DISPATCH_FLOATING(p.out_dtype, "rotary_cpu_out", [&] {
      rotary_cpu_typed<in_t, scalar_t>(p, scaling, interleaved, inverse, q_out, k_out);
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fuseforge, CPU, m) {
  // float64 is allowed on the CPU (gradcheck).
  m.impl("rotary", &rotary_op<rotary_cpu, true>);
}

}  // namespace fuseforge::rotary
