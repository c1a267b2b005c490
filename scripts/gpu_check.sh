#!/usr/bin/env bash
# GPU check (not run in CI; run it whenever a CUDA machine is available, from the repository root).
# Budget: under 8 minutes. Uses the CUDA build of torch already installed on the machine.
#   1. install usaf (editable) without touching torch;
#   2. the CUDA-marked tests (pytest -m cuda);
#   3. the planner's GPU benchmark: predicted device peak vs torch.cuda.max_memory_allocated on a stack of
#      random layers with Qwen3-30B-A3B's real dimensions, step times with the frozen experts streamed from
#      pinned host memory vs on the device (and their peaks vs the planner), HQQ quantization MB/s on the GPU
#      -> benchmarks/results/plan-gpu.json;
#   4. the frozen-layer forward (grouped execution vs the per-expert loop vs transformers' grouped_mm) at 32 and
#      128 experts -> benchmarks/results/frozen-gpu.json;
#   5. usaf plan for Qwen3-30B-A3B on this machine's GPU (its --vram read from the device).
# Results are also copied to $OUT when that is set.
set -euo pipefail
cd "$(dirname "$0")/.."

python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0))"

# torch>=2.6 is already satisfied, so pip keeps the installed CUDA build. Offline machines: no dependencies.
timeout 120 python -m pip install -q -e ".[dev]" || timeout 60 python -m pip install -q --no-deps --no-build-isolation -e .
python -c "import usaf, transformers, pytest; print('usaf', usaf.__version__, 'transformers', transformers.__version__)"

timeout 120 python -m pytest -q -m cuda -p no:cacheprovider

mkdir -p benchmarks/results
timeout 270 python benchmarks/bench_plan_gpu.py --streaming --out benchmarks/results/plan-gpu.json

timeout 150 python benchmarks/bench_frozen.py --device cuda --experts 32 128 --rounds 5 \
    --out benchmarks/results/frozen-gpu.json

timeout 60 python -m usaf plan tests/data/qwen3-30b-a3b --device cuda --ram 32GiB --json > benchmarks/results/plan-gpu-usaf-plan.json

if [ -n "${OUT:-}" ]; then
    cp benchmarks/results/plan-gpu.json benchmarks/results/plan-gpu-usaf-plan.json benchmarks/results/frozen-gpu.json \
        "$OUT"/
fi
echo "gpu_check: done"
