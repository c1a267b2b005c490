#!/usr/bin/env bash
# GPU check (not run in CI; run it whenever a CUDA machine is available, from the repository root).
# Budget: under 8 minutes (about 4 on an H200, 2026-12-04). Uses the CUDA build of torch already installed on the
# machine; usaf runs from src/
# (an offline machine needs no install; its other dependencies must be importable, e.g. carried as wheels).
#   1. the CUDA-marked tests (pytest -m cuda): the engine's loss and sparse gradients on the GPU against the CPU for
#      every family, the grouped paths (frozen and trainable layers) in bf16 at 128 experts against the loop, `usaf train` on the
#      GPU learning and resuming exactly with --deterministic (within the run-to-run noise without it), `usaf eval`
#      and `usaf score` (with its lr test) on the GPU against the CPU, `usaf generate` streamed and resident in the
#      device's dtype, streaming, the backend probe, dequantization;
#   2. the training steps at Qwen3-30B-A3B's real width (hidden 2048, 128 experts, top-8): first visit, cached (the
#      trainable experts grouped, usaf.engine.grouped_deltas), cached one expert at a time, collecting, a reselection,
#      and operators dispatched per step, against a peft LoRA step on the same layers -> benchmarks/results/steps-gpu.json,
#      with both steps' profiles (steps-gpu-profile.txt), and again under --deterministic (steps-gpu-deterministic.json);
#   3. the frozen-layer forward (grouped execution vs the per-expert loop vs transformers' grouped_mm) at 32 and
#      128 experts in bf16, also at dequantization blocks of 16 and 256 MiB -> benchmarks/results/frozen-gpu.json;
#      and at the real width, per forward at blocks of 16 MiB to 1 GiB against resident experts, with operators
#      and device syncs per forward -> benchmarks/results/frozen-gpu-real-width.json;
#   4. the planner's GPU benchmark: predicted device peak vs torch.cuda.max_memory_allocated at the real width,
#      step times with the frozen experts streamed from pinned host memory vs on the device, a decoding forward (one
#      token) with the experts resident, streamed by whole layers and streamed reading the routed experts alone, HQQ
#      quantization MB/s on the GPU -> benchmarks/results/plan-gpu.json;
#   5. usaf plan for Qwen3-30B-A3B on this machine's GPU (its --vram read from the device).
# Every step runs whatever the one before it did (each has its own time limit); the exit status is the first
# failure's. Logs and results are also copied to $OUT when that is set, as each step ends.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python || command -v python3)}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
RESULTS=benchmarks/results
mkdir -p "$RESULTS"
status=0

collect() {  # copy the named files to $OUT (the device tool brings them back)
    [ -n "${OUT:-}" ] || return 0
    for f in "$@"; do [ -f "$f" ] && cp "$f" "$OUT"/; done
    return 0
}

step() {  # step NAME SECONDS COMMAND...: run, report the time and status, keep going
    local name=$1 limit=$2 start rc
    shift 2
    echo "== gpu_check: $name (limit ${limit}s)"
    start=$SECONDS
    timeout "$limit" "$@"
    rc=$?
    echo "== gpu_check: $name: exit $rc after $((SECONDS - start))s"
    [ "$rc" -eq 0 ] || [ "$status" -ne 0 ] || status=$rc
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 1
if ! "$PY" -c "import usaf, hqq, pydantic, typer" 2>/dev/null; then
    timeout 120 "$PY" -m pip install -q -e ".[dev]" || timeout 60 "$PY" -m pip install -q --no-deps --no-build-isolation -e .
fi
"$PY" -c "import usaf, transformers, pytest; print('usaf', usaf.__version__, 'transformers', transformers.__version__)" || exit 1

step "CUDA tests" 150 "$PY" -m pytest -q -m cuda -p no:cacheprovider -o addopts="" -rfE
step "training steps at real width vs LoRA" 120 "$PY" benchmarks/bench_steps_gpu.py --rounds 7 --out "$RESULTS/steps-gpu.json" \
    --profile "$RESULTS/steps-gpu-profile.txt"
collect "$RESULTS/steps-gpu.json" "$RESULTS/steps-gpu-profile.txt"
step "training steps with --deterministic" 100 "$PY" benchmarks/bench_steps_gpu.py --rounds 5 --deterministic \
    --out "$RESULTS/steps-gpu-deterministic.json"
collect "$RESULTS/steps-gpu-deterministic.json"
step "frozen-layer forward" 120 "$PY" benchmarks/bench_frozen.py --device cuda --dtype bfloat16 --experts 32 128 \
    --rounds 5 --block-sweep 16 256 --out "$RESULTS/frozen-gpu.json"
collect "$RESULTS/frozen-gpu.json"
step "frozen-layer forward at real width" 90 "$PY" benchmarks/bench_frozen_gpu.py --rounds 7 \
    --out "$RESULTS/frozen-gpu-real-width.json"
collect "$RESULTS/frozen-gpu-real-width.json"
step "planner and streaming" 150 "$PY" benchmarks/bench_plan_gpu.py --streaming --out "$RESULTS/plan-gpu.json"
collect "$RESULTS/plan-gpu.json"
step "usaf plan" 30 bash -c "\"$PY\" -m usaf plan tests/data/qwen3-30b-a3b --device cuda --ram 32GiB --json > $RESULTS/plan-gpu-usaf-plan.json"
collect "$RESULTS/plan-gpu-usaf-plan.json"
echo "gpu_check: done (exit $status)"
exit "$status"
