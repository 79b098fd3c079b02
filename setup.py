"""Builds fuseforge._C, the extension that registers torch.ops.fuseforge.*.

Environment:
  FUSEFORGE_CPU_ONLY=1      build without CUDA sources (also automatic when no nvcc is found)
  TORCH_CUDA_ARCH_LIST      GPU targets (default: "9.0a", the H100's sm_90a; a list with plain 9.0
                            builds no sm_90a-only kernels: see sm90a_only_sm90_target)
  FUSEFORGE_OPS=a,b         build only these op folders of csrc/ (development; default: all)
  MAX_JOBS                  parallel compile jobs (ninja)
  FUSEFORGE_DEBUG=1         -O0 -g host code, -lineinfo device code
  FUSEFORGE_NVCC_FLAGS      extra nvcc flags (tuning experiments, e.g. "-DFUSEFORGE_AMA_ROWS_16BIT=8")
"""
import glob
import os
import platform
import shlex
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

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
        files += [f for f in cpp if (with_cuda or not f.endswith("_cuda.cpp")) and isa_of(f) is None]
        if with_cuda:
            files += sorted(glob.glob(os.path.join(CSRC, d, "**", "*.cu"), recursive=True))
    return files


# CPU kernels built once per x86 ISA level (csrc/common/cpu_isa.h): `<op>_cpu_<isa>.cpp` files get
# their own flags, which torch's BuildExtension cannot give one source, so they are compiled here
# and linked in as extra objects. Other architectures (and other compilers' hosts) build the
# baseline kernels only.
ISA_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mlzcnt", "-mpopcnt",
             "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c", "-mbmi",
               "-mbmi2", "-mlzcnt", "-mpopcnt", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
}
X86 = platform.machine().lower() in ("x86_64", "amd64")


def isa_of(path):
    for isa in ISA_FLAGS:
        if path.endswith(f"_cpu_{isa}.cpp"):
            return isa
    return None


def isa_sources():
    if not X86:
        return []
    return [f for d in op_dirs() for f in sorted(glob.glob(os.path.join(CSRC, d, "**", "*.cpp"), recursive=True))
            if isa_of(f)]


VERSION_FILE = os.path.join(ROOT, "python", "fuseforge", "VERSION")


def version() -> str:
    with open(VERSION_FILE) as f:
        return f.read().strip()


def write_build_info(package_dirs, with_cuda: bool) -> None:
    """fuseforge/_build_info.py: the torch (and CUDA) the extension is compiled against, which
    fuseforge checks at import instead of failing on an undefined symbol under another torch."""
    import torch
    text = ("# Written by setup.py when the extension is built.\n"
            f"TORCH_VERSION = {torch.__version__!r}\n"
            f"CUDA_VERSION = {(torch.version.cuda if with_cuda else None)!r}\n")
    for d in package_dirs:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "_build_info.py"), "w") as f:
            f.write(text)


class BuildWithIsaKernels(BuildExtension):
    """torch's BuildExtension, plus the per-ISA CPU kernel objects (compiled in parallel, each only
    when it or any header under csrc/ is newer than its object), and fuseforge/_build_info.py."""

    def build_extensions(self):
        write_build_info({os.path.join(ROOT, "python", "fuseforge"), os.path.join(self.build_lib, "fuseforge")},
                         want_cuda())
        from torch.utils.cpp_extension import include_paths
        import torch
        for ext in self.extensions:
            flags = [a for a in ext.extra_compile_args.get("cxx", []) if not a.startswith("-DPy_LIMITED_API")]
            incs = [f"-I{p}" for p in ext.include_dirs + include_paths()]
            abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
            cxx = shlex.split(os.environ.get("CXX", "c++"))
            headers = glob.glob(os.path.join(ROOT, CSRC, "**", "*.h"), recursive=True)
            newest_header = max((os.path.getmtime(h) for h in headers), default=0)
            jobs = []
            for src in isa_sources():
                obj = os.path.join(os.path.abspath(self.build_temp), "isa", os.path.splitext(src)[0] + ".o")
                ext.extra_objects.append(obj)
                if os.path.exists(obj) and os.path.getmtime(obj) >= max(os.path.getmtime(src), newest_header):
                    continue
                os.makedirs(os.path.dirname(obj), exist_ok=True)
                jobs.append(cxx + ["-c", os.path.join(ROOT, src), "-o", obj, "-fPIC", abi] + flags + incs
                            + ISA_FLAGS[isa_of(src)])

            def compile_one(cmd):
                print(" ".join(cmd[:4]) + " ...", flush=True)
                subprocess.run(cmd, check=True)

            with ThreadPoolExecutor(max_workers=int(os.environ.get("MAX_JOBS", os.cpu_count() or 1))) as pool:
                list(pool.map(compile_one, jobs))
        super().build_extensions()


def sm90a_only_sm90_target(arch_list: str) -> bool:
    """Whether an H100 runs this build's sm_90a code: the list has 9.0a and no plain 9.0 (whose code,
    or PTX, the driver could load instead). The host side then may launch the kernels written for
    sm_90a only (FUSEFORGE_SM90A_BUILD, csrc/attention/attention_fwd_warpspec.cuh)."""
    archs = {a.split("+")[0] for a in arch_list.replace(";", " ").split()}
    return "9.0a" in archs and not archs & {"9.0", "Hopper"}


# nvcc's flags for the CUDA sources; scripts/ptxas_check.sh imports them (this file runs setup()
# only as a script, which pip's build backend also does).
NVCC_FLAGS = [
    "-O3", "-std=c++20", "--expt-relaxed-constexpr",
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
]


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
    arch_defines = ["-DFUSEFORGE_SM90A_BUILD"] if sm90a_only_sm90_target(os.environ["TORCH_CUDA_ARCH_LIST"]) else []
    nvcc = NVCC_FLAGS + ["--threads=2"]
    if debug:
        nvcc.append("-lineinfo")
    nvcc += os.environ.get("FUSEFORGE_NVCC_FLAGS", "").split()
    return CUDAExtension("fuseforge._C", sources(True),
                         extra_compile_args={"cxx": cxx + ["-DFUSEFORGE_WITH_CUDA"] + arch_defines,
                                             "nvcc": nvcc + ["-DFUSEFORGE_WITH_CUDA"] + arch_defines},
                         include_dirs=[os.path.join(ROOT, CSRC)] + cuda_library_includes(),
                         extra_link_args=["-fopenmp"], py_limited_api=True)


if __name__ == "__main__":
    setup(
        name="fuseforge",
        version=version(),
        description="Fused CUDA kernels for training PyTorch models",
        package_dir={"": "python"},
        packages=find_packages("python"),
        package_data={"fuseforge": ["VERSION"]},
        ext_modules=[extension()],
        cmdclass={"build_ext": BuildWithIsaKernels},
        options={"bdist_wheel": {"py_limited_api": "cp39"}},
        python_requires=">=3.10",
        install_requires=["torch>=2.11"],
    )
