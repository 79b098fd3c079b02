#!/usr/bin/env bash
# One run on the GPU machine: build, tests, compute-sanitizer, benchmarks. Logs and results go to
# $OUT, packed into two archives and a summary.
#
#   bash scripts/gpu_check.sh [--ops a,b] [--files "f g"] [--tests EXPR] [--no-tests] [--no-sanitizer]
#                             [--bench a,b] [--bench-args "..."] [--no-cpp]
#   --ops      op folders of csrc/ to build (FUSEFORGE_OPS; default all) and test files to run
#   --files    test files to run instead of the ops' (e.g. every op but attention on a full build)
#   --tests    pytest -k expression (default: every test of the chosen ops)
#   --bench    benchmarks/bench_<name>.py to run (default: none; "all" for every one)
#   --bench-args extra arguments for every benchmark (e.g. "--cases D64")
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT" logs_tmp results_tmp
OPS="" FILES="" TESTS="" RUN_TESTS=1 SANITIZE=1 BENCH="" BENCH_ARGS="" CPP=1
while [ $# -gt 0 ]; do
  case "$1" in
    --ops) OPS=$2; shift 2 ;;
    --files) FILES=$2; shift 2 ;;
    --tests) TESTS=$2; shift 2 ;;
    --no-tests) RUN_TESTS=0; shift ;;
    --no-sanitizer) SANITIZE=0; shift ;;
    --bench) BENCH=$2; shift 2 ;;
    --bench-args) BENCH_ARGS=$2; shift 2 ;;
    --no-cpp) CPP=0; shift ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
done
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python FUSEFORGE_OPS=$OPS
source scripts/device_env.sh  # system g++ instead of the image's static-libstdc++ wrapper
LOG=logs_tmp
# pack() runs after every step, not only at exit: a run cut short by a time limit keeps what
# finished.
summary() { echo "$*" | tee -a "$LOG/summary.txt"; }
pack() {
  tar czf "$OUT/logs.tgz" -C logs_tmp . 2>/dev/null
  [ -n "$(ls results_tmp 2>/dev/null)" ] && tar czf "$OUT/results.tgz" -C results_tmp .
  cp "$LOG/summary.txt" "$OUT/summary.txt" 2>/dev/null
  return 0
}
trap pack EXIT

# FUSEFORGE_COMMIT (device_env.sh): pass the sha as a literal in the command.
summary "== $(date -u +%FT%TZ) commit $FUSEFORGE_COMMIT ops=${OPS:-all}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG/summary.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG/summary.txt"

t0=$(date +%s)
FUSEFORGE_CUDA=1 FUSEFORGE_DEV=1 MAX_JOBS=${MAX_JOBS:-16} python3 setup.py -q build_ext --inplace > "$LOG/build.log" 2>&1
rc=$?
summary "build: rc=$rc in $(( $(date +%s) - t0 )) s"; pack
if [ $rc -ne 0 ]; then grep -E "error|Error" "$LOG/build.log" | head -40; exit 1; fi

test_files=""
if [ -n "$FILES" ]; then
  test_files=$FILES
elif [ -n "$OPS" ]; then
  for op in ${OPS//,/ }; do for f in tests/python/test_$op.py tests/python/test_${op}_*.py; do [ -f "$f" ] && test_files="$test_files $f"; done; done
else
  test_files="tests/python"
fi

if [ $RUN_TESTS -eq 1 ] && [ -n "$test_files" ]; then
  t0=$(date +%s)
  python3 -m pytest -q -rs --timeout=600 $test_files ${TESTS:+-k "$TESTS"} > "$LOG/pytest.log" 2>&1
  rc=$?
  summary "pytest: rc=$rc in $(( $(date +%s) - t0 )) s: $(tail -1 "$LOG/pytest.log")"; pack
  [ $rc -ne 0 ] && grep -E "^(FAILED|ERROR)|Error|assert" "$LOG/pytest.log" | head -30
  if [ $rc -eq 139 ] || grep -q "Segmentation fault" "$LOG/pytest.log"; then
    grep -A3 "Current thread" "$LOG/pytest.log" | head -8
    summary "NOTE: segfault. For a native stack: cuda-gdb -batch -ex run -ex bt --args python3 -c '<repro>'"
  fi
fi

if [ $SANITIZE -eq 1 ] && [ -n "$test_files" ]; then
  # No caching allocator: every allocation is exact, so memcheck sees out-of-bounds accesses.
  for tool in memcheck racecheck; do
    t0=$(date +%s)
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool $tool --error-exitcode 99 \
      python3 -m pytest -q -x -m sanitize $test_files > "$LOG/sanitizer_$tool.log" 2>&1
    rc=$?
    summary "compute-sanitizer $tool: rc=$rc in $(( $(date +%s) - t0 )) s: $(grep -E 'SUMMARY|passed|failed' "$LOG/sanitizer_$tool.log" | tail -2 | tr '\n' ' ')"; pack
  done
fi

if [ $CPP -eq 1 ] && [ -z "$OPS" ]; then
  t0=$(date +%s)
  (cmake -S . -B build/cpp -G Ninja -DCMAKE_PREFIX_PATH="$(python3 -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')" \
     -DCMAKE_BUILD_TYPE=Release && cmake --build build/cpp -j 16 && ctest --test-dir build/cpp --output-on-failure) > "$LOG/ctest.log" 2>&1
  summary "googletest: rc=$? in $(( $(date +%s) - t0 )) s: $(grep -E 'tests passed|tests failed' "$LOG/ctest.log" | tail -1)"; pack
fi

if [ -n "$BENCH" ]; then
  if [ "$BENCH" = all ]; then BENCH=$(ls benchmarks/bench_*.py | sed 's#benchmarks/bench_##; s#\.py##' | tr '\n' ','); fi
  for b in ${BENCH//,/ }; do
    t0=$(date +%s)
    python3 benchmarks/bench_$b.py --out results_tmp $BENCH_ARGS > "$LOG/bench_$b.log" 2>&1
    rc=$?
    summary "bench $b: rc=$rc in $(( $(date +%s) - t0 )) s"; pack
    cat results_tmp/${b}_*.md 2>/dev/null | tee -a "$LOG/summary.txt"
    [ $rc -ne 0 ] && tail -20 "$LOG/bench_$b.log"
  done
fi
summary "== done"
