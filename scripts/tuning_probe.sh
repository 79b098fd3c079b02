#!/usr/bin/env bash
# GPU machine, one call (up to ~9 min): times kernel variants beside the defaults and profiles
# where the time goes. Each op's notes (docs/notes_<op>.md) record what it measured and when.
#   FUSEFORGE_COMMIT=<sha> bash scripts/tuning_probe.sh      (output in $OUT/probe.log)
#   PARTS="time profile" bash scripts/tuning_probe.sh       (a subset of: build tests time profile
#                                                           e2e lce mix attn; every part builds what it lacks)
#   OPS="add_mul_act" ...                                   (ops of parts build/time/tests; default
#                                                           adamw add_mul_act; "" for none)
# Measured 2026-11-23 (fourth session): builds 50-95 s; "time" ~2.5 min; e2e ~90 s; profile ~1 min.
# 1. builds (in parallel): AdamW, add_mul_act (and its compile-time variants), LCE (part lce), all
#    ops in place (part e2e)
# 2. time: A/B timings with tune_variants.sh, the default beside each variant, same process order
# 3. tests: the candidates' GPU tests (TEST_K: a pytest -k filter; TEST_TIMEOUT per file)
# 4. e2e: scripts/e2e_profile.py (a training step of the 1.2B Llama by kernel family)
# 5. lce: lce_profile.py --quick; profile: ncu of the add_mul_act kernels (stall reasons, DRAM
#    throughput, occupancy)
# 6. mix: scripts/stream_mix_probe.py (streaming ceilings by read:write mix; add_mul_act's and
#    torch.compile's fwd+bwd kernel by kernel)
# 7. attn: the attention variants (ATTN) built; the rows of ATTN_CASES timed beside the default (ROUNDS=2: A B B A;
#    ATTN_CASES="" skips them), and the bench_attention_varlen rows of ATTN_VARLEN_CASES (if set; impls
#    ATTN_VARLEN_IMPLS, default fuseforge,fuseforge_causal); the
#    GPU tests of each candidate (TEST_K, default "cuda"); then ncu of each impl's longest forward
#    and backward kernel (ATTN_NCU_IMPLS, default fuseforge and sdpa_cudnn) on one benchmark case
#    (ATTN_CASE; ATTN_NCU_PASSES="fwd" for the forward only): pipe and shared-memory use, stalls
#    (ATTN_NCU=0 skips it; ATTN_NCU_SOURCE=1 prints
#    instead where the stall samples sit, by SASS instruction: scripts/ncu_sass_hotspots.py). Two
#    attention builds in parallel take ~4 min.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/probe.log") 2>&1
source scripts/device_env.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
T=scripts/tune_variants.sh
# Variants as name:flags (nvcc -D flags and/or run-time NAME=value knobs). The fifth session's bf16
# 8-rows-a-trip and 8K/32K AdamW chunks lost (the op notes); LCE's exact target logit is the default
# since the sixth session; add_mul_act's interleaved one-wave backward since the seventh.
AMA=(default:)
LCE=(default:)
ADAMW=(c16k:)
# Attention: FA3's dK-after-dQ order, the forward's K freed with V and 176-key forward tiles at head
# dim 128 lost; the wgmma descriptor arithmetic, D64's three-warpgroup forward, the backward's lse /
# row_dot read before its wgmma waits with its dQ hand-off deferred to the next tile, O stored by
# TMA, head dim 64's backward on the warp-specialized kernel and dQ staging without bank conflicts
# won and are the code, as are the mask code without branches and the softcap's tanh.approx
# (2026-11-26); a persistent dk/dv kernel, varlen key-block slots and immediate-offset dQ staging
# stores timed level, and a late dQ store, query tiles rotated per key block, a dQ-writer warp and
# no division a tile without GQA lost, and half the softcap's reciprocals by Newton steps timed
# level; on 2026-11-26 (fifteenth session) the backward's hidden-warpgroup skip, a 3-stage forward
# ring and exponentials on the FMA pipe lost, independent 64-row streams, the row max over four
# chains and dK after dQ with a mask timed level; on 2026-11-26 (seventeenth session) the dQ convert
# fused into the dk/dv kernel lost, and (eighteenth) again with the producer warps counting and
# converting; on 2026-11-26 (nineteenth) the forward's block pairs sharing K/V by TMA multicast timed
# level with a build of the commit before; all removed (docs/notes_attention.md); on 2026-11-26
# (twentieth) head dim 128's 80-query backward tiles without a mask won (FUSEFORGE_ATTENTION_BWD_ROWS=64
# keeps the 64-query kernel for A/Bs); on 2026-11-27 (twenty-second) the masked tiles' per-line
# visible range won and is the code, the 80-query tiles' early lse and O's rescale skipped on an
# unchanged max lost, and one empty-barrier arrive a warp timed 0.5-0.9% faster but failed racecheck;
# on 2026-11-27 (twenty-third) the lse / row_dot by bulk copy with the warp-level release timed mixed
# (window 1.5-3% slower) and failed racecheck too (branch wip/bwd-tile-stats-bulk); on 2026-11-27
# (twenty-fifth) the 80-query tiles' constant-size dQ^T reduction (wip/dq-target-const) and the
# forward's row sums by a wgmma against ones (wip/fwd-row-sum-mma) lost, head dim 128's forward with Q
# in registers won and is the code; on 2026-11-27 (twenty-sixth) head dim 128's exponentials partly on
# the FMA pipe (wip/fwd-poly-exp-d128) lost; on 2026-11-27 (twenty-seventh) the forward's conditional
# rescale and the speculative exponentials (head dim 128, and 64's two-warpgroup kernels) won and are
# the code; on 2026-11-27 (twenty-eighth) warpgroups skipping the key tiles none of their rows see
# (idle warpgroups, and each warpgroup's trailing masked tiles; three-warpgroup and varlen kernels)
# won and is the code; on 2026-11-27 (twenty-ninth) the half last key tile, pipelined tiles and
# 192-row tiles at D64/S1024/causal lost (branch wip/fwd-half-pipe); on 2026-11-27 (thirtieth) the
# forward's query tiles ending at the last row won and are the code (with them, 192 rows at
# D64/S1024/causal); on 2026-11-27 (thirty-first) the speculative tiles' bound on P from a thread's
# sums instead of the row max won, and with it the speculative tiles in every warp-specialized
# forward; on 2026-11-27 (thirty-second) the dQ convert by each group's last key block lost
# (branch wip/bwd-fused-convert-last-block), the dk/dv block's exit wait on the reductions' reads
# only and 128-row forward tiles at D64/S1024/causal timed level and slower, and the forward's
# ping-pong and early K release still win (off: 2-4% and 7-18% slower at S1024); on 2026-11-27
# (thirty-third) dq_accum zeroed by the dk/dv kernel a wave ahead won (FUSEFORGE_ATTENTION_BWD_ZERO_AHEAD=0
# for the row_dot kernel's zeroing), two waves ahead and the zeroing after the block's first tile
# did not do better; on 2026-11-28 (thirty-fourth) the same for varlen (distance in real key blocks)
# won and is the code, the zeros stored with an L2 evict_last policy and a distance of 33 blocks timed
# level; on 2026-11-28 (thirty-fifth) distances of 66 and 33 blocks timed level across the grid (a
# wave stays), and the backward's programmatic dependent launches won once the blocks past their
# document no longer waited (on by default since the thirty-sixth; "serial" below times them off). Add
# "name:-DKNOB=1" (or "name:ENV=value") entries for the next candidates, and "before:@baseline"
# (scripts/prepare_baseline.sh; carry "baseline") to time the previous commit in the same call.
ATTN=(default: "serial:FUSEFORGE_ATTENTION_BWD_OVERLAP=0")
PARTS=${PARTS:-build tests time profile e2e lce}
OPS=${OPS-adamw add_mul_act}
has() { [[ " $PARTS " == *" $1 "* ]]; }
op() { [[ " $OPS " == *" $1 "* ]]; }
t0=$(date +%s)
mkdir -p /tmp/tune/logs
# The timed variants' JSON/markdown (each records GPU, torch and FUSEFORGE_COMMIT) and the logs, in
# one archive, also when the call is cut short.
pack() { (cd /tmp/tune && tar czf "$OUT/tune_results.tgz" logs $(ls -d */res_* 2>/dev/null)) 2>/dev/null; }
trap pack EXIT
# Wait on these pids by name: a bare `wait` would also wait for the tee above, which never ends.
pids=()
op adamw && { MAX_JOBS=4 BUILD_ONLY=1 bash $T adamw "${ADAMW[@]}" & pids+=($!); }
op add_mul_act && { MAX_JOBS=6 BUILD_ONLY=1 bash $T add_mul_act "${AMA[@]}" & pids+=($!); }
has lce && { MAX_JOBS=4 BUILD_ONLY=1 bash $T linear_cross_entropy "${LCE[@]}" & pids+=($!); }
has attn && { MAX_JOBS=8 BUILD_ONLY=1 bash $T attention "${ATTN[@]}" & pids+=($!); }
# every op in place, for the end-to-end profile
has e2e && { MAX_JOBS=8 python3 setup.py -q build_ext --inplace > /tmp/tune/logs/build_all.log 2>&1 & pids+=($!); }
wait "${pids[@]}"
echo "== builds: $(( $(date +%s) - t0 )) s"
lib() { ls /tmp/tune/$1/$2/lib/fuseforge/_C*.so; }
pt() { timeout -k 20 ${TEST_TIMEOUT:-300} python3 -m pytest -q -x -rf -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} "$@" 2>&1 | grep -E "^FAILED|passed|failed|error" | tail -3; }
if has time; then
echo "== timings ($(( $(date +%s) - t0 )) s)"
op adamw && CASES=llama1b IMPLS=fuseforge,torch_fused bash $T adamw "${ADAMW[@]}"
# fuseforge only: the compile baselines are in benchmarks/results/<op>.json (same GPU)
op add_mul_act && CASES=16384x8192 bash $T add_mul_act "${AMA[@]}"
has lce && CASES=8192x4096x128256 bash $T linear_cross_entropy "${LCE[@]}"
fi
if has tests; then
echo "== tests: add_mul_act and adamw (default builds)"
op add_mul_act && FUSEFORGE_EXTENSION=$(lib add_mul_act shared) pt tests/python/test_add_mul_act.py
op adamw && FUSEFORGE_EXTENSION=$(lib adamw shared) pt tests/python/test_adamw.py
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
for a in "fp32 relu" "fp32 gelu" "bf16 gelu"; do
  echo "== ncu add_mul_act backward $a"
  FUSEFORGE_EXTENSION=$(lib add_mul_act shared) timeout 90 $NCU --kernel-name regex:backward_kernel \
    python3 scripts/kernel_workload.py add_mul_act 16384x8192 $a 2>&1 | keep 100
