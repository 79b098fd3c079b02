#!/usr/bin/env bash
# AdamW device run: build (adamw only), tests, compute-sanitizer, benchmark; logs and results in $OUT.
#   STAGES=tests,sanitize,bench bash scripts/adamw_device.sh [pytest -k expr] [bench args...]
# The build always runs. Everything fits one 420 s call only without the compile impl
# (ADAMW_BENCH_COMPILE=0); with it, run "tests,sanitize" and "bench" as two calls.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
STAGES=${STAGES:-tests,sanitize,bench}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python FUSEFORGE_OPS=adamw
K=${1:-}; shift || true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "commit $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD -- csrc python 2>/dev/null || echo -dirty)"
t0=$(date +%s)
MAX_JOBS=16 python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { grep -E "error" -A3 "$OUT/build.log" | head -40; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
if [[ $STAGES == *tests* ]]; then
  t0=$(date +%s)
  timeout 170 python3 -m pytest -q -rs --timeout=160 tests/python/test_adamw.py ${K:+-k "$K"} > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/pytest.log")"
  grep -E "^(FAILED|ERROR)|^E   " "$OUT/pytest.log" | head -30
fi
if [[ $STAGES == *sanitize* ]]; then
  for tool in memcheck racecheck; do
    t0=$(date +%s)
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 90 compute-sanitizer --tool $tool --error-exitcode 99 \
      python3 -m pytest -q -x -m sanitize tests/python/test_adamw.py > "$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool rc=$? $(( $(date +%s) - t0 )) s: $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/sanitizer_$tool.log" | tail -2 | tr '\n' ' ')"
  done
fi
if [[ $STAGES == *bench* ]]; then
  t0=$(date +%s)
  timeout 330 python3 benchmarks/bench_adamw.py --out "$OUT" "$@" > "$OUT/bench.log" 2>&1
  echo "bench rc=$? $(( $(date +%s) - t0 )) s"
  grep -E "Error|error" "$OUT/bench.log" | head -10
  cat "$OUT/adamw.md" 2>/dev/null
fi
