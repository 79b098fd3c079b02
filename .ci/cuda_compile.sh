#!/usr/bin/env bash
# Compiles and links every CUDA kernel and the CUDA host code (FUSEFORGE_CUDA=1) without a GPU, into
# build/temp-cuda and build/cuda-lib (the tree's CPU-only extension is left alone). Targets: sm_90a
# only by default (CI_CUDA_ARCH_LIST; the release list, setup.py's PORTABLE_ARCH_LIST, costs ~3x the
# time of this, which 2 cores do not have): every wgmma, TMA and mma.sync body, the sm_90a-only kernels
# included (FUSEFORGE_SM90A_BUILD). Incremental: a second run compiles what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=  # the build needs torch only
start=$(date +%s)
FUSEFORGE_CUDA=1 TORCH_CUDA_ARCH_LIST="${CI_CUDA_ARCH_LIST:-9.0a}" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
  python3 setup.py -q build_ext -b build/cuda-lib
echo "CUDA compile: $(( $(date +%s) - start )) s"