done
echo "== ncu add_mul_act training forward fp32 gelu (writes out and z)"
FUSEFORGE_EXTENSION=$(lib add_mul_act shared) timeout 90 $NCU --kernel-name regex:forward_kernel \
  python3 scripts/kernel_workload.py add_mul_act 16384x8192 fp32 gelu 2>&1 | keep 100
fi
if has mix; then
echo "== stream mixes ($(( $(date +%s) - t0 )) s)"
FUSEFORGE_EXTENSION=$(lib add_mul_act shared) timeout 240 python3 scripts/stream_mix_probe.py 2>&1 | grep -v Warning
fi
if has attn; then
# Timings first (what decides), then the candidates' GPU tests (the default's ran at its commit).
echo "== attention timings ($(( $(date +%s) - t0 )) s)"
[ -n "${ATTN_CASES-x}" ] && CASES=${ATTN_CASES:-D64/S16384,D128/S16384} IMPLS=fuseforge bash $T attention "${ATTN[@]}"
[ -n "${ATTN_VARLEN_CASES:-}" ] && BENCH=attention_varlen CASES=$ATTN_VARLEN_CASES IMPLS=${ATTN_VARLEN_IMPLS:-fuseforge,fuseforge_causal} \
  bash $T attention "${ATTN[@]}"
