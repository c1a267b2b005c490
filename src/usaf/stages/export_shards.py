"""Writing an export's tensors as ``model-NNNNN-of-NNNNN.safetensors`` shards plus ``model.safetensors.index.json``.

Shards are planned before anything is loaded (every unit's output size is known from headers), so
their names carry the final count. Each shard is then produced unit by unit, saved, and dropped:
memory holds one shard's tensors plus the unit being made (at most one MoE layer's experts in fp32).
A unit is never split across shards, so a layer larger than the shard limit gets a shard of its own.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from usaf.artifacts.hf_export import INDEX_FILE, ExportShardRecord
from usaf.artifacts.tensor_file import save_tensors
from usaf.stages.export_sources import ExportSource, Unit
from usaf.stages.progress import Progress


def plan_shards(units: list[Unit], max_bytes: int) -> list[list[Unit]]:
    """Units in the model's order, grouped into shards of at most ``max_bytes`` (a bigger unit alone)."""
    twice = [n for n, c in Counter(n for u in units for n in u.names).items() if c > 1]
    if twice:  # two sources for one name would silently keep the last: a bug in the source's plan
        raise RuntimeError(f"export plan writes tensors twice: {twice[:5]}")
    shards: list[list[Unit]] = [[]]
    size = 0
    for unit in sorted(units, key=lambda u: u.order):
        if shards[-1] and size + unit.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(unit)
        size += unit.nbytes
    return [s for s in shards if s]


def write_shards(
    source: ExportSource, shards: list[list[Unit]], work: Path, progress: Progress
) -> list[ExportShardRecord]:
    """Produce and save every shard into ``work``; write the index last. Returns one record per shard."""
    count = len(shards)
    weight_map: dict[str, str] = {}
    records: list[ExportShardRecord] = []
    total = 0
    for number, units in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{count:05d}.safetensors"
        progress.start(f"shard {number}/{count}", sum(u.nbytes for u in units), "bytes")
        tensors = {}
        for unit in units:
            made = source.produce(unit)
            if set(made) != set(unit.names):  # a plan/produce disagreement is a bug, never a silent drop
                raise RuntimeError(f"{unit.kind} unit made {sorted(made)[:4]}, planned {sorted(unit.names)[:4]}")
            tensors.update(made)
            progress.advance(unit.nbytes, tensors=len(tensors))
        # (tensors, bytes) of this shard; safetensors needs each tensor contiguous and owning its storage
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        save_tensors(tensors, str(work / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        records.append(ExportShardRecord(name=file, bytes=(work / file).stat().st_size, tensors=len(tensors)))
        total += nbytes
        del tensors
        progress.finish()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (work / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return records
