#!/usr/bin/env bash
# One GPU-machine run for the end-to-end step: build every op, the e2e benchmark (bench_e2e.py), the
# patch/model/demo tests (CPU and CUDA), and a short GPU run of the demo, inside a time budget.
#
#   bash scripts/e2e_gpu.sh [--budget SECONDS] [--impls eager,liger,fuseforge,...] [--bench-args "..."]
#                           [--demo-steps N] [--no-tests] [--no-demo]
# Results come back in $OUT: summary.txt, e2e.{json,md,png}, e2e_loss.png, logs.tgz (all logs and
# the demo's outputs). Each stage gets what is left of the budget, so a slow stage (torch.compile)
# cannot take the others' results with it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
BUDGET=400 IMPLS=eager,liger,fuseforge,fuseforge_bf16,compile,fuseforge_compile BENCH_ARGS="" DEMO_STEPS=120 TESTS=1 DEMO=1
while [ $# -gt 0 ]; do
  case "$1" in
    --budget) BUDGET=$2; shift 2 ;;
    --impls) IMPLS=$2; shift 2 ;;
    --bench-args) BENCH_ARGS=$2; shift 2 ;;
    --demo-steps) DEMO_STEPS=$2; shift 2 ;;
    --no-tests) TESTS=0; shift ;;
    --no-demo) DEMO=0; shift ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
done
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python
source scripts/device_env.sh  # the build's compiler (as gpu_check.sh), FUSEFORGE_COMMIT, the peers' wheels
WORK=$(mktemp -d)
mkdir -p "$OUT" "$WORK/logs" "$WORK/results"
T0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
summary() { echo "$*" | tee -a "$WORK/logs/summary.txt"; }
pack() {
  cp "$WORK"/results/e2e*.json "$WORK"/results/e2e*.md "$WORK"/results/e2e*.png "$OUT"/ 2>/dev/null
  cp "$WORK/logs/summary.txt" "$OUT/summary.txt" 2>/dev/null
  tar czf "$OUT/logs.tgz" -C "$WORK" logs 2>/dev/null
}
trap pack EXIT

# FUSEFORGE_COMMIT (device_env.sh): pass the sha as a literal in the command (bench_e2e records it).
summary "== $(date -u +%FT%TZ) commit $FUSEFORGE_COMMIT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$WORK/logs/summary.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$WORK/logs/summary.txt"

FUSEFORGE_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} python3 setup.py -q build_ext --inplace > "$WORK/logs/build.log" 2>&1
rc=$?
summary "build: rc=$rc in $(( $(date +%s) - T0 )) s"
if [ $rc -ne 0 ]; then grep -E "error|Error" "$WORK/logs/build.log" | head -40; exit 1; fi

# The benchmark first (it is what the bars are read from); it writes its JSON after every impl.
reserve=$(( (TESTS + DEMO) * 45 ))
t=$(( $(left) - reserve )); [ $t -lt 60 ] && t=60
t1=$(date +%s)
timeout -k 5 $t python3 benchmarks/bench_e2e.py --out "$WORK/results" --impls "$IMPLS" $BENCH_ARGS > "$WORK/logs/bench_e2e.log" 2>&1
rc=$?
summary "bench e2e: rc=$rc in $(( $(date +%s) - t1 )) s (limit $t s)"
grep -E "probe|e2e:|step .* ms|out of memory|bars|Error|error" "$WORK/logs/bench_e2e.log" | tail -20 | tee -a "$WORK/logs/summary.txt"
cat "$WORK"/results/e2e*.md 2>/dev/null | tee -a "$WORK/logs/summary.txt"

if [ $TESTS -eq 1 ]; then
  t=$(( $(left) - DEMO * 40 )); [ $t -lt 30 ] && t=30
  t1=$(date +%s)
  timeout -k 5 $t python3 -m pytest -q -rs tests/python/test_patch.py tests/python/test_models.py tests/python/test_demo.py \
    > "$WORK/logs/pytest.log" 2>&1
  rc=$?
  summary "pytest (patch, models, demo): rc=$rc in $(( $(date +%s) - t1 )) s: $(tail -1 "$WORK/logs/pytest.log")"
  [ $rc -ne 0 ] && grep -E "^(FAILED|ERROR)|^E " "$WORK/logs/pytest.log" | head -20 | tee -a "$WORK/logs/summary.txt"
fi

if [ $DEMO -eq 1 ]; then
  t=$(( $(left) - 5 )); [ $t -lt 20 ] && t=20
  t1=$(date +%s)
  timeout -k 5 $t python3 examples/demo.py --steps "$DEMO_STEPS" --eval-every 40 --log-every 20 --out "$WORK/logs/demo" \
    > "$WORK/logs/demo.log" 2>&1
  rc=$?
  summary "demo (GPU preset, $DEMO_STEPS steps): rc=$rc in $(( $(date +%s) - t1 )) s"
  grep -A5 -E "^model " "$WORK/logs/demo.log" | tee -a "$WORK/logs/summary.txt"
  [ $rc -ne 0 ] && tail -15 "$WORK/logs/demo.log"
fi
summary "== done in $(( $(date +%s) - T0 )) s"
