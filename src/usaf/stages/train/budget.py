"""``usaf train --vram/--ram``: the memory planner's choice for the settings a user left unset.

The same planner as ``usaf plan`` (:mod:`usaf.memory_plan`), on the quantized model's own ``config.json``
and quantization settings, for this run's device kind and dtype, its data (sequence length, number of
training sequences) and its plan's trainable layers. It fills in what was not given — microbatch and
accumulation, where the 4-bit experts live (``--stream-experts``), the prefix cache's RAM and, when no plan
exists yet, the first trainable layer — and refuses, naming what is short, when nothing fits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from usaf.config import source_of
from usaf.errors import UsafError
from usaf.families.targets import resolve_targets
from usaf.settings.fields import EXPERTS_ONLY, parse_targets
from usaf.stages.progress import Progress

_KINDS = {"cpu": "cpu", "cuda": "cuda", "privateuseone": "directml"}  # torch device type -> planner kind


def data_seq_len(config: Any, data: Any) -> int:
    """The run's longest sequence in tokens: the data's longest line, cut to ``--seq-len``. A ``--seq-len`` above the
    data's lines was planned for as given, and refused memory the run never used; the longest of the first 256 lines
    (without ``--seq-len``) missed a longer one further on in a file not packed by usaf tokenize (found in review)."""
    return min(data.longest, config.seq_len or data.longest)


def apply_budget(config: Any, model_dir: Path, backend: Any, data: Any, plan_summary: Any, progress: Progress) -> Any:
    """``config`` with the planner's settings where the user gave none; unchanged without --vram/--ram.

    Args:
        config: the run's :class:`~usaf.stages.train.config.TrainConfig`.
        model_dir: the quantized model.
        backend: the resolved backend (its device kind; its memory when a budget is not given).
        data: the training :class:`~usaf.data.dataset.TokenDataset`.
        plan_summary: the plan's :class:`~usaf.artifacts.plan.PlanSummary` when a plan is known, else None (the
            planner picks the first trainable layer). Its frac and trainable layers decide the run, whatever
            ``config`` says.
    """
    kind = _KINDS.get(backend.device.type)
    if config.vram is not None and kind == "cpu" and source_of(config, "vram") != "--vram":
        # from USAF_VRAM or a [train] table, set for a GPU machine: it engaged the planner with no budget given and
        # shrank the prefix cache (found in review); the flag itself is refused below, a value that is no size too
        from usaf.memory_plan import parse_size  # lazy: the planner only when --vram/--ram are given

        parse_size(config.vram, flag=source_of(config, "vram"))
        progress.note(f"{source_of(config, 'vram')} {config.vram}: not used, this run computes on the CPU (no device "
                      "memory)")  # fmt: skip
        config = config.model_copy(update={"vram": None})
    if config.vram is None and config.ram is None:
        return config
    # lazy: the planner (a meta-device model) only when --vram/--ram are given
    from usaf.memory_plan import Request, make_target, model_facts, parse_size, plan_memory, read_model

    if kind is None:
        raise UsafError(
            f"--vram/--ram: the memory planner models cpu, cuda and directml, not {backend.device.type}",
            "drop --vram/--ram and set --microbatch and --stream-experts yourself",
        )
    if kind == "cpu" and config.vram is not None and source_of(config, "vram") == "--vram":
        raise UsafError(  # else planned for RAM alone, the --vram given read and dropped
            f"--vram {config.vram}: this run computes on the CPU, which has no device memory",
            "drop --vram (--ram sizes the run), or pass --device cuda",
        )
    memory = backend.memory()
    vram = parse_size(config.vram, flag=source_of(config, "vram")) if config.vram else memory.device_total
    ram = parse_size(config.ram, flag=source_of(config, "ram")) if config.ram else memory.host_total
    target = make_target(kind, None if config.dtype == "auto" else config.dtype, vram if kind != "cpu" else None, ram)
    source = read_model(str(model_dir), nbits=None, group_size=None)
    given = config.model_fields_set
    first_layer = plan_summary.trainable_layers[0] if plan_summary is not None else None
    train_from = first_layer
    if train_from is None:
        train_from = min(config.layers) if config.layers else config.train_from
    facts = model_facts(source.config)
    request = Request(
        seq_len=data_seq_len(config, data),
        frac=plan_summary.frac if plan_summary is not None else config.frac,  # a plan's masks are already this size
        microbatch=config.microbatch if "microbatch" in given else None,
        train_from=train_from,
        samples=len(data),
        targets=parse_targets(plan_summary.targets or EXPERTS_ONLY) if plan_summary is not None
        else resolve_targets(config.targets, facts.spec),
    )  # fmt: skip
    plan = plan_memory(facts, source.quant, target, request)
    # The model is already quantized and eval is another command: only train (and scoring on the fly) count.
    relevant = ("train", "score") if first_layer is None else ("train",)
    short = [line for line in plan.shortfalls if line.split(" ", 1)[0] in relevant]
    if short:  # with a plan its masks' size and layers are fixed: naming --frac there named a refused flag (review)
        smaller = "a plan with a smaller --frac or fewer trainable layers" if plan_summary is not None else (
            "a smaller --frac or fewer trainable layers")
        named = "/".join(source_of(config, f) for f in ("vram", "ram") if getattr(config, f) is not None)
        raise UsafError(  # it said "--vram/--ram" of a run given --ram alone (found in review)
            f"{named}: nothing fits: " + "; ".join(short),
            f"more memory, a shorter --seq-len, or {smaller}; usaf plan shows the table",
        )
    s = plan.settings
    updates: dict[str, Any] = {}
    if "microbatch" not in given:
        updates["microbatch"] = s.microbatch
        if "grad_accum" not in given:
            updates["grad_accum"] = s.grad_accum
    if config.stream_experts is None and target.separate_device:
        updates["stream_experts"] = s.placement == "stream"
    if "prefix_cache_gib" not in given and s.train_from > 0:
        updates["prefix_cache_gib"] = s.prefix_ram / 2**30
    if first_layer is None and config.train_from is None and not config.layers:
        updates["train_from"] = s.train_from
    chosen = ", ".join(f"--{k.replace('_', '-')} {v:.4g}" if isinstance(v, float) else f"--{k.replace('_', '-')} {v}"
                       for k, v in updates.items()) or "the settings as given"  # fmt: skip
    if s.train_from > 0:  # the frozen layers' experts as the peak was predicted for, not as the free memory allows
        how = "dequantized once" if s.frozen_resident else "dequantized per forward"
        chosen += f"; the frozen layers' experts {how}"
    progress.note(f"--vram/--ram: usaf plan's choice: {chosen} (train's predicted peak: {_peaks(plan)})")
    budgeted = config.model_copy(update=updates)
    budgeted._frozen_resident = bool(s.frozen_resident)
    return budgeted


def _peaks(plan: Any) -> str:
    # lazy: usaf.memory_plan only when --vram/--ram are given
    from usaf.memory_plan.sizes import gib

    train = next(stage for stage in plan.stages if stage.stage == "train")
    device = f"{gib(train.device_peak)} GiB device, " if plan.target.separate_device else ""
    return f"{device}{gib(train.host_peak)} GiB host"
