#!/usr/bin/env bash
# GPU machine, one call (~8-9 min): measures the kernel candidates that are in the tree but off by
# default, and the profiles that say where the remaining time goes. Written on 2026-11-23 when no
# device could be had; the candidates' notes are in docs/notes_<op>.md ("Candidates").
#   FUSEFORGE_COMMIT=<sha> bash scripts/tuning_probe.sh      (output in $OUT/probe.log)
#   PARTS="tests time" bash scripts/tuning_probe.sh         (a subset: build tests time profile e2e lce;
#                                                           every part builds what it lacks first)
# Measured 2026-11-23 (third session): builds 107 s, "time" ~6 min with the AdamW shapes it then had.
# 1. builds (in parallel): AdamW, add_mul_act (and a backward shape),
#    linear_cross_entropy
# 2. A/B timings with tune_variants.sh, the default beside each candidate, same process order
# 3. the candidates' GPU tests (TEST_K: a pytest -k filter; TEST_TIMEOUT per file); timings come
#    first so that a call cut short still brings them back
# 4. lce_profile.py --quick (idle gaps between kernels, host time a step) and ncu of the
#    add_mul_act backward and the AdamW kernel (stall reasons, achieved bandwidth, occupancy)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/probe.log") 2>&1
source scripts/device_env.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
T=scripts/tune_variants.sh
AMA=(default: uncapped:FUSEFORGE_AMA_BWD_BLOCKS_PER_SM=32 fwd_cap1:FUSEFORGE_AMA_FWD_BLOCKS_PER_SM=1
     bwd_rows8:-DFUSEFORGE_AMA_BWD_ROWS_32BIT=8)
LCE=(default:)
ADAMW=(c64k: c16k:FUSEFORGE_ADAMW_CHUNK_ELEMS=16384 c64k_cap1:FUSEFORGE_ADAMW_BLOCKS_PER_SM=1
       "c16k_cap1:FUSEFORGE_ADAMW_CHUNK_ELEMS=16384 FUSEFORGE_ADAMW_BLOCKS_PER_SM=1")
PARTS=${PARTS:-build tests time profile e2e lce}
has() { [[ " $PARTS " == *" $1 "* ]]; }
t0=$(date +%s)
mkdir -p /tmp/tune/logs
# The timed variants' JSON/markdown (each records GPU, torch and FUSEFORGE_COMMIT) and the logs, in
# one archive, also when the call is cut short.
pack() { (cd /tmp/tune && tar czf "$OUT/tune_results.tgz" logs $(ls -d */res_* 2>/dev/null)) 2>/dev/null; }
trap pack EXIT
# Wait on these pids by name: a bare `wait` would also wait for the tee above, which never ends.
pids=()
MAX_JOBS=4 BUILD_ONLY=1 bash $T adamw "${ADAMW[@]}" & pids+=($!)
MAX_JOBS=6 BUILD_ONLY=1 bash $T add_mul_act "${AMA[@]}" & pids+=($!)
has lce && { MAX_JOBS=4 BUILD_ONLY=1 bash $T linear_cross_entropy "${LCE[@]}" & pids+=($!); }
# every op in place, for the end-to-end profile
has e2e && { MAX_JOBS=8 python3 setup.py -q build_ext --inplace > /tmp/tune/logs/build_all.log 2>&1 & pids+=($!); }
wait "${pids[@]}"
echo "== builds: $(( $(date +%s) - t0 )) s"
lib() { ls /tmp/tune/$1/$2/lib/fuseforge/_C*.so; }
pt() { timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -x -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} "$@" 2>&1 | tail -2; }
if has time; then
echo "== timings ($(( $(date +%s) - t0 )) s)"
CASES=llama1b IMPLS=fuseforge,torch_fused bash $T adamw "${ADAMW[@]}"
# fuseforge only: the compile baselines are in benchmarks/results/<op>.json (same GPU)
CASES=16384x8192 bash $T add_mul_act "${AMA[@]}"
fi
if has tests; then
echo "== tests: add_mul_act backward prefetching the next trip"
FUSEFORGE_EXTENSION=$(lib add_mul_act prefetch) pt tests/python/test_add_mul_act.py
fi
if has e2e; then
echo "== e2e profile ($(( $(date +%s) - t0 )) s)"
timeout 200 python3 scripts/e2e_profile.py --impls ${E2E_IMPLS:-eager,fuseforge} --batch 6 2>&1 | grep -v Warning
fi
if has lce; then
echo "== lce profile (default build) ($(( $(date +%s) - t0 )) s)"
FUSEFORGE_EXTENSION=$(lib linear_cross_entropy shared) timeout 120 python3 scripts/lce_profile.py --quick 2>&1 | tail -32
fi
if has profile; then
NCU="ncu --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis"
keep() { grep -vE "^==PROF==|^\s*$|^\s*-+\s*$" | tail -"$1"; }
for v in shared prefetch; do
  echo "== ncu add_mul_act backward fp32 relu ($v)"
  FUSEFORGE_EXTENSION=$(lib add_mul_act $v) timeout 90 $NCU --kernel-name regex:backward_kernel \
    python3 scripts/kernel_workload.py add_mul_act 16384x8192 fp32 relu 2>&1 | keep 100
done
echo "== ncu add_mul_act training forward fp32 gelu (writes out and z)"
FUSEFORGE_EXTENSION=$(lib add_mul_act shared) timeout 90 $NCU --kernel-name regex:forward_kernel \
  python3 scripts/kernel_workload.py add_mul_act 16384x8192 fp32 gelu 2>&1 | keep 100
fi
echo "== probe done in $(( $(date +%s) - t0 )) s"
