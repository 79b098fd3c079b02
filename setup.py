"""Builds fuseforge._C, the extension that registers torch.ops.fuseforge.*.

Environment:
  FUSEFORGE_CPU_ONLY=1      build without CUDA sources (also automatic when no nvcc is found)
  TORCH_CUDA_ARCH_LIST      GPU targets (default: "9.0a", the H100's sm_90a)
  FUSEFORGE_OPS=a,b         build only these op folders of csrc/ (development; default: all)
  MAX_JOBS                  parallel compile jobs (ninja)
  FUSEFORGE_DEBUG=1         -O0 -g host code, -lineinfo device code
  FUSEFORGE_NVCC_FLAGS      extra nvcc flags (tuning experiments, e.g. "-DFUSEFORGE_AMA_ROWS_16BIT=8")
"""
import glob
import os
import shutil

from setuptools import find_packages, setup

# torch finds the toolkit from `which nvcc`; a wrapper script in /usr/local/bin makes that /usr/local,
# whose lib/ has no libcudart. Prefer the real toolkit folder when CUDA_HOME is unset.
if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("csrc")


def want_cuda() -> bool:
    if os.environ.get("FUSEFORGE_CPU_ONLY", "0") == "1":
        return False
    return CUDA_HOME is not None and shutil.which(os.path.join(CUDA_HOME, "bin", "nvcc")) is not None


def cuda_library_includes():
    """Headers of the CUDA libraries torch's headers include (cusparse.h, cublas_v2.h, ...): from the
    toolkit when it has them, else from the nvidia-* wheels installed beside torch."""
    if CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "include", "cusparse.h")):
        return []
    import torch
    site = os.path.dirname(os.path.dirname(torch.__file__))
    return sorted({os.path.dirname(p) for p in glob.glob(os.path.join(site, "nvidia", "**", "include", "cusparse.h"),
                                                         recursive=True)})


def op_dirs():
    chosen = os.environ.get("FUSEFORGE_OPS", "").strip()
    dirs = sorted(d for d in os.listdir(CSRC) if os.path.isdir(os.path.join(CSRC, d)) and d != "common")
    if chosen:
        names = {c.strip() for c in chosen.split(",") if c.strip()}
        unknown = names - set(dirs)
        if unknown:
            raise SystemExit(f"FUSEFORGE_OPS names unknown op folders {sorted(unknown)}; have {dirs}")
        dirs = [d for d in dirs if d in names]
    return dirs


def sources(with_cuda: bool):
    files = [os.path.join(CSRC, "ops.cpp")] + sorted(glob.glob(os.path.join(CSRC, "common", "*.cpp")))
    for d in op_dirs():
        # *_cuda.cpp: the host side of CUDA implementations (compiled by the C++ compiler, not nvcc).
        cpp = sorted(glob.glob(os.path.join(CSRC, d, "**", "*.cpp"), recursive=True))
        files += [f for f in cpp if with_cuda or not f.endswith("_cuda.cpp")]
        if with_cuda:
            files += sorted(glob.glob(os.path.join(CSRC, d, "**", "*.cu"), recursive=True))
    return files


def extension():
    with_cuda = want_cuda()
    debug = os.environ.get("FUSEFORGE_DEBUG", "0") == "1"
    # -fopenmp: at::parallel_for is inline and runs in parallel only in code built with OpenMP (torch's
    # CPU backend); without it every CPU kernel here ran on one thread. -ffp-contract=off: the CPU
    # kernels' AVX2/AVX-512 builds would otherwise fuse a * b - c into an fma where the baseline build
    # cannot, and round differently (explicit fmas, at::vec::fmadd and std::fma, stay fused).
    cxx = ["-O0" if debug else "-O3", "-std=c++20", "-fopenmp", "-ffp-contract=off"]  # torch adds -DPy_LIMITED_API for py_limited_api
    if debug:
        cxx.append("-g")
    if not with_cuda:
        return CppExtension("fuseforge._C", sources(False), extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"],
                            include_dirs=[os.path.join(ROOT, CSRC)] + cuda_library_includes(), py_limited_api=True)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    nvcc = [
        "-O3", "-std=c++20", "--expt-relaxed-constexpr",
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "--threads=2",
    ]
    if debug:
        nvcc.append("-lineinfo")
    nvcc += os.environ.get("FUSEFORGE_NVCC_FLAGS", "").split()
    return CUDAExtension("fuseforge._C", sources(True),
                         extra_compile_args={"cxx": cxx + ["-DFUSEFORGE_WITH_CUDA"],
                                             "nvcc": nvcc + ["-DFUSEFORGE_WITH_CUDA"]},
                         include_dirs=[os.path.join(ROOT, CSRC)] + cuda_library_includes(),
                         extra_link_args=["-fopenmp"], py_limited_api=True)


setup(
    name="fuseforge",
    version="0.1.0",
    description="Fused CUDA kernels for training PyTorch models",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
    python_requires=">=3.10",
    install_requires=["torch>=2.11"],
)
