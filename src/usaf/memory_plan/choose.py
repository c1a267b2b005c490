"""Picking settings that fit: the first candidate, in order of preference, whose every stage fits.

Preference: every expert on the device before streaming them from host memory (streaming adds transfers to
every forward through the frozen layers: prefix capture, score, eval); within a placement, more trainable
layers (up to ``usaf score``'s default, the top quarter) before a larger microbatch, because gradient
accumulation recovers the batch (same sequences per step, slower) while nothing recovers a layer. Settings
the user gave (``--train-from``, ``--microbatch``) are kept as given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from usaf.errors import UsafError
from usaf.memory_plan import stages as st
from usaf.memory_plan import weights as w
from usaf.memory_plan.model import ModelFacts
from usaf.memory_plan.sizes import gib
from usaf.memory_plan.source import QuantSettings
from usaf.memory_plan.target import GIB, RESERVE, Target
from usaf.settings.fields import DEFAULT_TARGETS, default_frac
from usaf.units import counted

DEFAULT_MICROBATCH = 2  # usaf train's default
DEFAULT_PREFIX_CACHE = 2 * GIB  # usaf train's --prefix-cache-gib default, used when the data size is unknown


@dataclass(frozen=True)
class Request:
    """What the user fixed; ``None`` = the planner chooses."""

    seq_len: int = 512
    frac: float | None = None  # None: usaf score's default for the trainable layers' size
    microbatch: int | None = None
    train_from: int | None = None
    samples: int | None = None  # training sequences, to size the prefix cache
    targets: tuple[str, ...] = DEFAULT_TARGETS  # --targets


@dataclass(frozen=True)
class Plan:
    target: Target
    settings: st.Settings
    stages: tuple[st.StagePlan, ...]
    fits: bool
    shortfalls: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    prefix_total: int | None = None  # bytes of every training sequence's prefix state, when --samples is known


def plan_memory(m: ModelFacts, quant: QuantSettings, target: Target, request: Request) -> Plan:
    """The preferred settings that fit every stage, or (``fits=False``) the smallest settings and what is short."""
    candidates = list(_candidates(m, target, request))
    plans = []
    for settings in candidates:
        settings = _with_prefix(m, quant, target, request, _with_frozen_resident(m, quant, target, settings))
        stages = tuple(st.all_stages(m, quant, target, settings))
        short = _shortfalls(target, stages)
        plans.append((settings, stages, short))
        if not short:
            break
    settings, stages, short = plans[-1]
    notes = _notes(m, quant, target, request, settings, fits=not short)
    return Plan(target, settings, stages, not short, tuple(short), tuple(notes), _prefix_total(m, target, request))


def _layer_options(m: ModelFacts, request: Request) -> list[tuple[int, ...]]:
    moe = m.spec.moe_layers
    if request.train_from is not None:
        chosen = tuple(layer for layer in moe if layer >= request.train_from)
        if not chosen:
            raise UsafError(
                f"--train-from {request.train_from}: no MoE layer at or above it", f"MoE layers: {list(moe)}"
            )
        return [chosen]
    return [tuple(moe[-n:]) for n in range(w.default_layer_count(m), 0, -1)]


def _candidates(m: ModelFacts, target: Target, request: Request):
    placements = ("device", "stream") if target.separate_device else ("host",)
    fixed = request.microbatch is not None
    first = request.microbatch if fixed else DEFAULT_MICROBATCH
    microbatches = [first] if fixed else list(range(first, 0, -1))
    for placement in placements:
        for layers in _layer_options(m, request):
            for mb in microbatches:
                accum = 1 if fixed else math.ceil(DEFAULT_MICROBATCH / mb)
                frac = _frac(m, request, layers)
                dense = _dense_layers(m, request, layers)
                yield st.Settings(
                    layers, mb, accum, request.seq_len, frac, placement, targets=request.targets, dense_layers=dense
                )


def _dense_layers(m: ModelFacts, request: Request, layers: tuple[int, ...]) -> tuple[int, ...]:
    """The dense layers that train with MoE ``layers`` (``--targets dense``): those at or above the first one, as
    ``usaf score`` chooses them."""
    if "dense" not in request.targets:
        return ()
    first = request.train_from if request.train_from is not None else layers[0]
    return tuple(layer for layer in m.spec.dense_layers if layer >= first)


def _frac(m: ModelFacts, request: Request, layers: tuple[int, ...]) -> float:
    """The share usaf score selects on these layers: ``--frac`` as given, else its default for their size."""
    if request.frac is not None:
        return request.frac
    shapes = w.trained_shapes(m, layers + _dense_layers(m, request, layers), request.targets)
    return default_frac(sum(w.numel(shape) for shape in shapes))


def _prefix_total(m: ModelFacts, target: Target, request: Request) -> int | None:
    if request.samples is None:
        return None
    return request.samples * request.seq_len * m.spec.hidden_size * target.c


def _with_frozen_resident(m: ModelFacts, q: QuantSettings, t: Target, s: st.Settings) -> st.Settings:
    """Score's and train's choice (``usaf.stages.engine_setup.frozen_layers_resident``): the frozen layers'
    experts dequantized once when they fit in ``RESIDENT_SHARE`` of what the stages leave free where the experts
    live; never when streaming."""
    frozen = w.frozen_layer_count(m, s.train_from)
    if not frozen or s.placement == "stream":
        return s
    on_device = t.separate_device
    budget = t.usable(t.device_budget if on_device else t.host_budget)
    stages = [st.score_stage(m, q, t, s), st.train_stage(m, q, t, s)]
    used = max(p.device_peak if on_device else p.host_peak for p in stages)
    fits = w.resident_bytes(m, frozen, t.c) <= w.RESIDENT_SHARE * (budget - used)
    return replace(s, frozen_resident=fits)


def _with_prefix(m: ModelFacts, q: QuantSettings, t: Target, request: Request, s: st.Settings) -> st.Settings:
    """Prefix cache: as much as the host has room for after everything else train holds, the rest on disk."""
    if s.train_from == 0:
        return s
    total = _prefix_total(m, t, request)
    room = t.usable(t.host_budget) - st.train_stage(m, q, t, s).host_peak
    ram = max(0, min(DEFAULT_PREFIX_CACHE if total is None else total, room))
    # Whole MiB (the value becomes train's --prefix-cache-gib), rounded up when that still fits: a small
    # cache rounded down to 0 would send every state to disk.
    whole = ram - ram % 2**20
    ram = whole + 2**20 if ram % 2**20 and whole + 2**20 <= room else whole
    disk = 0 if total is None else max(0, total - ram)
    return replace(s, prefix_ram=ram, prefix_disk=disk)


def _shortfalls(t: Target, stages: tuple[st.StagePlan, ...]) -> list[str]:
    out = []
    for plan in stages:
        checks = [("host memory", plan.host_peak, t.host_budget, "--ram")]
        if t.separate_device:
            checks.insert(0, ("device memory", plan.device_peak, t.device_budget, "--vram"))
        for what, need, budget, flag in checks:
            usable = t.usable(budget)
            if need > usable:
                short = need - usable  # under 0.01 GiB read "0.00 GiB short" (found in review)
                shortfall = f"{gib(short)} GiB" if short >= 2**30 // 100 else f"{max(short // 2**20, 1)} MiB"
                out.append(
                    f"{plan.stage} needs {gib(need)} GiB of {what}; {flag} {gib(budget)} GiB leaves {gib(usable)} "
                    f"after the {RESERVE:.0%} reserve: {shortfall} short"
                )
    return out


def _notes(m: ModelFacts, q: QuantSettings, t: Target, request: Request, s: st.Settings, *, fits: bool) -> list[str]:
    notes = []
    if t.kind == "directml":
        notes.append(
            "usaf does not train on DirectML yet (torch-directml pins torch 2.4.1, which transformers 5 refuses; "
            "see README): this plan sizes a DirectML card, its context cost is the CUDA one, assumed"
        )
    default = w.default_layer_count(m)
    if fits and request.train_from is None and len(s.layers) < default:
        notes.append(
            f"{counted(len(s.layers), 'trainable layer')} instead of usaf score's default {default} (the top quarter): "
            "more do not fit"
        )
    if "dense" in request.targets and not s.dense_layers:
        where = f"the dense layers are {list(m.spec.dense_layers)}" if m.spec.dense_layers else "the model has none"
        notes.append(
            f"--targets dense: no dense layer at or above layer {s.train_from} ({where}); usaf score refuses it "
            "there: train from the lowest dense layer (--train-from), or drop dense from --targets"
        )
    if s.placement == "stream":
        notes.append(
            "this plan keeps the 4-bit experts in host memory and streams the frozen layers' to the device one "
            "layer ahead (usaf score/train --stream-experts; chosen by default when they would take over half "
            "the device's free memory)"
        )
    if s.placement == "device" and fits and request.train_from is None:
        more = _stream_alternative(m, q, t, request, len(s.layers))
        if more:
            notes.append(f"with --stream-experts {more} trainable layers would fit at microbatch 1")
    if s.train_from > 0 and request.samples is None:
        notes.append(
            f"prefix cache: {s.seq_len * m.spec.hidden_size * t.c / 2**10:.0f} KiB per training sequence; pass "
            "--samples N to size it"
        )
    per_sequence = st.eval_bytes_per_sequence(m, t, s)
    notes.append(
        f"eval: {per_sequence / 2**10:.0f} KiB more per sequence evaluated ({gib(1000 * per_sequence)} GiB for 1,000): "
        "the base pass's states for the fine-tuned pass, and both passes' routing sets; usaf eval checks them "
        "against the free RAM and names the --max-sequences that fits"
    )
    if t.kind == "cpu" and t.dtype != "float32":  # measured (review, 2026-12-07): not what this model counts
        notes.append(
            f"--dtype {t.dtype} on the CPU took more memory than float32 where measured (score 2.6 against 1.5 GB, "
            "train 1.9 against 1.4 GB, on a 6-layer model), not the less this plan counts: float32, the CPU's "
            "default, is the one these figures were checked at"
        )
    return notes


def _stream_alternative(m: ModelFacts, q: QuantSettings, t: Target, request: Request, have: int) -> int | None:
    """The most trainable layers the streaming placement fits, if more than ``have``."""
    for layers in _layer_options(m, request):
        if len(layers) <= have:
            return None
        frac = _frac(m, request, layers)
        dense = _dense_layers(m, request, layers)
        settings = st.Settings(
            layers, 1, DEFAULT_MICROBATCH, request.seq_len, frac, "stream", targets=request.targets, dense_layers=dense
        )
        settings = _with_prefix(m, q, t, request, settings)
        if not _shortfalls(t, tuple(st.all_stages(m, q, t, settings))):
            return len(layers)
    return None
