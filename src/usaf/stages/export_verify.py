"""Verifying an export on the way out: reload it with transformers and compare logits with a reference.

The reference never shares code with the writer:

- a dequantized-base export is compared with the usaf engine running the quantized model with the change
  applied (4-bit codes + sparse deltas, the forward training used): equal up to the export's rounding;
- a ``--base`` export is compared with the original model as transformers itself loads it, the deltas
  added to its in-memory tensors by index, the routers copied in, and each changed tensor rounded to the
  dtype it was written in (every tensor, under ``--dtype``): the same weights bit for bit, so the check
  is tight whatever the dtype. The engine's distance is also reported there, but it includes the 4-bit
  base's own error, so it is information, not a check.

Every model runs in fp32 (the export's weights are upcast exactly), so against the engine the tolerance
only has to cover the export dtype's rounding of the merged weights. Models are loaded one after
another, never together.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from usaf.artifacts.hf_export import VerifyRecord
from usaf.artifacts.run import TrainedChange
from usaf.errors import UsafError
from usaf.families import FamilySpec, load_model_config, resolve_family
from usaf.families.modules import FusedView, transformers_config, usaf_state_dict
from usaf.stages.change import model_with_change
from usaf.stages.progress import Progress

SEQUENCES = 4
TOKENS = 24
# max |logit difference| allowed, relative to max(1, max |reference logit|), by the dtype the expert weights
# are written in: fp32 leaves only summation-order noise; against the engine, bf16/fp16 round every merged
# weight (tiny models of every family, logits below 1: up to 2e-3 for bf16, 4e-4 for fp16).
RELATIVE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def probe_ids(spec: FamilySpec, seed: int = 0) -> torch.Tensor:
    """``(SEQUENCES, TOKENS)`` token ids, seeded: the same probe for every export of a model."""
    config = spec.config.get(spec.nested_in, spec.config) if spec.nested_in else spec.config
    vocab = int(config["vocab_size"])
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (SEQUENCES, TOKENS), generator=generator)


@torch.no_grad()
def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(input_ids=ids.to(device), use_cache=False).logits.float().cpu()  # (B, T, V)


def _load_hf(path: Path, device: torch.device, what: str) -> torch.nn.Module:
    hf_logging.disable_progress_bar()  # a per-tensor loading bar would bury the export's own progress

    config = transformers_config(path, resolve_family(load_model_config(path)))  # 4.x: renamed fields
    model, info = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float32, output_loading_info=True, trust_remote_code=False
    )
    problems = {k: sorted(v)[:4] for k, v in info.items() if k != "error_msgs" and v} | (
        {"errors": info["error_msgs"][:2]} if info.get("error_msgs") else {}
    )
    if problems:
        raise UsafError(
            f"verification failed: {what} {path} does not load cleanly with transformers: {problems}",
            "this is a bug in usaf export; pass --no-verify only to inspect the output",
        )
    return model.to(device).eval()


def _engine_logits(model_dir: Path, change: TrainedChange | None, ids: torch.Tensor, device: torch.device):
    """Logits of the engine's model (freed on return: one model in memory at a time)."""
    logits = logits_of(model_with_change(model_dir, change, device=device), ids)
    gc.collect()
    return logits


def _original_logits(
    base_dir: Path,
    spec: FamilySpec,
    change: TrainedChange,
    ids: torch.Tensor,
    device: torch.device,
    written: dict[str, torch.dtype],
    override: torch.dtype | None,
):
    """Logits of the original model as transformers loads it, without and with the change (rounded as written)."""
    original = _load_hf(base_dir, device, "--base")
    before = logits_of(original, ids)
    view = FusedView(original, spec)  # usaf's names on either transformers layout
    with torch.no_grad():
        if override is not None:  # --dtype cast every other floating tensor of the checkpoint
            for name, tensor in usaf_state_dict(original, spec).items():
                if tensor.is_floating_point() and name not in written:
                    view.set(name, tensor.to(override))
    add_change_in_memory(original, spec, change)
    with torch.no_grad():
        for name, dtype in written.items():  # merged in fp32, then rounded once to the written dtype
            view.set(name, view.get(name).to(dtype))
    after = logits_of(original, ids)
    del original
    gc.collect()
    return before, after


@torch.no_grad()
def add_change_in_memory(model: torch.nn.Module, spec: FamilySpec, change: TrainedChange) -> None:
    """Add the deltas to a transformers model's in-memory expert parameters and copy the routers in.

    Indices are unravelled into ``(e, o, i)`` of the stored orientation and written at ``[e, o, i]``,
    or at ``[e, i, o]`` for a transposed (gpt-oss) layout: no fusing or splitting code involved.
    """
    view = FusedView(model, spec)  # transformers 4.x: a fused copy of the per-expert weights, written back
    for name, (indices, values) in change.deltas.items():
        param = view.get(name)
        e, a, b = param.shape
        o, i = (b, a) if spec.layout.transposed else (a, b)  # stored (E, O, I)
        idx = indices.to(param.device)
        expert, rest = idx // (o * i), idx % (o * i)
        row, col = rest // i, rest % i
        at = (expert, col, row) if spec.layout.transposed else (expert, row, col)
        param[at] += values.to(param.device).to(param.dtype)
        view.set(name, param)
    for name, weight in change.routers.items():
        view.set(name, weight)


def verify(
    out_dir: Path,
    *,
    spec: FamilySpec,
    model_dir: Path,
    change: TrainedChange,
    base_dir: Path | None,
    expert_dtype: torch.dtype,
    written: dict[str, torch.dtype],
    override: torch.dtype | None,
    device: torch.device,
    progress: Progress,
) -> VerifyRecord:
    """Compare the export's logits with the reference's; raise UsafError when they differ beyond tolerance.

    Args:
        expert_dtype: the least precise dtype expert weights were written in (sets the engine tolerance).
        written: in-memory name -> dtype of every tensor the change was written into.
        override: --dtype, if every floating tensor was cast.
    """
    ids = probe_ids(spec)
    progress.start("verifying the export", 3, "models")
    engine_base = _engine_logits(model_dir, None, ids, device)
    engine_logits = _engine_logits(model_dir, change, ids, device)
    progress.advance(1)
    if base_dir is None:
        reference, before = engine_logits, engine_base
    else:
        before, reference = _original_logits(base_dir, spec, change, ids, device, written, override)
    progress.advance(1)
    out_logits = logits_of(_load_hf(out_dir, device, "the export"), ids)
    gc.collect()
    progress.advance(1)
    progress.finish()
    diff = float((out_logits - reference).abs().max())
    exact = base_dir is not None  # the reference holds the written weights bit for bit
    rtol = RELATIVE_TOLERANCE[torch.float32] if exact else RELATIVE_TOLERANCE.get(expert_dtype, 3e-2)
    tolerance = rtol * max(1.0, float(reference.abs().max()))
    record = VerifyRecord(
        sequences=SEQUENCES,
        tokens_per_sequence=TOKENS,
        reference="engine" if base_dir is None else "original+change",
        max_abs_diff=diff,
        tolerance=tolerance,
        engine_max_abs_diff=None if base_dir is None else float((out_logits - engine_logits).abs().max()),
        change_max_abs_effect=float((reference - before).abs().max()),
    )
    if not diff <= tolerance:  # also catches NaN
        raise UsafError(
            f"verification failed: the reloaded export's logits differ from the {record.reference}'s by up to "
            f"{diff:.3g} (tolerance {tolerance:.3g}); nothing was written",
            "this is a bug in usaf export; please report it with the manifest of --model and --checkpoint",
        )
    return record
