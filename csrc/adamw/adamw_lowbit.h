// Compact optimizer states (AdamW(state_dtype="bfloat16" | "int8")): the formats and their codes,
// written once for the CUDA kernel, the CPU kernels and the host-side conversions of loaded states
// (docs/design/adamw.md, "Compact states", has the tables and the reasons).
//
// int8: each moment is an array of 8-bit codes shaped like the parameter plus one float32 absmax
// per kQuantBlock consecutive elements (memory order). A code c stands for value(c) / top * absmax,
// value() a small float with 4 exponent bits (bias 15, subnormals) and M mantissa bits:
//   exp_avg    (signed):   bit 7 the sign, bits 0-6 the magnitude, M = 3 (top = 1.875)
//   exp_avg_sq (unsigned): bits 0-7 the magnitude, M = 4 (top = 1.9375)
// Encoding rounds |x| * top / absmax to the nearest value (ties to even), so the element with the
// block's largest magnitude is stored exactly; a positive exp_avg_sq never becomes code 0.
//
// bfloat16: both moments (and max_exp_avg_sq) rounded stochastically, from 16 bits of a counter
// hash of (element index, step): unbiased, where round-to-nearest leaves exp_avg_sq unable to
// decrease at beta2 > 0.998.
#pragma once
#include <cstdint>
#include <cstring>

#include "adamw/adamw_math.h"  // FUSEFORGE_ADAMW_HD

namespace fuseforge::adamw {

// How a tensor's moments are stored (TensorMeta::state_format).
enum class StateFormat : int32_t {
  kFull = 0,      // float32 (float64 for float64 params)
  kBFloat16 = 1,  // bfloat16, stochastic rounding
  kInt8 = 2,      // 8-bit codes + a float32 absmax per kQuantBlock elements
};

// Elements that share one absmax. Chunks of the multi-tensor kernel start at multiples of it, so a
// block never straddles two CUDA blocks (or two CPU work items).
constexpr int64_t kQuantBlock = 256;

// Internal linkage for everything below: the per-ISA CPU builds (common/cpu_isa.h) include these
// functions too, and must never share one copy (the linker could keep the AVX-512 one for all).
namespace {

inline int64_t quant_blocks(int64_t numel) { return (numel + kQuantBlock - 1) / kQuantBlock; }

FUSEFORGE_ADAMW_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

FUSEFORGE_ADAMW_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

FUSEFORGE_ADAMW_HD float abs_float(float x) { return bits_float(float_bits(x) & 0x7FFFFFFFu); }

// c ? a : b as a mask: GCC 12 if-converts (and then vectorizes) this where it keeps a ?: as a branch.
FUSEFORGE_ADAMW_HD uint32_t select_bits(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return (a & mask) | (b & ~mask);
}

// |x| as an integer that orders like the float, NaN as 0: a block's absmax is the float of the
// largest key, which is fmaxf's maximum of the magnitudes (NaN skipped) whatever the order of the
// reduction (the CPU's loop, the GPU's shuffles); an integer max vectorizes on the CPU.
FUSEFORGE_ADAMW_HD uint32_t magnitude_key(float x) {
  const uint32_t a = float_bits(x) & 0x7FFFFFFFu;
  return select_bits(a <= 0x7F800000u, a, 0u);
}

// ---- int8 codes -----------------------------------------------------------------------------------
// Branch-free (selects only), so the CPU's conversion loops vectorize and the GPU's do not diverge.

// The magnitude code of kM mantissa bits: c = e << kM | f, value = e == 0 ? f * 2^(-14 - kM)
// : 2^(e - 15) * (1 + f * 2^-kM). Codes are ordered by value, so rounding the float's mantissa to
// kM bits (with the carry into the exponent) is rounding to the nearest code.
template <int kM>
struct SmallFloat {
  static constexpr uint32_t kMaxCode = (16u << kM) - 1;
  static constexpr float kTop = 2.0f - 1.0f / static_cast<float>(1u << kM);    // value(kMaxCode)
  static constexpr float kMinNormal = 1.0f / 16384.0f;                           // 2^-14
  static constexpr float kSubnormalsPerUnit = static_cast<float>(1u << (14 + kM));  // 1 / subnormal step