# ATTN_CYCLES_CASES: each build's kernels of these cases under ncu at its locked clock (ncu_pass_cycles.py;
# cycles do not move with the power cap's clock, which the timings above do), with each variant's
# run-time knobs.
[ -n "${ATTN_CYCLES_CASES:-}" ] && while read -r name so envs; do
  echo "== locked-clock cycles, $name ($(( $(date +%s) - t0 )) s)"
  [ -n "$so" ] || { echo "no build"; continue; }
  env $envs FUSEFORGE_EXTENSION=$so timeout -k 20 300 python3 scripts/ncu_pass_cycles.py --cases "$ATTN_CYCLES_CASES" \
    --impls fuseforge --passes ${ATTN_CYCLES_PASSES:-fwdbwd} < /dev/null 2>&1 | grep -v "^$"
done < <(PRINT_LIBS=1 bash $T attention "${ATTN[@]}")
declare -A tested=()
while read -r name so envs; do
  # ATTN_TEST: the variants whose builds are tested (default: every candidate, not the default)
  if [ -n "${ATTN_TEST:-}" ]; then [[ " $ATTN_TEST " == *" $name "* ]] || continue
  else [ "$name" = default ] || [ "$so" = "$(lib attention shared)" ] && continue; fi
  [ -n "$so" ] || { echo "== attention GPU tests, $name: no build"; continue; }
  [ -n "${tested[$so]:-}" ] && continue
  tested[$so]=1
  echo "== attention GPU tests, $name ($(( $(date +%s) - t0 )) s)"
  for f in tests/python/test_attention.py tests/python/test_attention_varlen.py; do
    FUSEFORGE_EXTENSION=$so TEST_K=${TEST_K:-cuda} pt $f < /dev/null
  done
  # ATTN_SANITIZE="memcheck racecheck": compute-sanitizer on the build's sanitizer cases too; the
  # full report (each hazard's two accesses) in the archive's logs/sanitizer_<tool>_<name>.log
  for tool in ${ATTN_SANITIZE:-}; do
    echo "== compute-sanitizer $tool, $name ($(( $(date +%s) - t0 )) s)"
    FUSEFORGE_EXTENSION=$so PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 20 ${TEST_TIMEOUT:-300} compute-sanitizer \
      --tool $tool --error-exitcode 99 python3 -m pytest -q -x -p no:cacheprovider -m sanitize tests/python/test_attention.py \
      tests/python/test_attention_varlen.py \
      < /dev/null > /tmp/tune/logs/sanitizer_${tool}_$name.log 2>&1
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|rror" /tmp/tune/logs/sanitizer_${tool}_$name.log | tail -4
  done
