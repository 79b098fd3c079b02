#!/usr/bin/env bash
# linear_cross_entropy development run on the GPU machine (one device call): build this op, tests,
# compute-sanitizer, a kernel-time profile and benchmark cases; every log lands in $OUT.
#   bash scripts/lce_dev.sh [stages] [bench cases] [bench seconds]
#   stages: comma list of build,test,bench,profile,memcheck,racecheck (default: all, in that order)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT/results"
STAGES=${1:-build,test,bench,profile,memcheck,racecheck}
CASES=${2:-8192x}
BENCH_T=${3:-170}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python FUSEFORGE_OPS=linear_cross_entropy
# As gpu_check.sh: the image's CXX wrapper links libstdc++ statically and crashes on the first error
# message; build with the system compiler.
if [ "${CXX:-}" = /opt/gcc/bin/g++ ] && [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
export FUSEFORGE_COMMIT=${FUSEFORGE_COMMIT:-unknown}
TEST_K=${TEST_K:-}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
has() { [[ ",$STAGES," == *",$1,"* ]]; }
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
if has build; then
  MAX_JOBS=16 python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { grep -E "error" "$OUT/build.log" | head -30; exit 1; }
  stamp "build ok"
fi
if has test; then
  timeout 120 python3 -m pytest -q -rs --durations=8 tests/python/test_linear_cross_entropy.py ${TEST_K:+-k "$TEST_K"} > "$OUT/pytest.log" 2>&1
  stamp "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|^E " "$OUT/pytest.log" | head -40
fi
if has profile; then
  timeout 60 python3 scripts/lce_profile.py > "$OUT/profile.log" 2>&1
  stamp "profile rc=$?"; cat "$OUT/profile.log" | tail -40
fi
if has bench; then
  timeout "$BENCH_T" python3 benchmarks/bench_linear_cross_entropy.py --out "$OUT/results" --cases "$CASES" > "$OUT/bench.log" 2>&1
  stamp "bench rc=$?"; grep -E "accuracy|fwd|OOM|Error|error" "$OUT/bench.log" | cut -c1-250 | tail -60
fi
for tool in memcheck racecheck; do
  if has $tool; then
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 45 compute-sanitizer --tool $tool --error-exitcode 99 \
      python3 -m pytest -q -x -m sanitize tests/python/test_linear_cross_entropy.py > "$OUT/$tool.log" 2>&1
    stamp "$tool rc=$?: $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/$tool.log" | tail -2 | tr '\n' ' ')"
  fi
done
stamp done
