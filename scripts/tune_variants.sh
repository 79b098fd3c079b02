#!/usr/bin/env bash
# GPU machine: times variants of one op's kernels side by side in one run, with the op's benchmark
# (CONTRIBUTING.md, "The GPU-machine workflow").
#   bash scripts/tune_variants.sh OP "name:spec" ...
#   spec words "-DKNOB=value" compile-time knobs: a private build of OP with these nvcc flags (one
#                             per distinct set of flags)
#   spec words "VAR=value"    run-time knobs: environment for the run (of the shared build of OP,
#                             built once with $BASE_FLAGS, when the spec has no nvcc flags)
#   spec word "@DIR"          build from the source tree DIR instead of this one (e.g. "before:@baseline"),
#                             timed beside this tree's build in the same run
#   spec "" (name:)           the shared build as it is
# Env: CASES (the benchmark's --cases), IMPLS (its --impls; default fuseforge), BENCH (the benchmark
# benchmarks/bench_$BENCH.py; default OP, e.g. BENCH=attention_varlen with OP attention), BASE_FLAGS,
# BENCH_TIMEOUT, ROUNDS, BUILD_ONLY=1 (build every variant's library, in parallel, and time nothing; a
# later run reuses the builds under /tmp/tune/OP), PRINT_LIBS=1 (print each variant's built library,
# build nothing). Prints each variant's rows of the benchmark's table.
#
#   bash scripts/tune_variants.sh --baseline COMMIT [DIR]
# (on the development machine) unpacks COMMIT's sources (csrc, python, setup.py, pyproject.toml) into
# DIR (default baseline/, git-ignored), for a variant "before:@baseline" that times the previous code
# beside this tree. A run-time knob's A/B (default vs knob) compares two paths of the new build only,
# and the knob's own code can slow the default path, so a change to a kernel's default path is timed
# against the commit before it.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --baseline ]; then
  set -e
  commit=$(git rev-parse --short=12 "${2:?usage: tune_variants.sh --baseline COMMIT [DIR]}")
  dir=${3:-baseline}
  rm -rf "$dir" && mkdir -p "$dir"
  git archive "$commit" csrc python setup.py pyproject.toml | tar x -C "$dir"
  echo "$commit" > "$dir/COMMIT"
  echo "$dir: $commit ($(du -sh "$dir" | cut -f1))"
  exit 0
fi
# Logs stay in /tmp/tune/logs, so $OUT holds only what the caller packs.
LOGS=/tmp/tune/logs; mkdir -p "$LOGS"
OP=$1; shift
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python FUSEFORGE_OPS=$OP ADAMW_BENCH_COMPILE=${ADAMW_BENCH_COMPILE:-0}
source scripts/device_env.sh  # after PYTHONPATH: it appends the peers' wheels (IMPLS=...,liger)
IMPLS=${IMPLS:-fuseforge}
BENCH=${BENCH:-$OP}
lib_of() { ls /tmp/tune/$OP/$1/lib/fuseforge/_C*.so 2>/dev/null; }
build() {  # build NAME FLAGS [SOURCE_DIR]
  [ -n "$(lib_of "$1")" ] && return 0
  local t0; t0=$(date +%s)
  (cd "${3:-.}" && FUSEFORGE_DEV=1 FUSEFORGE_NVCC_FLAGS="$2" MAX_JOBS=${MAX_JOBS:-16} python3 setup.py -q build_ext -b /tmp/tune/$OP/$1/lib \
    -t /tmp/tune/$OP/$1/tmp) > "$LOGS/build_${OP}_$1.log" 2>&1 \
    || { echo "$OP/$1: build failed"; tail -5 "$LOGS/build_${OP}_$1.log"; return 1; }
  echo "== $OP/$1 built in $(( $(date +%s) - t0 )) s"
}
# A private build's folder: named by its source tree and nvcc flags, so variants with the same share one.
build_name() { echo "f_$(echo "$1 $2" | md5sum | cut -c1-10)"; }
flags_of() { local w out=""; for w in $1; do [ "${w#-}" != "$w" ] && out="$out $w"; done; echo "${out# }"; }
envs_of() { local w out=""; for w in $1; do [ "${w#-}" = "$w" ] && [ "${w#@}" = "$w" ] && out="$out $w"; done; echo "${out# }"; }
src_of() { local w; for w in $1; do [ "${w#@}" != "$w" ] && echo "${w#@}"; done; }
# The build a spec times: "shared" (this tree, $BASE_FLAGS) or a private one (flags and/or a source tree).
build_of() { local flags src; flags=$(flags_of "$1"); src=$(src_of "$1")
  if [ -z "$flags$src" ]; then echo shared; else build_name "$flags" "$src"; fi; }
if [ "${PRINT_LIBS:-0}" = 1 ]; then  # "name library [VAR=value ...]" a line, for running other things on the builds
  for variant in "$@"; do
    echo "${variant%%:*} $(lib_of "$(build_of "${variant#*:}")") $(envs_of "${variant#*:}")"
  done
  exit 0
fi
if [ "${BUILD_ONLY:-0}" = 1 ]; then
  need_shared=0
  declare -A seen=()
  for variant in "$@"; do
    b=$(build_of "${variant#*:}")
    if [ "$b" = shared ]; then need_shared=1; continue; fi
    [ -n "${seen[$b]:-}" ] && continue; seen[$b]=1
    build "$b" "$(flags_of "${variant#*:}")" "$(src_of "${variant#*:}")" &
  done
  [ $need_shared = 1 ] && build shared "${BASE_FLAGS:-}" &
  wait
  exit 0
fi
# ROUNDS=2 runs the variants again in reverse order (A B B A): the same code timed first and last in
# one run differs by up to 7% (D128/S16384 forward+backward), so one order can favour whichever
# variant runs first.
variants=("$@")
for ((round = 1; round <= ${ROUNDS:-1}; ++round)); do
order=("${variants[@]}")
if (( round % 2 == 0 )); then order=(); for ((i = ${#variants[@]} - 1; i >= 0; --i)); do order+=("${variants[$i]}"); done; fi
for variant in "${order[@]}"; do
  name=${variant%%:*}; spec=${variant#*:}; flags=$(flags_of "$spec"); envs=$(envs_of "$spec")
  b=$(build_of "$spec")
  if [ "$b" != shared ]; then
    build "$b" "$flags" "$(src_of "$spec")" || continue; lib=$(lib_of "$b")
  else
    build shared "${BASE_FLAGS:-}" || exit 1; lib=$(lib_of shared)
  fi
  tag=$name; [ "${ROUNDS:-1}" -gt 1 ] && tag=${name}_r$round
  echo "== $OP $tag (${spec:-as built})"
  cases=(); [ -n "${CASES:-}" ] && cases=(--cases "$CASES")
  # A hung variant (a new kernel's barriers) costs BENCH_TIMEOUT seconds, not the whole run.
  env $envs FUSEFORGE_EXTENSION="$lib" timeout -s INT -k 20 "${BENCH_TIMEOUT:-240}" python3 benchmarks/bench_$BENCH.py "${cases[@]}" --impls "$IMPLS" \
    --no-memory --out /tmp/tune/$OP/res_$tag > "$LOGS/bench_${BENCH}_$tag.log" 2>&1 \
    || { tail -5 "$LOGS/bench_${BENCH}_$tag.log"; continue; }
  sed "/^$/q" /tmp/tune/$OP/res_$tag/${BENCH}_*.md | grep -E "^\| [^c-]" | awk -F"|" '{print $2,$3,$4,$5,$6}'
done
done
