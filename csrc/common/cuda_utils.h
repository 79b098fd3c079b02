// Host-side CUDA helpers that plain C++ (g++-compiled) files may include.
#pragma once
#include <ATen/cuda/CUDAContext.h>

#include <cstdint>

namespace fuseforge {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int num_sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

}  // namespace fuseforge
