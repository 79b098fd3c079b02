"""Installs what fuseforge's build, tests and demo need when it is missing (a fresh machine):
Python packages with pip, and GoogleTest (the C++ tests) with apt-get where it can; installs nothing
when all is there (the GPU machine, which cannot download)."""
import importlib.util
import os
import shutil
import subprocess
import sys

TORCH_PIN = "torch==2.14.1"  # the CUDA 13 build; a file on the development machines' disk
NEEDED = {"torch": TORCH_PIN, "pytest": "pytest", "ninja": "ninja", "numpy": "numpy", "matplotlib": "matplotlib",
          "transformers": "transformers"}
GTEST_HEADERS = ("/usr/include/gtest/gtest.h", "/usr/local/include/gtest/gtest.h")


def python_packages() -> int:
    missing = [spec for mod, spec in NEEDED.items() if importlib.util.find_spec(mod) is None]
    if not shutil.which("cmake"):
        missing.append("cmake")
    if not missing:
        return 0
    print(f"installing {' '.join(missing)}", flush=True)
    return subprocess.call([sys.executable, "-m", "pip", "install", "-q", *missing])


def googletest() -> int:
    if any(os.path.exists(h) for h in GTEST_HEADERS):
        return 0
    if not shutil.which("apt-get"):
        print("GoogleTest is missing and there is no apt-get: install libgtest-dev (or GTest for CMake) "
              "to run the C++ tests", file=sys.stderr)
        return 1
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    print("installing libgtest-dev (apt-get)", flush=True)
    quiet = {"stdout": subprocess.DEVNULL}
    if subprocess.call(sudo + ["apt-get", "update", "-qq"], **quiet) != 0:
        return 1
    return subprocess.call(sudo + ["apt-get", "install", "-y", "-qq", "libgtest-dev"], **quiet)


def main() -> int:
    rc = python_packages()
    if rc == 0 and "--gtest" in sys.argv[1:]:
        rc = googletest()
    return rc


if __name__ == "__main__":
    sys.exit(main())