  FUSEFORGE_ADAMW_HD static float value(uint32_t c) {
    const uint32_t e = c >> kM, f = c & ((1u << kM) - 1);
    const float subnormal = static_cast<float>(static_cast<int32_t>(f)) * (1.0f / kSubnormalsPerUnit);
    const uint32_t normal = ((e + 112u) << 23) | (f << (23 - kM));  // exponent e - 15, rebiased to 127
    return bits_float(select_bits(e == 0, float_bits(subnormal), normal));
  }

  // y >= 0 (or -0). NaN and values past kTop give kMaxCode.
  FUSEFORGE_ADAMW_HD static uint32_t code(float y) {
    // Subnormal codes are the integers y / step (an exact scaling by a power of two), rounded to
    // nearest even by the 2^23 shift (the default rounding mode); 2^kM is the first normal code.
    const float k = y * kSubnormalsPerUnit;
    const uint32_t subnormal = static_cast<uint32_t>(static_cast<int32_t>((k + 8388608.0f) - 8388608.0f));
    uint32_t r = float_bits(y) - (112u << 23);
    r += (1u << (22 - kM)) - 1 + ((r >> (23 - kM)) & 1u);  // round the mantissa to kM bits, ties to even
    const uint32_t normal = r >> (23 - kM);
    return select_bits(y < kMinNormal, subnormal, select_bits(normal < kMaxCode, normal, kMaxCode));
  }
};

using ExpAvgCode = SmallFloat<3>;    // 7 magnitude bits + a sign bit
using ExpAvgSqCode = SmallFloat<4>;  // 8 magnitude bits

// Per-block factors: decode multiplies a code's value by absmax / top, encode multiplies |x| by
// top / absmax (0 for an all-zero block, whose codes are all 0).
template <typename Code>
FUSEFORGE_ADAMW_HD float decode_scale(float absmax) {
  return absmax / Code::kTop;
}
template <typename Code>
FUSEFORGE_ADAMW_HD float encode_scale(float absmax) {
  return absmax > 0.f ? Code::kTop / absmax : 0.f;
}

FUSEFORGE_ADAMW_HD float decode_exp_avg(uint32_t c, float scale) {
  const float v = ExpAvgCode::value(c & 0x7Fu) * scale;
  return bits_float(float_bits(v) ^ ((c & 0x80u) << 24));  // bit 7 is the sign
}

FUSEFORGE_ADAMW_HD uint8_t encode_exp_avg(float x, float scale) {
  const uint32_t mag = ExpAvgCode::code(abs_float(x) * scale);
  return static_cast<uint8_t>(mag | select_bits((x < 0.f) & (mag != 0), 0x80u, 0u));  // no negative zero code
}

FUSEFORGE_ADAMW_HD float decode_exp_avg_sq(uint32_t c, float scale) { return ExpAvgSqCode::value(c) * scale; }

FUSEFORGE_ADAMW_HD uint8_t encode_exp_avg_sq(float x, float scale) {
  const uint32_t c = ExpAvgSqCode::code(x * scale);
  // A second moment rounded to 0 would turn the update into exp_avg / eps.
  return static_cast<uint8_t>(c | static_cast<uint32_t>((c == 0) & (x > 0.f)));
}

// ---- bfloat16 stochastic rounding ---------------------------------------------------------------

// 32 random bits for (element index, step): a stateless integer hash, the same on every backend.
FUSEFORGE_ADAMW_HD uint32_t rounding_bits(uint64_t index, uint32_t step) {
  uint32_t h = static_cast<uint32_t>(index) * 0x9E3779B1u;
  h ^= static_cast<uint32_t>(index >> 32) * 0x85EBCA77u;
  h ^= step * 0xC2B2AE3Du;
  h ^= h >> 16;
  h *= 0x7FEB352Du;
  h ^= h >> 15;
  h *= 0x846CA68Bu;
  h ^= h >> 16;
  return h;
}

FUSEFORGE_ADAMW_HD float bf16_bits_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// x rounded to bfloat16 up (in magnitude) with probability (x - lower) / (upper - lower), given 16
// uniform random bits; infinities and NaN (quieted) keep their value.
FUSEFORGE_ADAMW_HD uint16_t float_to_bf16_stochastic(float x, uint32_t random16) {
  const uint32_t u = float_bits(x);
  const uint32_t special = (u >> 16) | select_bits((u & 0x7FFFFFu) != 0, 0x40u, 0u);
  const uint32_t rounded = (u + (random16 & 0xFFFFu)) >> 16;
  return static_cast<uint16_t>(select_bits((u & 0x7F800000u) == 0x7F800000u, special, rounded));
}

}  // namespace
}  // namespace fuseforge::adamw
