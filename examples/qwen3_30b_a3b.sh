#!/usr/bin/env bash
# Fine-tune Qwen/Qwen3-30B-A3B on your own code with usaf.
#
# REQUIRES A DOWNLOAD: about 61 GB of bf16 weights from the Hugging Face hub (set HF_HOME to a disk with
# room; the quantized model is ~16 GB of 4-bit experts + ~1.3 GB of other weights).
#
# Memory, today: the frozen 4-bit experts of all 48 layers (~15.4 GB) are held on the training device, so
# this needs a GPU with >= 24 GB (or a CPU with >= 48 GB of RAM, slowly). Streaming the frozen experts
# layer by layer from host memory, which is what fits a 12 GB card, is planned (issue 10) but not built;
# the settings below are already the ones a 12 GB card will use: the top 4 of 48 layers trainable
# (their dequantized bases: ~4.8 GB in bf16), microbatch 1 x 8 accumulation at 512 tokens.
set -euo pipefail

CODE_DIR=${1:?usage: $0 PATH_TO_YOUR_CODE [HELD_OUT_SOURCE ...]}
shift
export USAF_WORKSPACE=${USAF_WORKSPACE:-$PWD/usaf-qwen3-30b}
held_out=()
for source in "$@"; do held_out+=(--held-out "$source"); done

usaf tokenize "$CODE_DIR" --model Qwen/Qwen3-30B-A3B --seq-len 512 --include '*.py' "${held_out[@]}"
usaf quantize Qwen/Qwen3-30B-A3B --method hqq --nbits 4 --group-size 64
usaf score --frac 0.005 --train-from 44 --calib-samples 64 --microbatch 1 --cache
usaf train --steps 1000 --reselect-every 50 --microbatch 1 --grad-accum 8 --lr 1e-2 --eval-every 100 \
  --eval-data "$(ls -d "$USAF_WORKSPACE"/tokens/* | tail -1)"
usaf eval --max-sequences 256
usaf export --base Qwen/Qwen3-30B-A3B
