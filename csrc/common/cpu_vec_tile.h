// Vectorized conversions of a tile between a storage type T and the math type M, for the per-ISA CPU
// kernels (common/cpu_isa.h): include only from an `<op>_cpu_kernel.h`, after common/cpu_vec.h.
// bfloat16/float16 <-> float go through at::vec's conversions (round to nearest even, as c10's
// scalar conversions: the same values in every build); other pairs convert element by element.
// Internal linkage, as everything in cpu_vec.h.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <type_traits>

#include "common/cpu_vec.h"

namespace fuseforge {
namespace {

template <typename T>
constexpr bool kIsReducedFloat = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

// src as M: src itself when T is M, else its n elements converted into buf.
template <typename T, typename M>
const M* tile_to_math(const T* src, M* buf, int64_t n) {
  if constexpr (std::is_same_v<T, M>) {
    return src;
  } else if constexpr (std::is_same_v<M, float> && kIsReducedFloat<T>) {
    using VT = at::vec::Vectorized<T>;
    using VF = at::vec::Vectorized<float>;
    constexpr int64_t kW = VT::size();  // 2 float vectors
    int64_t i = 0;
    for (; i + kW <= n; i += kW) {
      auto [lo, hi] = at::vec::convert_to_float<T>(VT::loadu(src + i));
      lo.store(buf + i);
      hi.store(buf + i + VF::size());
    }
    for (; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<M>(src[i]);
    return buf;
  }
}

// The n Ms at src (computed where cpu_vec.h's math_dst said) stored to dst as T.
template <typename T, typename M>
void tile_from_math(const M* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, M>) {
    if (src != dst)
      for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
  } else if constexpr (std::is_same_v<M, float> && kIsReducedFloat<T>) {
    using VT = at::vec::Vectorized<T>;
    using VF = at::vec::Vectorized<float>;
    constexpr int64_t kW = VT::size();
    int64_t i = 0;
    for (; i + kW <= n; i += kW)
      at::vec::convert_from_float<T>(VF::loadu(src + i), VF::loadu(src + i + VF::size())).store(dst + i);
    for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
  }
}

// Sum of the lanes of a power-of-two number of lanes, halving (a fixed order: the same in every build).
template <typename M, int64_t kLanes>
M sum_lanes(M* lanes) {
  for (int64_t half = kLanes / 2; half >= 1; half /= 2)
    for (int64_t i = 0; i < half; ++i) lanes[i] = lanes[i] + lanes[i + half];
  return lanes[0];
}

// Accumulators of kAccBytes bytes of lanes: element i of a row adds into lane i % kLanes, whatever
// the vector width, so a sum over a row is the same in every build (and its order fixed). Rows are
// fed a tile at a time (add_tile), each tile starting at a multiple of kLanes.
template <typename M>
struct LaneSum {
  using V = at::vec::Vectorized<M>;
  static constexpr int64_t kAccBytes = 256;
  static constexpr int64_t kLanes = kAccBytes / static_cast<int64_t>(sizeof(M));  // 64 floats, 32 doubles
  static constexpr int64_t kVecs = kLanes / V::size();
  static_assert(kLanes % V::size() == 0, "vector width must divide the lanes");
  V acc[kVecs];
  LaneSum() {
    for (int64_t j = 0; j < kVecs; ++j) acc[j] = V(M(0));
  }
  // Adds term(i, k) (the vector of elements i..i+k of a tile of n, k <= V::size()) for every vector
  // of the tile, each into its lanes; the lane indices are compile-time constants (after unrolling),
  // so the accumulators stay in registers.
  template <typename F>
  void add_tile(int64_t n, F&& term) {
    constexpr int64_t W = V::size();
    for (int64_t i = 0; i < n; i += kLanes) {
      if (i + kLanes <= n) {
#pragma GCC unroll 8
        for (int64_t j = 0; j < kVecs; ++j) acc[j] = acc[j] + term(i + j * W, W);
      } else {
#pragma GCC unroll 8
        for (int64_t j = 0; j < kVecs; ++j) {
          const int64_t off = i + j * W;
          if (off < n) acc[j] = acc[j] + term(off, std::min<int64_t>(W, n - off));
        }
      }
    }
  }
  // The lanes' sum in sum_lanes' order: the halvings that span whole vectors as vector adds, the
  // rest on the stored lanes of one vector.
  M total() const {
    V v[kVecs];
    for (int64_t j = 0; j < kVecs; ++j) v[j] = acc[j];
    for (int64_t n = kVecs / 2; n >= 1; n /= 2)
      for (int64_t j = 0; j < n; ++j) v[j] = v[j] + v[j + n];
    alignas(64) M lanes[V::size()];
    v[0].store(lanes);
    return sum_lanes<M, V::size()>(lanes);
  }
};

}  // namespace
}  // namespace fuseforge
