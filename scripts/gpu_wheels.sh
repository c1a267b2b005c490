#!/usr/bin/env bash
# Wheels of usaf's dependencies that an offline CUDA machine's image may lack, for scripts/gpu_check.sh there.
# Run here (with network), from the repository root:  scripts/gpu_wheels.sh [DIR=.whl] [PYTHON_VERSION=3.12]
# There:  python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl && PYTHONPATH=/tmp/site ...
# The list is what this workplace's GPU image lacked on 2026-12-04 (it has torch, transformers 5.17, typer, rich,
# psutil, safetensors, peft, pytest, hypothesis); versions are this machine's, so both sides test the same code.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
py=${2:-3.12}
mkdir -p "$dir"
version() { python3 -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
binary=(pydantic pydantic_core annotated-types typing-inspection termcolor)
for name in "${binary[@]}"; do
    v=$(version "$name"); spec=$name${v:+==$v}
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$dir" "$spec"
done
v=$(version hqq)  # hqq ships a source distribution only: build its (pure-Python) wheel here
python3 -m pip wheel -q --no-deps "hqq${v:+==$v}" -w "$dir"
ls "$dir"
