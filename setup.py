"""Builds fuseforge._C, the extension that registers torch.ops.fuseforge.*.

Environment (docs/install.md):
  FUSEFORGE_CUDA=1          build the CUDA kernels (needs nvcc and a CUDA torch); the default when a GPU
                            is visible and nvcc is found, else the build is CPU-only
  FUSEFORGE_CPU_ONLY=1      build without CUDA sources, GPU or not (FUSEFORGE_CUDA=0 says the same)
  TORCH_CUDA_ARCH_LIST      GPU targets. Default: the visible GPUs' (9.0 becomes 9.0a, the H100's sm_90a);
                            with no GPU visible, PORTABLE_ARCH_LIST. A list with plain 9.0 builds no
                            sm_90a-only kernels: see sm90a_only_sm90_target
  FUSEFORGE_OPS=a,b         build only these op folders of csrc/ (development; default: all)
  MAX_JOBS                  parallel compile jobs (ninja)
  FUSEFORGE_DEBUG=1         -O0 -g host code, -lineinfo device code
  FUSEFORGE_DEV=1           a developer build: the FUSEFORGE_* development knobs that force kernel paths
                            and tile choices are read at run time (csrc/common/env.h; the tests that
                            use them skip in other builds), in its own build folder
  FUSEFORGE_VERBOSE=1       print the compiler command lines (default: one progress line a file)
  FUSEFORGE_NVCC_FLAGS      extra nvcc flags (tuning experiments, e.g. "-DFUSEFORGE_AMA_ROWS_16BIT=8")

Every route (`make build`, `pip install --no-build-isolation [-e] .`, `pip wheel .`) compiles into
build/temp-<cpu|cuda>[-debug][-dev]/ (ninja: a second route recompiles nothing); `build_ext -t DIR` overrides.
"""
import glob
import logging
import os
import platform
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

# torch finds the toolkit from `which nvcc`; a wrapper script in /usr/local/bin makes that /usr/local,
# whose lib/ has no libcudart. Prefer the real toolkit folder when CUDA_HOME is unset.
if "CUDA_HOME" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

# torch warns "No CUDA runtime is found" on import wherever no GPU is visible: not news for a CPU build.
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
from torch.utils import cpp_extension  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("csrc")


# The CUDA targets of a build with no GPU to build for (a wheel, CI): sm_80 (A100: the mma.sync
# kernels; linear_cross_entropy's cluster kernel is a trap there, and the host takes its stream kernel
# below compute capability 9.0), sm_90a (H100/H200: the wgmma and TMA kernels, FUSEFORGE_SM90A_BUILD)
# and sm_100 with its PTX, which the driver compiles for later GPUs (the mma.sync kernels there; the
# sm_90a-only kernels check the device at run time). docs/install.md, "GPU targets".
PORTABLE_ARCH_LIST = "8.0;9.0a;10.0+PTX"


def decide_cuda(env, gpu_visible: bool, have_nvcc: bool, torch_cuda: bool):
    """(build the CUDA kernels?, the reason, in words): FUSEFORGE_CPU_ONLY=1 / FUSEFORGE_CUDA=0 say no,
    FUSEFORGE_CUDA=1 says yes (an error without nvcc or a CUDA torch); by default, yes when a GPU is
    visible and nvcc and a CUDA torch are there."""
    cpu_only = env.get("FUSEFORGE_CPU_ONLY", "").strip()
    cuda = env.get("FUSEFORGE_CUDA", "").strip()
    for name, value in (("FUSEFORGE_CPU_ONLY", cpu_only), ("FUSEFORGE_CUDA", cuda)):
        if value not in ("", "0", "1"):
            raise SystemExit(f"{name}={value!r}: use 1 or 0")
    if cpu_only == "1" and cuda == "1":
        raise SystemExit("FUSEFORGE_CPU_ONLY=1 and FUSEFORGE_CUDA=1 contradict each other: set one")
    if cpu_only == "1":
        return False, "FUSEFORGE_CPU_ONLY=1"
    if cuda == "0":
        return False, "FUSEFORGE_CUDA=0"
    if cuda == "1":
        if not have_nvcc:
            raise SystemExit("FUSEFORGE_CUDA=1 but no nvcc: install the CUDA toolkit or set CUDA_HOME")
        if not torch_cuda:
            raise SystemExit("FUSEFORGE_CUDA=1 but this torch is a CPU-only build: install a CUDA torch")
        return True, "FUSEFORGE_CUDA=1"
    if not gpu_visible:
        return False, "no GPU visible; FUSEFORGE_CUDA=1 builds the CUDA kernels"
    if not have_nvcc:
        return False, "a GPU is visible but no nvcc was found; install the CUDA toolkit or set CUDA_HOME"
    if not torch_cuda:
        return False, "a GPU is visible but this torch is a CPU-only build"
    return True, "a GPU is visible"


