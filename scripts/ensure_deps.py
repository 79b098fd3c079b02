"""Installs what fuseforge's build, tests and demo need when it is missing (a fresh machine);
installs nothing when all is there (the GPU machine, which cannot download)."""
import importlib.util
import subprocess
import sys

TORCH_PIN = "torch==2.14.1"  # the CUDA 13 build; a file on the development machines' disk
NEEDED = {"torch": TORCH_PIN, "pytest": "pytest", "ninja": "ninja", "numpy": "numpy", "matplotlib": "matplotlib",
          "transformers": "transformers"}


def main() -> int:
    missing = [spec for mod, spec in NEEDED.items() if importlib.util.find_spec(mod) is None]
    if not missing:
        return 0
    print(f"installing {' '.join(missing)}", flush=True)
    return subprocess.call([sys.executable, "-m", "pip", "install", "-q", *missing])


if __name__ == "__main__":
    sys.exit(main())
