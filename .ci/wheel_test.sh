#!/usr/bin/env bash
# The wheel in dist/ (make wheel), tested as a user gets it: installed into a fresh virtual environment
# that sees the system's torch (--system-site-packages) but no fuseforge, and the Python tests run from
# a copy of tests/, examples/, benchmarks/ and scripts/ outside the source tree (no python/, no csrc/):
# a file the wheel lacks fails them. Run it outside make, which exports PYTHONPATH=python. Arguments:
# pytest's (default: tests/python).
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONPATH
src=$PWD
wheels=(dist/fuseforge-"$(cat python/fuseforge/VERSION)"-cp39-abi3-*.whl)
[ ${#wheels[@]} -eq 1 ] && [ -f "${wheels[0]}" ] || { echo "wheel_test: want one fuseforge wheel in dist/, have: ${wheels[*]}"; exit 1; }
tmp=$(mktemp -d /tmp/fuseforge_wheel_test.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
python3 -m venv --system-site-packages "$tmp/venv"
py=$tmp/venv/bin/python
mkdir "$tmp/src"
cp -r tests examples benchmarks scripts pyproject.toml "$tmp/src/"
cd "$tmp/src"
# Nothing may provide fuseforge but the wheel: not an editable install or a copy in the system's
# site-packages, not PYTHONPATH.
if "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('fuseforge') is None)"; then
  echo "wheel_test: fuseforge is importable before the wheel is installed:"
  "$py" -c "import fuseforge; print(fuseforge.__file__)" || true
  exit 1
fi
# --no-deps: torch is the system's (the venv's own older setuptools would not satisfy torch's metadata)
"$py" -m pip install -q --no-index --no-deps "$src/${wheels[0]}"
"$py" - "$tmp/venv" <<'PY'
import os, sys
import fuseforge
where = os.path.realpath(fuseforge.__file__)
assert where.startswith(os.path.realpath(sys.argv[1])), f"fuseforge imported from {where}, not the wheel"
print(f"fuseforge {fuseforge.__version__} from {os.path.dirname(where)}, CUDA kernels: {fuseforge.cuda_built()}")
PY
"$py" -m pytest -q -p no:cacheprovider "${@:-tests/python}"