def visible_gpu_capabilities():
    """Compute capabilities (major, minor) of the GPUs this process sees ([] for none; None for one
    whose capability is unknown): from torch, else from
    `nvidia-smi` (a driver older than torch's CUDA hides the GPU from torch, not from nvcc), unless
    CUDA_VISIBLE_DEVICES hides every GPU."""
    import torch
    try:
        if torch.cuda.is_available():
            return sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    except Exception:  # a broken driver: ask nvidia-smi
        pass
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1") or not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    caps = sorted({(int(m[1]), int(m[2])) for m in re.finditer(r"^\s*(\d+)\.(\d+)\s*$", out, re.M)})
    if caps:
        return caps
    try:  # a driver too old to report compute_cap: a GPU is there, its target unknown
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [None] if re.search(r"^GPU \d+:", listed, re.M) else []


def default_arch_list(capabilities) -> str:
    """TORCH_CUDA_ARCH_LIST when it is unset: the visible GPUs' targets (9.0 as 9.0a: the H100's wgmma
    and TMA kernels), else PORTABLE_ARCH_LIST."""
    if not capabilities or None in capabilities:  # None: a GPU whose capability nvidia-smi did not say
        return PORTABLE_ARCH_LIST
    return ";".join(f"{major}.{minor}" + ("a" if (major, minor) == (9, 0) else "") for major, minor in capabilities)


def nvcc_found() -> bool:
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
    # -Wno-maybe-uninitialized: GCC 12 flags its own AVX-512 intrinsics (`__m512i __Y = __Y;`, GCC bug
    # 105593) wherever they are inlined; the same kernels' baseline and AVX2 builds keep the warning.
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c", "-mbmi",
               "-mbmi2", "-mlzcnt", "-mpopcnt", "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512",
               "-Wno-maybe-uninitialized"],
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


def write_build_info(package_dirs, with_cuda: bool, dev_knobs: bool) -> None:
    """fuseforge/_build_info.py: the torch (and CUDA) the extension is compiled against, which
    fuseforge checks at import instead of failing on an undefined symbol under another torch, and
    whether it is a developer build (DEV_KNOBS: the tests that set development knobs run)."""
    import torch
    text = ("# Written by setup.py when the extension is built.\n"
            f"TORCH_VERSION = {torch.__version__!r}\n"
            f"CUDA_VERSION = {(torch.version.cuda if with_cuda else None)!r}\n"
            f"DEV_KNOBS = {dev_knobs!r}\n")
    for d in package_dirs:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "_build_info.py"), "w") as f:
            f.write(text)


class Config:
    """What this build is, decided once (extension()) and read by the build command."""
    with_cuda = False
    reason = ""
    arch_list = None
    debug = False
    dev_knobs = False
    isa_edges = []  # (object, source, flags): added to torch's build.ninja by run_ninja


def shown_path(path: str) -> str:
    path = os.path.abspath(path)
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


def build_temp_name() -> str:
    return ("temp-" + ("cuda" if Config.with_cuda else "cpu") + ("-debug" if Config.debug else "")
            + ("-dev" if Config.dev_knobs else ""))


