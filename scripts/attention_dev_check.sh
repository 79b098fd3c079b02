#!/usr/bin/env bash
# Development run of the attention op on the GPU machine, in one call: build (attention only),
# every attention test without stopping at the first failure, compute-sanitizer memcheck and
# racecheck on the `sanitize` tests, then the benchmark. Each stage has a time cap so the results
# come back inside the device call's limit. Logs and results go to $OUT.
#   bash scripts/attention_dev_check.sh [--tests EXPR] [--bench-args "..."] [--no-bench] [--no-sanitizer]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
TESTS="" BENCH_ARGS="" BENCH=1 SANITIZE=1 PYTEST_CAP=${PYTEST_CAP:-150}
while [ $# -gt 0 ]; do
  case "$1" in
    --tests) TESTS=$2; shift 2 ;;
    --bench-args) BENCH_ARGS=$2; shift 2 ;;
    --no-bench) BENCH=0; shift ;;
    --no-sanitizer) SANITIZE=0; shift ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
done
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python FUSEFORGE_OPS=attention
L=$(mktemp -d)  # logs, packed into $OUT/logs.tgz at exit (the device tool returns few files)
trap 'tar czf "$OUT/logs.tgz" -C "$L" .' EXIT
S=$OUT/summary.txt
echo "== $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD -- csrc python 2>/dev/null || echo -dirty)" | tee "$S"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$S"
t0=$(date +%s)
MAX_JOBS=16 timeout 200 python3 setup.py -q build_ext --inplace > "$L/build.log" 2>&1
rc=$?
echo "build: rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$S"
if [ $rc -ne 0 ]; then grep -E "error" "$L/build.log" | head -30 | tee -a "$S"; exit 1; fi
t0=$(date +%s)
timeout $PYTEST_CAP python3 -m pytest -q -rs tests/python/test_attention.py ${TESTS:+-k "$TESTS"} > "$L/pytest.log" 2>&1
echo "pytest: rc=$? in $(( $(date +%s) - t0 )) s: $(tail -1 "$L/pytest.log")" | tee -a "$S"
grep -E "^(FAILED|ERROR)|Error:|assert .* <=|> 2 x" "$L/pytest.log" | head -40 | tee -a "$S"
if [ -n "${EXTRA_TESTS:-}" ]; then  # a second pytest process (e.g. tests that may crash the first)
  timeout 90 python3 -m pytest -q -rs tests/python/test_attention.py -k "$EXTRA_TESTS" > "$L/pytest_extra.log" 2>&1
  echo "pytest -k '$EXTRA_TESTS': rc=$?: $(tail -1 "$L/pytest_extra.log" | cut -c1-200)" | tee -a "$S"
  grep -E "^(FAILED|ERROR)|Error:|in test_" "$L/pytest_extra.log" | head -10 | tee -a "$S"
fi
if [ $BENCH -eq 1 ]; then
  t0=$(date +%s)
  python3 benchmarks/bench_attention.py --out "$OUT" $BENCH_ARGS > "$L/bench.log" 2>&1
  echo "bench: rc=$? in $(( $(date +%s) - t0 )) s" | tee -a "$S"
  [ -f "$OUT/attention.md" ] && cat "$OUT/attention.md" | tee -a "$S"
  tail -5 "$L/bench.log" | tee -a "$S"
fi
if [ $SANITIZE -eq 1 ]; then
  for tool in memcheck racecheck; do
    t0=$(date +%s)
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SANITIZER_CAP:-60} compute-sanitizer --tool $tool --error-exitcode 99 \
      python3 -m pytest -q -x -m sanitize tests/python/test_attention.py > "$L/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool: rc=$? in $(( $(date +%s) - t0 )) s: $(grep -E 'ERROR SUMMARY|passed|failed' "$L/sanitizer_$tool.log" | tail -2 | tr '\n' ' ')" | tee -a "$S"
    grep -m 12 -E "Invalid|Race|hazard|at 0x|by thread" "$L/sanitizer_$tool.log" | tee -a "$S"
  done
fi
echo "== done" | tee -a "$S"
