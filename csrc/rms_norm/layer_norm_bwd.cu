// Instantiates the LayerNorm backward kernels (rms_norm's, centered: 3 dtypes x (8 row shapes + 2
// two-pass)), their planner and launcher, and the weight and bias gradients' column sums.
#include "rms_norm/rms_norm_kernel.cuh"

namespace fuseforge::rms_norm {
FUSEFORGE_NORM_INSTANTIATE_BACKWARD(true)
}  // namespace fuseforge::rms_norm
