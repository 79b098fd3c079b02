// Instantiates the RMSNorm backward kernels (3 dtypes x (8 row shapes + 2 two-pass)), their planner
// and launcher, and the weight gradient's column sum.
#include "rms_norm/rms_norm_kernel.cuh"

namespace fuseforge::rms_norm {
FUSEFORGE_NORM_INSTANTIATE_BACKWARD(false)
}  // namespace fuseforge::rms_norm
