"""How ``usaf plan`` shows a plan: one table (component x stage, device and host), the chosen settings,
the commands that use them, and the same as one JSON object."""

from __future__ import annotations

from typing import Any

from usaf.families.targets import default_targets
from usaf.memory_plan import PLACEMENTS, ModelFacts, ModelSource, Plan
from usaf.memory_plan.sizes import gib
from usaf.memory_plan.target import RESERVE


def commands(plan: Plan, facts: ModelFacts, source: ModelSource) -> list[str]:
    """The usaf commands that run with the chosen settings."""
    s, t = plan.settings, plan.target
    device = "" if t.kind == "cpu" else f" --device {t.device}"  # cuda:1 stays cuda:1 (found in review)
    placement = ""  # explicit: the default decides from the free device memory at run time
    if t.separate_device:
        placement = " --stream-experts" if s.placement == "stream" else " --no-stream-experts"
    out = []
    if source.quantized_dir is None:
        quant = source.quant
        out.append(f"usaf quantize {source.label} --nbits {quant.nbits} --group-size {quant.group_size}{device}")
    # the data at the planned length: score has no --seq-len and train's only cuts, so nothing ran at a --seq-len
    # planned longer than the tokens were packed (found in review)
    # sources held out, for eval to measure on: it was told --held-out DATA, the text trained on (found in review)
    out.append(f"usaf tokenize DATA --model {source.quantized_dir or source.label} --seq-len {s.seq_len} "
               "--held-out-frac 0.1")  # fmt: skip
    model = f" --model {source.quantized_dir}" if source.quantized_dir is not None else ""
    # --dtype on both: the plan's prefix states are kept in score's dtype, and train takes them only in its own
    score = (f"usaf score{model} --train-from {s.train_from} --frac {s.frac:g} --microbatch {s.microbatch} "
             f"--dtype {t.dtype}{device}")  # fmt: skip
    if s.targets != default_targets(facts.spec):
        score += f" --targets {','.join(s.targets)}"
    score += placement
    out.append(score)
    train = (
        f"usaf train{model} --microbatch {s.microbatch} --grad-accum {s.grad_accum} --seq-len {s.seq_len} "
        f"--dtype {t.dtype}{device}{placement}"
    )
    if s.train_from > 0:
        train += f" --prefix-cache-gib {s.prefix_ram / 2**30:.2f}"
    out.append(train)
    # the eval the table's column is for: its dtype (it has its own default), the rest at eval's defaults (review)
    # the run's tokens, a sample of its training split and its held-out split, where --held-out DATA evaluated the
    # text trained on as held out (found in review); with --model alone eval runs the base model only (review)
    # the frozen layers' experts as its column has them: at eval's default, the free memory decided, and a plan of
    # per-forward dequantization ran dequantized once, 0.2 GiB over it (found in review)
    frozen = (" --resident" if s.frozen_resident else " --streaming") if s.train_from > 0 else ""
    out.append(f"usaf eval{model} --checkpoint RUN --dtype {t.dtype}{device}{placement}{frozen}")
    return out


def setting_rows(plan: Plan, facts: ModelFacts, source: ModelSource) -> list[tuple[str, str]]:
    s, t = plan.settings, plan.target
    moe = facts.spec.moe_layers
    rows = [
        (
            "model",
            f"{source.label} ({facts.spec.model_type}: {facts.spec.num_layers} layers, {len(moe)} MoE, "
            f"{facts.spec.num_experts} experts, top-{facts.spec.top_k})",
        ),
        (
            "target",
            f"{t.kind}, {t.dtype}"
            + (f", {gib(t.device_budget)} GiB device" if t.separate_device else "")
            + f", {gib(t.host_budget)} GiB host; {RESERVE:.0%} of each kept free",
        ),
        ("quantization", f"{source.quant.nbits}-bit, {_groups(source.quant)} ({source.quant.source})"),
        (
            "trainable layers",
            f"--train-from {s.train_from}: {len(s.layers)} of {len(moe)} MoE layers "
            f"({s.layers[0]}-{s.layers[-1]})" + (f" and dense layers {list(s.dense_layers)}" if s.dense_layers else "")
            + f", frac {s.frac:g}",
        ),
        ("batch", f"--microbatch {s.microbatch} x --grad-accum {s.grad_accum}, --seq-len {s.seq_len}"),
        ("placement", f"{s.placement}: {PLACEMENTS[s.placement]}"),
        ("resident bases", "on the device" if t.separate_device else "in RAM"),
    ]
    if s.train_from > 0:
        frozen = "dequantized once (they fit)" if s.frozen_resident else "the routed ones dequantized per forward"
        rows.append(("frozen layers' experts", f"{frozen}: score's and train's choice at run time"))
        cache = f"{gib(s.prefix_ram)} GiB in RAM (--prefix-cache-gib)"
        if plan.prefix_total is not None:
            cache += f", {gib(s.prefix_disk)} GiB on disk (of {gib(plan.prefix_total)} GiB)"
        else:
            cache += ", the rest on disk"
        rows.append(("prefix cache", cache))
    else:
        rows.append(("prefix cache", "none (layer 0 trains: no frozen prefix)"))
    return rows