def run_ninja(build_directory, verbose=False, error_prefix="Error compiling objects for extension", *args, **kwargs):
    """Replaces torch's _run_ninja_build (which runs `ninja -v`: every full command line): adds the
    per-ISA CPU kernels to torch's build.ninja (one graph, so they compile in parallel with the rest
    and are tracked by their header dependencies), then prints one line a compiled file and
    whatever the compilers say. FUSEFORGE_VERBOSE=1 prints the command lines."""
    if Config.isa_edges:
        lines = ["", "rule isa_compile",
                 "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out $post_cflags $isa_flags",
                 "  depfile = $out.d", "  deps = gcc", ""]
        for obj, src, flags in Config.isa_edges:
            lines += [f"build {obj}: isa_compile {src}", f"  isa_flags = {' '.join(flags)}"]
        with open(os.path.join(build_directory, "build.ninja"), "a") as f:
            f.write("\n".join(lines) + "\n")
    verbose_build = os.environ.get("FUSEFORGE_VERBOSE", "0") == "1"
    cmd = ["ninja"] + (["-v"] if verbose_build else [])
    jobs = os.environ.get("MAX_JOBS", "")
    if jobs.isdigit():
        cmd += ["-j", jobs]
    sys.stdout.flush()
    sys.stderr.flush()
    proc = subprocess.Popen(cmd, cwd=build_directory, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")
    for line in proc.stdout:
        m = None if verbose_build else re.match(r"(\[\d+/\d+\]) (.*)", line)
        if m:
            src = re.search(r"\s-c\s+(?:-c\s+)?(\S+)", m[2])
            what = os.path.relpath(src[1], ROOT) if src else m[2].split()[0]
            line = f"{m[1]} {what}\n"
        sys.stdout.write(line)
        sys.stdout.flush()
    if proc.wait() != 0:
        raise RuntimeError(f"{error_prefix}: the compiler's messages are above")


class Build(BuildExtension):
    """torch's BuildExtension with fuseforge's build folder (build/temp-<cpu|cuda>[-debug], shared by
    every route unless `-t` names another), the per-ISA CPU kernel objects (compiled by ninja
    beside the rest: run_ninja), a quiet ninja, and fuseforge/_build_info.py."""

    def initialize_options(self):
        super().initialize_options()
        self.temp_given = None

    def finalize_options(self):
        self.temp_given = self.build_temp is not None  # `build_ext -t DIR`
        super().finalize_options()
        if not self.temp_given:
            self.build_temp = os.path.join(ROOT, "build", build_temp_name())

    def build_extensions(self):
        if not self.use_ninja:
            raise SystemExit("fuseforge builds with ninja: `pip install ninja`")
        print(f"fuseforge {version()}: {'CUDA build for TORCH_CUDA_ARCH_LIST=' + Config.arch_list if Config.with_cuda else 'CPU-only build'}"
              f"{', developer knobs' if Config.dev_knobs else ''} "
              f"({Config.reason}), {os.environ.get('MAX_JOBS') or 'ninja default'} jobs, in "
              f"{shown_path(self.build_temp)}", flush=True)
        write_build_info({os.path.join(ROOT, "python", "fuseforge"), os.path.join(self.build_lib, "fuseforge")},
                         Config.with_cuda, Config.dev_knobs)
        Config.isa_edges = []
        for ext in self.extensions:
            for src in isa_sources():
                obj = os.path.join(os.path.abspath(self.build_temp), "isa", os.path.splitext(src)[0] + ".o")
                os.makedirs(os.path.dirname(obj), exist_ok=True)
                ext.extra_objects.append(obj)
                Config.isa_edges.append((obj, os.path.join(ROOT, src), ISA_FLAGS[isa_of(src)]))
        cpp_extension._run_ninja_build = run_ninja
        super().build_extensions()


def sm90a_only_sm90_target(arch_list: str) -> bool:
    """Whether an H100 runs this build's sm_90a code: the list has 9.0a and no plain 9.0 (whose code,
    or PTX, the driver could load instead). The host side then may launch the kernels written for
    sm_90a only (FUSEFORGE_SM90A_BUILD, csrc/attention/sm90/attention_fwd_warpspec.cuh)."""
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
    import torch
    # The visible GPUs decide both whether to build CUDA (unless told) and, in a CUDA build, the
    # default targets: FUSEFORGE_CUDA=1 on the GPU machine still builds for its GPU only.
    cpu_only = os.environ.get("FUSEFORGE_CPU_ONLY") == "1" or os.environ.get("FUSEFORGE_CUDA") == "0"
    capabilities = [] if cpu_only else visible_gpu_capabilities()
    with_cuda, reason = decide_cuda(os.environ, bool(capabilities), nvcc_found(), torch.version.cuda is not None)
    debug = os.environ.get("FUSEFORGE_DEBUG", "0") == "1"
    dev_knobs = os.environ.get("FUSEFORGE_DEV", "0") == "1"
    Config.with_cuda, Config.reason, Config.debug, Config.dev_knobs = with_cuda, reason, debug, dev_knobs
    # -fopenmp: at::parallel_for is inline and runs in parallel only in code built with OpenMP (torch's
    # CPU backend); without it every CPU kernel here ran on one thread. -ffp-contract=off: the CPU
    # kernels' AVX2/AVX-512 builds would otherwise fuse a * b - c into an fma where the baseline build
    # cannot, and round differently (explicit fmas, at::vec::fmadd and std::fma, stay fused).
    # -g0: Python's CFLAGS carry -g, which made the host code's compile 1.75x slower and a 9 MB object of
    # a 350 KB one; FUSEFORGE_DEBUG=1 keeps it. -Wno-psabi: GCC's note that passing a 32-byte
    # at::vec::Vectorized by value changed ABI in GCC 4.6 (our kernels' helpers, internal linkage).
    cxx = ["-O0" if debug else "-O3", "-std=c++20", "-fopenmp", "-ffp-contract=off", "-g" if debug else "-g0",
           "-Wno-psabi"] + (["-DFUSEFORGE_DEV_KNOBS"] if dev_knobs else [])
    depends = [f for pattern in ("*.h", "*.cuh", "*.cpp", "*.cu")
               for f in glob.glob(os.path.join(CSRC, "**", pattern), recursive=True)]
    ours = os.path.join(ROOT, CSRC)

    def system_includes(ext):
        # torch's and CUDA's headers (which torch's CppExtension puts on the -I path) are passed as
        # -isystem: their warnings are not ours to fix, and they buried our own.
        system = [d for d in ext.include_dirs if d != ours] + cuda_library_includes()
        ext.include_dirs = [ours]
        for key in ext.extra_compile_args:
            ext.extra_compile_args[key] += [a for d in system for a in ("-isystem", d)]
        return ext

    if not with_cuda:
        return system_includes(CppExtension(
            "fuseforge._C", sources(False), extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"],
            include_dirs=[ours], depends=depends, py_limited_api=True))
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = default_arch_list(capabilities)
    Config.arch_list = os.environ["TORCH_CUDA_ARCH_LIST"]
    arch_defines = ["-DFUSEFORGE_SM90A_BUILD"] if sm90a_only_sm90_target(Config.arch_list) else []
    nvcc = NVCC_FLAGS + ["--threads=2"] + (["-DFUSEFORGE_DEV_KNOBS"] if dev_knobs else [])
    if debug:
        nvcc.append("-lineinfo")
    nvcc += os.environ.get("FUSEFORGE_NVCC_FLAGS", "").split()
    return system_includes(CUDAExtension(
        "fuseforge._C", sources(True),
        extra_compile_args={"cxx": cxx + ["-DFUSEFORGE_WITH_CUDA"] + arch_defines,
                            "nvcc": nvcc + ["-DFUSEFORGE_WITH_CUDA"] + arch_defines},
        include_dirs=[ours], depends=depends, extra_link_args=["-fopenmp"], py_limited_api=True))


if __name__ == "__main__":
    setup(
        name="fuseforge",
        version=version(),
        description="Fused CUDA kernels for training PyTorch models",
        package_dir={"": "python"},
        packages=find_packages("python"),
        package_data={"fuseforge": ["VERSION"]},
        ext_modules=[extension()],
        cmdclass={"build_ext": Build},
        options={"bdist_wheel": {"py_limited_api": "cp39"}},
        python_requires=">=3.10",
        install_requires=["torch>=2.11"],
    )
