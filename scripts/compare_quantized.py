"""Same model, quantized under different library versions: are the artifacts the same files?

usage (each python from its own environment, PYTHONPATH=src):
    python scripts/compare_quantized.py quantize MODEL_DIR OUT_DIR     # prints sha256 of every output file
    python scripts/compare_quantized.py entries A/experts_q4.pt B/experts_q4.pt   # tensor-by-tensor equality

Used for docs/ARCHITECTURE.md ("The DirectML configuration"): transformers 5.24 vs 4.57.6 vs torch 2.4.1.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path


def _flat(entry, prefix=""):
    out = {}
    for key, value in entry.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def main(argv: list[str]) -> int:
    import torch

    if len(argv) == 3 and argv[0] == "quantize":
        from usaf.stages.quantize import QuantizeConfig
        from usaf.stages.quantize import run as quantize

        _, out = quantize(QuantizeConfig(model=argv[1], out=Path(argv[2]), method="rtn", group_size=8))
        for path in sorted(p for p in out.iterdir() if p.is_file()):
            print(path.name, hashlib.sha256(path.read_bytes()).hexdigest()[:16])
        return 0
    if len(argv) == 3 and argv[0] == "entries":
        a, b = (_flat(torch.load(p, weights_only=True)) for p in argv[1:])
        differ = sorted(set(a) ^ set(b)) + [
            k for k in set(a) & set(b) if not (torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k])
        ]
        print(f"{len(a)} entries; differing: {differ or 'none'}")
        return 1 if differ else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
