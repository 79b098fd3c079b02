#!/usr/bin/env bash
# GPU machine: times variants of one op's kernels side by side in one call (docs/DEVELOPING.md).
#   bash scripts/tune_variants.sh OP "name:spec" ...
#   spec "-DKNOB=value ..."  compile-time knobs: a private build of OP with these nvcc flags
#   spec "VAR=value ..."     run-time knobs: environment for a run of the shared build of OP
#                            (built once, with $BASE_FLAGS, e.g. -DFUSEFORGE_ADAMW_TUNING)
# Env: CASES (the benchmark's --cases), IMPLS (its --impls; default fuseforge), BASE_FLAGS.
# Prints each variant's rows of benchmarks/bench_OP.py's table; logs in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
source scripts/device_env.sh
OP=$1; shift
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python FUSEFORGE_OPS=$OP ADAMW_BENCH_COMPILE=${ADAMW_BENCH_COMPILE:-0}
IMPLS=${IMPLS:-fuseforge}
build() {  # build NAME FLAGS -> prints the library's path
  local t0; t0=$(date +%s)
  FUSEFORGE_NVCC_FLAGS="$2" MAX_JOBS=16 python3 setup.py -q build_ext -b /tmp/tune_$1/lib -t /tmp/tune_$1/tmp \
    > "$OUT/build_$1.log" 2>&1 || { echo "$1: build failed" >&2; tail -5 "$OUT/build_$1.log" >&2; return 1; }
  echo "== $1 built in $(( $(date +%s) - t0 )) s" >&2
  ls /tmp/tune_$1/lib/fuseforge/_C*.so
}
shared=""
for variant in "$@"; do
  name=${variant%%:*}; spec=${variant#*:}
  if [ "${spec#-}" != "$spec" ]; then
    lib=$(build "$name" "$spec") || continue; envs=""
  else
    [ -n "$shared" ] || shared=$(build shared "${BASE_FLAGS:-}") || exit 1
    lib=$shared; envs=$spec
  fi
  echo "== $name ($spec)"
  env $envs FUSEFORGE_EXTENSION="$lib" python3 benchmarks/bench_$OP.py --cases "${CASES:-}" --impls "$IMPLS" \
    --no-memory --out /tmp/tune_res_$name > "$OUT/bench_$name.log" 2>&1 || { tail -5 "$OUT/bench_$name.log"; continue; }
  grep -E "^\| [^c-]" /tmp/tune_res_$name/$OP.md | awk -F'|' '{print $2,$3,$4,$5}'
done
