"""Verifying an export on the way out: reload it with transformers and compare its logits twice.

1. **Exact**: with the same weights built in memory by code that shares nothing with the writer
   (:mod:`usaf.stages.export_reference`: the dequantized base, or ``--base``'s original as transformers
   loads it, plus the deltas added by index and the routers, each tensor rounded once to the dtype it
   is written in). The same weights in the same forward give the same logits, so the tolerance is fp32
   noise whatever the export dtype: a delta dropped, doubled, negated or put in another expert, a router
   left out, a tensor misnamed or mis-laid is caught even when bf16 rounding is far larger than it.
2. **What was trained** (dequantized-base exports): the change's effect on the export's logits (export −
   the same model exported without the change) against its effect in the engine that trained it (engine
   with the change − engine without), in RMS over the probe logits. The export dtype's rounding of a
   pretrained model moves logits by far more than a fixed tolerance sized on random tiny models allowed
   (bf16 on the demo model: up to ~0.6 for logits of ~13), so the bound is measured on this very model:
   half the change's own effect, or twice what the rounding does to the untrained model when that is
   larger. With ``--base`` the engine's base is the 4-bit one, whose own error is not the export's: there
   the engine distance is information only.

Every model runs in fp32 (the export's weights are upcast exactly). Models are loaded one after another,
never together; the dequantized reference is built inside the reloaded export's module.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from usaf.artifacts.hf_export import VerifyRecord
from usaf.artifacts.run import TrainedChange
from usaf.errors import UsafError
from usaf.families import FamilySpec
from usaf.stages.change import model_with_change
from usaf.stages.export_reference import dequantized_reference, load_hf, logits_of, original_reference
from usaf.stages.progress import Progress

SEQUENCES = 4
TOKENS = 24
# max |logit difference| between the same weights run twice, relative to max(1, max |logit|): fp32
# summation-order noise (measured: 0 on CPU; 7e-6 of 13 between the engine and transformers in fp32)
EXACT_TOLERANCE = 1e-4
# The change's effect as exported may differ from the engine's (in RMS over the probe logits) by half of
# that effect, or, when the export dtype's rounding is larger, by twice the rounding of the untrained model
# (|(X - Xb) - (E - Eb)| <= |X - E| + |Xb - Eb|: about one rounding error each). A change dropped, doubled
# or put elsewhere misses by all of it, a negated one by twice it; rounding misses by far less (measured on
# the demo model, bf16/fp16: at most 10 % of the change; one routing flip at one token moved a max by 100x
# the fp16 rounding, which is why the max is not used here).
CHANGE_SHARE = 0.5
ROUNDING_FACTOR = 2.0
BUG_HINT = "this is a bug in usaf export; please report it with the manifest of --model and --checkpoint"


def probe_ids(spec: FamilySpec, seed: int = 0) -> torch.Tensor:
    """``(SEQUENCES, TOKENS)`` token ids, seeded: the same probe for every export of a model."""
    config = spec.config.get(spec.nested_in, spec.config) if spec.nested_in else spec.config
    vocab = int(config["vocab_size"])
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (SEQUENCES, TOKENS), generator=generator)


def _engine_logits(model_dir: Path, change: TrainedChange | None, ids: torch.Tensor, device: torch.device):
    """Logits of the engine's model (freed on return: one model in memory at a time)."""
    logits = logits_of(model_with_change(model_dir, change, device=device), ids)
    gc.collect()
    return logits


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
    """Compare the export's logits with the references'; raise UsafError when a check fails.

    Args:
        change: what was exported (no deltas and no routers: the quantized base alone).
        expert_dtype: the least precise dtype expert weights were written in (named in messages).
        written: in-memory name -> dtype of every tensor the change was written into.
        override: --dtype, if every floating tensor was cast.
    """
    ids = probe_ids(spec)
    progress.start("verifying the export", 3, "models")
    engine_base = _engine_logits(model_dir, None, ids, device)
    empty = not change.deltas and not change.routers
    engine = engine_base if empty else _engine_logits(model_dir, change, ids, device)
    progress.advance(1)
    exported = load_hf(out_dir, device, "the export")
    out = logits_of(exported, ids)
    progress.advance(1)
    if base_dir is None:  # built inside the export's module: every tensor overwritten from the quantized model
        before, reference = dequantized_reference(exported, model_dir, spec, change, ids, override)
        del exported
        gc.collect()
    else:
        del exported
        gc.collect()
        before, reference = original_reference(base_dir, spec, change, ids, device, written, override)
    progress.advance(1)
    progress.finish()
    record = _record(out, reference, before, engine, engine_base, original=base_dir is not None)
    _check(record, expert_dtype)
    return record


def _max_abs(t: torch.Tensor) -> float:
    return float(t.abs().max())


def _rms(t: torch.Tensor) -> float:
    return float(t.double().pow(2).mean().sqrt())


def _record(out, reference, before, engine, engine_base, *, original: bool) -> VerifyRecord:
    """The distances between the five sets of ``(B, T, V)`` logits, and the two tolerances.

    The exact check uses the max (one wrong logit is a bug); the change's effect is compared in RMS over
    every probe logit, which one routing decision flipped by the rounding at one token cannot dominate.
    """
    trained, exported = engine - engine_base, out - before  # the change's effect, in the engine and exported
    rounding, change = _rms(before - engine_base), _rms(trained)
    bound = max(CHANGE_SHARE * change, ROUNDING_FACTOR * rounding) + EXACT_TOLERANCE * max(1.0, _max_abs(engine))
    return VerifyRecord(
        sequences=SEQUENCES,
        tokens_per_sequence=TOKENS,
        reference="original+change" if original else "dequantized+change",
        max_abs_diff=_max_abs(out - reference),
        tolerance=EXACT_TOLERANCE * max(1.0, _max_abs(reference)),
        engine_max_abs_diff=_max_abs(out - engine),
        change_max_abs_effect=_max_abs(reference - before),
        change_rms=change,
        rounding_rms=None if original else rounding,
        change_effect_diff_rms=_rms(exported - trained),
        change_effect_tolerance=None if original else bound,
    )


def _check(v: VerifyRecord, expert_dtype: torch.dtype) -> None:
    if not v.max_abs_diff <= v.tolerance:  # also catches NaN
        built = "the --base original" if v.reference == "original+change" else "the dequantized base"
        raise UsafError(
            f"verification failed: the reloaded export's logits differ by up to {v.max_abs_diff:.3g} "
            f"(tolerance {v.tolerance:.3g}) from those of the weights it should hold ({built} plus the change, "
            "built in memory and rounded as written); nothing was written",
            BUG_HINT,
        )
    if v.change_effect_tolerance is not None and not v.change_effect_diff_rms <= v.change_effect_tolerance:
        dtype = str(expert_dtype).removeprefix("torch.")
        raise UsafError(
            "verification failed: the change moves the reloaded export's logits differently from the engine it "
            f"was trained in (RMS difference {v.change_effect_diff_rms:.3g}, tolerance "
            f"{dtype} rounding of the same model without the change, {v.rounding_rms:.3g}); nothing was written",
            BUG_HINT,
        )
