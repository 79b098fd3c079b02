// Element-type dispatch: one set of macros for every op.
#pragma once
#include <ATen/Dispatch.h>

// float32, float16, bfloat16: the GPU types.
#define FUSEFORGE_DISPATCH_HALF_FLOAT(TYPE, NAME, ...)                \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__) \
                                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// The same plus float64: CPU implementations (float64 serves gradcheck).
#define FUSEFORGE_DISPATCH_FLOATING(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, NAME, __VA_ARGS__)

// A compile-time bool from a run-time one: BOOL_SWITCH(flag, kFlag, [&] { f<kFlag>(); });
#define FUSEFORGE_BOOL_SWITCH(COND, CONST_NAME, ...) \
  [&] {                                              \
    if (COND) {                                      \
      constexpr static bool CONST_NAME = true;       \
      return __VA_ARGS__();                          \
    } else {                                         \
      constexpr static bool CONST_NAME = false;      \
      return __VA_ARGS__();                          \
    }                                                \
  }()
