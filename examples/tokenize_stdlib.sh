#!/usr/bin/env bash
# Tokenize the Python standard library with a tiny built-in tokenizer, holding out two packages.
# Needs no download. Usage: examples/tokenize_stdlib.sh [WORKSPACE]
set -euo pipefail
workspace=${1:-usaf-workspace}
stdlib=$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')

[ -d "$workspace/tiny-moe" ] || usaf tiny-model "$workspace/tiny-moe"
usaf tokenize "$stdlib" --model "$workspace/tiny-moe" --workspace "$workspace" \
  --include '*.py' --exclude 'site-packages/*' --decode-errors replace \
  --held-out json --held-out email --seq-len 512
usaf inspect "$(ls -d "$workspace"/tokens/*/ | tail -n 1)" --no-hash
