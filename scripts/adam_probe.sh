#!/usr/bin/env bash
# Device probe: torch's fused Adam math as installed there, and the AdamW parity test.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
T=$(python3 -c "import torch,os;print(os.path.dirname(torch.__file__))")
python3 -c "import torch; print(torch.__version__)"
H=$T/include/ATen/native/cuda/fused_adam_utils.cuh
grep -n "exp_avg = \|exp_avg_sq =\|bias_correction\|step_size\|weight_decay \*\|grad /=\|pow_(\|denom\|param -=" $H
grep -n "pow_" -A3 $T/include/ATen/native/cuda/Pow.cuh | head -30
