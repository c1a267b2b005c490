#!/usr/bin/env bash
# The stages chained by convention, no paths between them: each finds the newest matching artifact in
# the workspace. Runs offline on a tiny random MoE (random weights: this shows the mechanics, not quality).
# Usage: examples/pipeline.sh [WORKSPACE]
set -euo pipefail
export USAF_WORKSPACE=${1:-usaf-pipeline}
mkdir -p "$USAF_WORKSPACE"
stdlib=$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')

[ -d "$USAF_WORKSPACE/tiny-moe" ] || usaf tiny-model "$USAF_WORKSPACE/tiny-moe" --layers 4
usaf tokenize "$stdlib/json" "$stdlib/textwrap.py" "$stdlib/shlex.py" --model "$USAF_WORKSPACE/tiny-moe" \
  --seq-len 128 --source-depth 0 --held-out shlex.py
usaf quantize "$USAF_WORKSPACE/tiny-moe" --method rtn
usaf score --frac 0.05 --calib-samples 16
usaf train --steps 20 --reselect-every 10 --lr 0.05
usaf eval --max-sequences 64
usaf export --base "$USAF_WORKSPACE/tiny-moe"
usaf generate "def wrap(text):" --max-new-tokens 32
