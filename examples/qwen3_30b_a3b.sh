#!/usr/bin/env bash
# Fine-tune Qwen/Qwen3-30B-A3B on your own code with usaf.
#
# REQUIRES A DOWNLOAD: about 61 GB of bf16 weights from the Hugging Face hub (set HF_HOME to a disk with
# room; the quantized model is ~16 GB of 4-bit experts + ~1.3 GB of other weights).
#
# Memory: the 4-bit experts of all 48 layers (15.2 GiB, about 16.3 GB, at --group-size 64) stay in host memory
# and the frozen layers' are streamed to the GPU one layer ahead (--stream-experts; chosen by default when they
# would take over half the free device memory), so a 12 GB card with 32 GB of RAM is the target: `usaf plan
# Qwen/Qwen3-30B-A3B --vram 12GiB --ram 32GiB` shows the predicted peaks. Streaming was measured on one GPU (an
# H200: it lowered the peak by 20 % at no cost in speed; docs/BENCHMARKS.md, "On a GPU"); a 12 GB card's PCIe is
# not measured. The settings below: the top 3 of 48 layers
# trainable (their dequantized bases: ~3.4 GB in bf16), microbatch 1 x 8 accumulation at 512 tokens; `usaf plan
# Qwen/Qwen3-30B-A3B --vram 12GiB --ram 32GiB --train-from 45 --microbatch 1 --group-size 64` predicts score's peak
# at 10.4 GiB of the 11.4 usable (4 layers would need 12.4: nothing fits).
set -euo pipefail

CODE_DIR=${1:?usage: $0 PATH_TO_YOUR_CODE [HELD_OUT_SOURCE ...]}
shift
export USAF_WORKSPACE=${USAF_WORKSPACE:-$PWD/usaf-qwen3-30b}
held_out=()
for source in "$@"; do held_out+=(--held-out "$source"); done

usaf tokenize "$CODE_DIR" --model Qwen/Qwen3-30B-A3B --seq-len 512 --include '*.py' "${held_out[@]}"
usaf quantize Qwen/Qwen3-30B-A3B --method hqq --nbits 4 --group-size 64
usaf score --frac 0.005 --train-from 45 --calib-samples 64 --microbatch 1 --cache
eval_data=()  # a held-out loss during training needs a held-out split (an empty one is refused)
if [ ${#held_out[@]} -gt 0 ]; then
    eval_data=(--eval-data "$(ls -d "$USAF_WORKSPACE"/tokens/* | tail -1)" --eval-every 100)
fi
usaf train --steps 1000 --reselect-every 50 --microbatch 1 --grad-accum 8 "${eval_data[@]}"
usaf eval --max-sequences 256
# Verifying the merged export reloads it in fp32 (~122 GB): refused up front on a smaller machine, so unchecked here
usaf export --base Qwen/Qwen3-30B-A3B --no-verify
