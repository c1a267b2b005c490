"""``usaf plan MODEL``: predicted peak memory of every stage, and the settings that fit a machine."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from usaf.cli.flags import settings_command
from usaf.config import refuse_unused, source_of, was_given
from usaf.errors import UsafError


def _command(cli: dict[str, Any], *, config: Path | None, json_output: bool, verbose: bool) -> None:
    from usaf.cli.console import handle_errors

    with handle_errors(verbose):
        from usaf.cli.stage import say_environment
        from usaf.config import resolve_config
        from usaf.memory_plan.config import LEGACY_ENV, PlanConfig

        settings = resolve_config(PlanConfig, section="plan", cli=cli, config_file=config, legacy_env=LEGACY_ENV)
        say_environment(settings)
        _run(settings, json_output)


command = settings_command(
    "usaf.settings.plan:PlanConfig",
    _command,
    doc="""Predict the peak device and host memory of quantize, score, train and eval, and pick settings that fit.

    Reads config.json only (no weights). Not the same as the plan usaf score writes (masks of the weights to
    train): this predicts memory and chooses --train-from, --microbatch, where the 4-bit experts live and
    how much of the prefix cache stays in RAM. Exit 2 when nothing fits, saying what is short by how much.
    """,
)


def _run(settings: Any, json_output: bool) -> None:
    from usaf.cli.console import note, out, print_json
    from usaf.cli.plan_render import plan_json, render
    from usaf.families.targets import resolve_targets
    from usaf.memory_plan import Request, make_target, model_facts, parse_size, plan_memory, read_model

    kind, index = _device_kind(settings.device, settings.vram)
    source = read_model(settings.model, nbits=settings.nbits, group_size=settings.group_size)
    vram = parse_size(settings.vram, flag="--vram") if settings.vram is not None else _local_vram(kind, index, note)
    ram = parse_size(settings.ram, flag="--ram") if settings.ram is not None else _local_ram(note)
    target = make_target(kind, settings.dtype, vram, ram, index)
    facts = model_facts(source.config)
    targets = resolve_targets(settings.targets, facts.spec)
    _check_against_the_model(settings, source.config, facts, targets)
    fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(Request)}  # a subset of PlanConfig
    request = Request(**{**fields, "targets": targets})
    plan = plan_memory(facts, source.quant, target, request)
    if plan.settings.train_from == 0:  # nothing frozen runs first: accepted and unused (found in review)
        refuse_unused(settings, "samples", "the plan trains from layer 0, so no frozen prefix to size",
                      "drop it, or pass --train-from N above 0", note)  # fmt: skip
    if json_output:
        print_json(plan_json(plan, facts, source))
    else:
        render(out, plan, facts, source)
    if not plan.fits:
        # what was given is kept as given: "the smallest settings" and a fixed hint hid a --microbatch 100000 that
        # was the cause (found in review); named where it was set (a USAF_* variable, a --config table)
        given = [f"{source_of(settings, n)} {getattr(settings, n)}" for n in _CHOSEN if was_given(settings, n)]
        # each the way that needs less memory: fewer sequences a microbatch, a later first trained layer (a smaller
        # --train-from trains more layers: "smaller values than --train-from 40" pointed the wrong way; review)
        ways = [f"{'a smaller' if n == 'microbatch' else 'a larger'} {source_of(settings, n)} than "
                f"{getattr(settings, n)}" for n in _CHOSEN if was_given(settings, n)]  # fmt: skip
        raise UsafError(
            "nothing fits: " + "; ".join(plan.shortfalls) + " (at the smallest settings shown above"
            + (f", with {', '.join(given)} as given)" if given else ")"),
            f"more {'--ram' if kind == 'cpu' else '--vram/--ram'}, "
            + (f"{' or '.join(ways)} (or leave {'it' if len(ways) == 1 else 'them'} to the plan), " if ways else "")
            + "a shorter --seq-len, or a smaller --frac",
        )


_CHOSEN = ("microbatch", "train_from")  # what the plan chooses as small as needed where it is not given


def _check_against_the_model(settings: Any, config: dict, facts: Any, targets: tuple[str, ...]) -> None:
    """What score and train refuse, refused here too (found in review: --targets shared on a model without shared
    experts crashed the planner, --targets experts,shared planned without them, and a --seq-len past the model's
    context was said to fit, each printing commands that score or train then refused)."""
    missing = [kind for kind in targets if kind != "experts" and not facts.linear_targets.get(kind)]
    if missing:
        raise UsafError(
            f"--targets {','.join(missing)}: {facts.spec.model_type} has no {' or '.join(missing)} modules to train",
            "drop them from --targets",
        )
    text = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    context = text.get("max_position_embeddings")
    if isinstance(context, int) and settings.seq_len > context:
        raise UsafError(f"--seq-len {settings.seq_len} exceeds the model's context ({context} tokens)",
                        f"use at most {context}")  # fmt: skip


def _device_kind(device: str | None, vram: str | None) -> tuple[str, int | None]:
    """The device kind planned for, and the index of ``--device cuda:N`` (None: the default device)."""
    from usaf.backends.spec import parse_device_spec

    if device is None:
        return ("cuda" if vram is not None else "cpu"), None
    spec = parse_device_spec(device)
    if spec.kind == "auto":
        return ("cuda" if vram is not None else "cpu"), None
    if spec.kind not in ("cpu", "cuda", "directml"):
        raise UsafError(f"--device {device}: the planner models cpu, cuda and directml", "pass one of those")
    return spec.kind, spec.index


def _local_vram(kind: str, index: int | None, note) -> int | None:
    """The memory of this machine's GPU (``index``'s, else the default one) when planning for its own kind of device;
    else --vram is required."""
    if kind != "cuda":
        return None
    from usaf.backends import probe  # lazy: torch, only when planning for this machine's GPU

    gpu = probe("cuda")
    if not gpu.available:
        return None
    number = index or 0
    if number >= len(gpu.devices):
        raise UsafError(f"--device cuda:{number}: this machine has {len(gpu.devices)} CUDA device(s)",
                        "pass an index it has, or --vram for another machine's")  # fmt: skip
    total = int(gpu.devices[number].total_memory)
    note(f"--vram not given: planning for this machine's GPU {number} ({total / 2**30:.1f} GiB)")
    return total


def _local_ram(note) -> int:
    import psutil

    total = int(psutil.virtual_memory().total)
    note(f"--ram not given: planning for this machine's RAM ({total / 2**30:.1f} GiB)")
    return total
