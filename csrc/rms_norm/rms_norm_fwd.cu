// Instantiates the RMSNorm forward kernels (3 dtypes x (8 row shapes + 2 two-pass + 4 residual-form
// shapes + 2 reread shapes)) and their planner and launcher.
#include "rms_norm/rms_norm_kernel.cuh"

namespace fuseforge::rms_norm {
FUSEFORGE_NORM_INSTANTIATE_FORWARD(false)
}  // namespace fuseforge::rms_norm
