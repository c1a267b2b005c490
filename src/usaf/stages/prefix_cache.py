"""The frozen-prefix cache across stages: ``usaf score --cache`` stores every training sequence's prefix
state in its plan; ``usaf train`` reads that store (and keeps a per-run cache for anything missing).

A store is only a speed-up: keys are content hashes (tokens, model fingerprint, first trainable layer,
dtype, library versions), so a store made on another device/dtype or for other data simply misses,
and every miss is computed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from usaf.data.batches import collate
from usaf.data.tokens import iter_token_file
from usaf.stages.progress import Progress

STATES_FILE = "prefix_states.bin"
INDEX_FILE = "prefix_index.json"


def write_store(
    engine,
    data_file: Path,
    out_dir: Path,
    *,
    model_fingerprint: str,
    vocab_size: int,
    pad_id: int,
    microbatch: int,
    progress: Progress,
) -> dict[str, int]:
    """Compute the prefix state of every sequence of ``data_file`` (batched) into ``out_dir``'s store."""
    from usaf.engine.prefix import PrefixStore

    total = sum(1 for _ in iter_token_file(data_file, vocab_size=vocab_size))
    device = next(engine.model.parameters()).device

    def states():
        progress.start("prefix cache", total, "sequences")
        pending = []
        for line in iter_token_file(data_file, vocab_size=vocab_size):
            pending.append(line)
            if len(pending) == microbatch:
                yield from _batch_states(engine, pending, pad_id, device, model_fingerprint)
                progress.advance(len(pending))
                pending = []
        if pending:
            yield from _batch_states(engine, pending, pad_id, device, model_fingerprint)
            progress.advance(len(pending))
        progress.finish()

    meta = {"model_fingerprint": model_fingerprint, "start": engine.prefix.start}
    return PrefixStore.write(out_dir / STATES_FILE, out_dir / INDEX_FILE, states(), meta=meta)


def _batch_states(engine, lines, pad_id: int, device: torch.device, model_fingerprint: str):
    batch = collate(lines, pad_id)
    hidden = engine.prefix_states(batch.input_ids.to(device), batch.attention_mask.to(device))  # (B, T, H)
    for i, line in enumerate(lines):
        n = len(line.input_ids)
        yield engine.prefix_key(batch.input_ids[i, :n], model_fingerprint), hidden[i, :n]


def open_store(plan_dir: Path):
    """The plan's prefix store, or None when the plan has none."""
    from usaf.engine.prefix import PrefixStore

    if not (plan_dir / INDEX_FILE).is_file():
        return None
    return PrefixStore(plan_dir / STATES_FILE, plan_dir / INDEX_FILE)
