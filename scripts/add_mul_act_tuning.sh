#!/usr/bin/env bash
# GPU machine: builds add_mul_act in several kernel variants (compile-time knobs in
# add_mul_act_kernel.cuh) into separate folders and times each on the same cases, one after the
# other in this call. Usage: bash scripts/add_mul_act_tuning.sh "name:flags" ... (flags: nvcc -D...)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
source scripts/device_env.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python FUSEFORGE_OPS=add_mul_act
CASES=${CASES:-16384x8192/bf16/relu,16384x8192/bf16/gelu,16384x8192/fp32/relu,16384x8192/fp32/gelu}
for variant in "$@"; do
  name=${variant%%:*}; flags=${variant#*:}
  t0=$(date +%s)
  FUSEFORGE_NVCC_FLAGS="$flags" MAX_JOBS=16 python3 setup.py -q build_ext -b /tmp/ama_$name/lib -t /tmp/ama_$name/tmp \
    > "$OUT/build_$name.log" 2>&1 || { echo "$name: build failed"; tail -5 "$OUT/build_$name.log"; continue; }
  echo "== $name ($flags) built in $(( $(date +%s) - t0 )) s"
  FUSEFORGE_EXTENSION=$(ls /tmp/ama_$name/lib/fuseforge/_C*.so) python3 benchmarks/bench_add_mul_act.py \
    --cases "$CASES" --no-memory --out /tmp/ama_res_$name > "$OUT/bench_$name.log" 2>&1
  grep -E "^\| 16384" /tmp/ama_res_$name/add_mul_act.md | awk -F'|' '{print $2,$3,$4,$6,$9}'
done
