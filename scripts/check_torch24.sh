#!/usr/bin/env bash
# The DirectML configuration's library versions on CPU: torch 2.4.1 (what torch-directml 0.2.5 pins) and
# transformers 4.57.x, running the same test subset as CI's second environment (.ci/legacy-subset.txt).
# It proves no newer torch API is used on that path; it cannot prove anything about a DirectML device.
#
# usage: scripts/check_torch24.sh [VENV_DIR]   (default .venv-torch24; built when absent)
# PyPI's torch 2.4.1 Linux wheel is the CUDA build (~800 MB + NVIDIA libraries); where
# download.pytorch.org is reachable, TORCH24_INDEX=https://download.pytorch.org/whl/cpu picks the CPU one.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-torch24}"
shift $(( $# > 0 ? 1 : 0 ))
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    if [ -n "${TORCH24_INDEX:-}" ]; then
        "$venv/bin/pip" install -q torch==2.4.1 --index-url "$TORCH24_INDEX"
    else
        "$venv/bin/pip" install -q torch==2.4.1
    fi
    # usaf's own dependencies minus transformers>=5 (pip cannot install usaf itself next to 4.x: see README)
    "$venv/bin/pip" install -q "transformers>=4.57,<4.58" "tokenizers>=0.21" "huggingface_hub>=0.30" \
        "safetensors>=0.4" "typer>=0.12" "rich>=13" "pydantic>=2.6" "psutil>=5.9" "hqq>=0.2.5" "jinja2>=3.1" \
        "pytest>=8"
fi
"$venv/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
mapfile -t subset < <(grep -v '^\s*#' .ci/legacy-subset.txt | grep -v '^\s*$')
PYTHONPATH=src "$venv/bin/python" -m pytest -q -p no:cacheprovider "${subset[@]}" "$@"