def render(console: Any, plan: Plan, facts: ModelFacts, source: ModelSource) -> None:
    t = plan.target
    sides = (("device", t.device_budget), ("host", t.host_budget)) if t.separate_device else (("host", t.host_budget),)
    for side, budget in sides:  # each side's own verdict: a host table said "does NOT fit" for a short device
        peaks = [s.device_peak if side == "device" else s.host_peak for s in plan.stages]  # (found in review)
        verdict = "fits" if max(peaks, default=0) <= t.usable(budget) else "does NOT fit"
        console.print(_side_table(plan, side, t.usable(budget), f"predicted peak {side} memory, GiB ({verdict})"))
    _render_settings(console, plan, facts, source)


def _side_table(plan: Plan, side: str, usable: int, title: str):
    """Components (rows) x stages (columns) for one side, device or host; components absent there are left out."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("component", no_wrap=True)
    for stage in plan.stages:
        table.add_column(stage.stage, justify="right")
    names: list[str] = []
    for stage in plan.stages:
        names += [c.name for c in stage.components if getattr(c, side) and c.name not in names]
    for name in names:
        cells = []
        for stage in plan.stages:
            found = next((c for c in stage.components if c.name == name), None)
            cells.append(gib(getattr(found, side)) if found is not None and getattr(found, side) else "")
        table.add_row(name, *cells)
    table.add_section()
    peaks = [stage.device_peak if side == "device" else stage.host_peak for stage in plan.stages]
    table.add_row("peak", *(f"[{'green' if p <= usable else 'red'}]{gib(p)}[/]" for p in peaks), style="bold")
    table.add_row(f"usable ({100 - RESERVE * 100:.0f} % of budget)", *([gib(usable)] * len(plan.stages)))
    return table


def _render_settings(console: Any, plan: Plan, facts: ModelFacts, source: ModelSource) -> None:
    from rich.table import Table

    settings = Table(
        title="chosen settings" if plan.fits else "smallest settings tried", title_justify="left", show_header=False
    )
    settings.add_column("", style="bold")
    settings.add_column("")
    for key, value in setting_rows(plan, facts, source):
        settings.add_row(key, value)
    console.print(settings)
    for line in plan.notes:
        console.print(f"note: {line}", markup=False)
    if plan.fits:
        console.print("commands:")
        for line in commands(plan, facts, source):
            console.print(f"  {line}", markup=False)


def plan_json(plan: Plan, facts: ModelFacts, source: ModelSource) -> dict[str, Any]:
    s, t = plan.settings, plan.target
    return {
        "model": source.label,
        "model_type": facts.spec.model_type,
        "fits": plan.fits,
        "shortfalls": list(plan.shortfalls),
        "target": {
            "kind": t.kind,
            "dtype": t.dtype,
            "device_bytes": t.device_budget,
            "host_bytes": t.host_budget,
            "reserve": RESERVE,
        },
        "quantization": {
            "nbits": source.quant.nbits,
            "group_size": source.quant.group_size,
            "source": source.quant.source,
        },
        "settings": {
            "train_from": s.train_from,
            "trainable_layers": sorted(s.layers + s.dense_layers),
            "microbatch": s.microbatch,
            "grad_accum": s.grad_accum,
            "seq_len": s.seq_len,
            "frac": s.frac,
            "targets": list(s.targets),
            "placement": s.placement,
            "stream_experts": s.placement == "stream",
            "frozen_layers_resident": s.frozen_resident,
            "prefix_cache_ram_bytes": s.prefix_ram,
            "prefix_cache_disk_bytes": s.prefix_disk if plan.prefix_total is not None else None,
            "prefix_cache_total_bytes": plan.prefix_total,
        },
        "stages": {
            stage.stage: {
                "device_peak_bytes": stage.device_peak if t.separate_device else None,
                "host_peak_bytes": stage.host_peak,
                "disk_bytes": stage.disk,
                "components": [
                    {"name": c.name, "device_bytes": c.device, "host_bytes": c.host, "basis": c.basis}
                    for c in stage.components
                ],
            }
            for stage in plan.stages
        },
        "notes": list(plan.notes),
        "commands": commands(plan, facts, source) if plan.fits else [],
    }


def _groups(quant: Any) -> str:
    """The group size, and those quantize used where it adjusted it to divide a tensor's width: the row said the
    requested 128 of a model whose experts were quantized in groups of 32 and 24 (found in review)."""
    used = sorted(set(quant.effective.values()))
    if not used or used == [quant.group_size]:
        return f"group {quant.group_size}"
    return f"group {quant.group_size} asked, {' and '.join(map(str, used))} used (each divides its tensor's width)"
