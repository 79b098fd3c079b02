// Instantiations of linear_jsd's row kernel: 3 dtypes x 3 divergences x {vector, scalar}.
#include "linear_jsd/linear_jsd_kernel.cuh"

namespace fuseforge::linear_jsd {

namespace {
template <typename T, int kMode>
void launch_mode(const RowParams<T>& p, bool vec) {
  const dim3 grid(static_cast<unsigned>(p.rows));
  if (vec) {
    launch_kernel(rows_kernel<T, kMode, true>, grid, dim3(kRowThreads), 0, p);
  } else {
    launch_kernel(rows_kernel<T, kMode, false>, grid, dim3(kRowThreads), 0, p);
  }
}
}  // namespace

template <typename T>
void launch_rows(const RowParams<T>& p) {
  const bool vec = p.vocab % 4 == 0 && p.ld % 4 == 0 && is_aligned(p.student, 16) && is_aligned(p.teacher, 16) &&
                   (p.dz == nullptr || (p.ld_dz % 4 == 0 && is_aligned(p.dz, 4 * sizeof(T))));
  switch (p.mode) {
    case 0: return launch_mode<T, 0>(p, vec);
    case 1: return launch_mode<T, 1>(p, vec);
    default: return launch_mode<T, 2>(p, vec);
  }
}

template void launch_rows<float>(const RowParams<float>&);
template void launch_rows<at::Half>(const RowParams<at::Half>&);
template void launch_rows<at::BFloat16>(const RowParams<at::BFloat16>&);

}  // namespace fuseforge::linear_jsd
