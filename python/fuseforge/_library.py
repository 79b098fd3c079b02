"""Loads the compiled extension, which registers torch.ops.fuseforge.*."""
import os

import torch  # noqa: F401  (libtorch must be loaded before the extension)


def check_build(build_torch, running_torch: str = torch.__version__) -> None:
    """Raises ImportError when the extension was compiled against another torch than the running one
    (its C++ symbols would not match: an 'undefined symbol' at best)."""
    if build_torch is not None and build_torch != running_torch:
        raise ImportError(
            f"fuseforge's extension was built against torch {build_torch}, but torch {running_torch} is "
            "running. Rebuild it for this torch: `pip install --no-build-isolation -e .` (or `make build`) "
            "in the source tree, or install the fuseforge wheel built for this torch.")


def load() -> None:
    # FUSEFORGE_EXTENSION points at a _C library built elsewhere (development builds in a private
    # folder); otherwise the one installed beside this package.
    path = os.environ.get("FUSEFORGE_EXTENSION")
    if path:
        torch.ops.load_library(path)
        return
    try:
        from fuseforge._build_info import TORCH_VERSION
    except ImportError:  # a tree whose extension predates the build record
        TORCH_VERSION = None
    check_build(TORCH_VERSION)
    try:
        from fuseforge import _C  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name != "fuseforge._C":
            raise
        raise ImportError(
            "fuseforge's extension (fuseforge._C) is not built: run `make build` (or `pip install "
            "--no-build-isolation -e .`) in the source tree, or install a fuseforge wheel "
            "(docs/install.md)") from e


def cuda_built() -> bool:
    """Whether the loaded extension has CUDA kernels: a CPU-only build has none; a FUSEFORGE_OPS
    build has them for the ops it built."""
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")
               for name in torch._C._dispatch_get_all_op_names() if name.startswith("fuseforge::"))
