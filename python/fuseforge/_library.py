"""Loads the compiled extension, which registers torch.ops.fuseforge.*."""
import os

import torch  # noqa: F401  (libtorch must be loaded before the extension)


def load() -> None:
    # FUSEFORGE_EXTENSION points at a _C library built elsewhere (development builds in a private
    # folder); otherwise the one installed beside this package.
    path = os.environ.get("FUSEFORGE_EXTENSION")
    if path:
        torch.ops.load_library(path)
    else:
        from fuseforge import _C  # noqa: F401


def cuda_built() -> bool:
    """Whether the loaded extension has CUDA kernels: a CPU-only build has none; a FUSEFORGE_OPS
    build has them for the ops it built."""
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")
               for name in torch._C._dispatch_get_all_op_names() if name.startswith("fuseforge::"))
