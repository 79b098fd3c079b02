#!/usr/bin/env bash
# Development machine: unpacks a previous commit's sources (csrc, python, setup.py, pyproject.toml)
# into baseline/ (git-ignored), so that one device call can time this tree's build beside that
# commit's: a variant "before:@baseline" of scripts/tune_variants.sh (and tuning_probe.sh's lists),
# with the device call's carry naming "baseline". A run-time knob's A/B (default vs knob) compares
# two paths of the new build only; the knob's code can slow the default path too
# (docs/notes_attention.md, nineteenth session).
#   bash scripts/prepare_baseline.sh COMMIT [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
commit=$(git rev-parse --short=12 "${1:?usage: prepare_baseline.sh COMMIT [DIR]}")
dir=${2:-baseline}
rm -rf "$dir" && mkdir -p "$dir"
git archive "$commit" csrc python setup.py pyproject.toml | tar x -C "$dir"
echo "$commit" > "$dir/COMMIT"
echo "$dir: $commit ($(du -sh "$dir" | cut -f1))"