done < <(PRINT_LIBS=1 bash $T attention "${ATTN[@]}")
ATTN_CASE=${ATTN_CASE:-D128/S4096/full}
NCU="ncu --launch-skip 1 --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis_Tables --section InstructionStats --section SourceCounters"
keep() { grep -vE "^==PROF==|^\s*$|^\s*-+\s*$" | tail -"$1"; }
# The longest forward and backward kernel of each impl (ATTN_NCU_IMPLS), side by side.
[ "${ATTN_NCU:-1}" = 1 ] && for impl in ${ATTN_NCU_IMPLS:-fuseforge sdpa_cudnn}; do
  names=$(FUSEFORGE_EXTENSION=$(lib attention shared) timeout 120 python3 scripts/kernel_workload.py attention_kernels \
    $ATTN_CASE $impl 2>/dev/null)
  echo "$names"
  for pass in ${ATTN_NCU_PASSES:-fwd bwd}; do
    # the function name without the return type, namespace, template arguments and parameters
    name=$(echo "$names" | awk -v p=$pass '$1 == p {print $2}' | sed -E 's/^void_//; s/[<(].*//; s/.*:://')
    [ -z "$name" ] && continue
    echo "== ncu attention $pass $impl $ATTN_CASE: $name"
    if [ "${ATTN_NCU_SOURCE:-0}" = 1 ]; then  # where the stall samples sit, instruction by instruction
      FUSEFORGE_EXTENSION=$(lib attention shared) timeout 150 ncu --launch-skip 1 --launch-count 1 \
        --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
        --kernel-name regex:"$name" python3 scripts/kernel_workload.py attention $ATTN_CASE $impl 2>/dev/null \
        | python3 scripts/ncu_sass_hotspots.py ${ATTN_NCU_TOP:-40}
    else
      FUSEFORGE_EXTENSION=$(lib attention shared) timeout 150 $NCU --kernel-name regex:"$name" \
        python3 scripts/kernel_workload.py attention $ATTN_CASE $impl 2>&1 | keep ${ATTN_NCU_LINES:-120}
    fi
  done
done
fi
echo "== probe done in $(( $(date +%s) - t0 )) s"
