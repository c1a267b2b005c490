"""``usaf score``: masks, importance maps and routing statistics from calibration data."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from usaf.cli.options import (
    BudgetOpt,
    CalibSamplesOpt,
    ConfigOpt,
    DeviceOpt,
    DistBackendOpt,
    FracOpt,
    JsonOpt,
    LayersOpt,
    OverwriteOpt,
    StatisticOpt,
    StreamExpertsOpt,
    TrainFromOpt,
    VerboseOpt,
    WorkspaceOpt,
)


def command(
    model: Annotated[
        Path | None, typer.Option(help="Quantized model directory [default: newest in the workspace].")
    ] = None,
    data: Annotated[
        Path | None, typer.Option(help="Tokens directory (usaf tokenize) or tokens JSONL [default: newest matching].")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Output directory [default: WORKSPACE/plan/<time>-<name>].")] = None,
    frac: FracOpt = None,
    train_from: TrainFromOpt = None,
    layers: LayersOpt = None,
    calib_samples: CalibSamplesOpt = None,
    statistic: StatisticOpt = None,
    budget: BudgetOpt = None,
    router: Annotated[
        bool | None, typer.Option("--router/--no-router", help="Train the routers too [default: on].")
    ] = None,
    microbatch: Annotated[int | None, typer.Option(help="Sequences per backward [default: 4].")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of the calibration sample [default: 0].")] = None,
    candidates_factor: Annotated[
        int | None,
        typer.Option(
            help="Candidates kept per tensor as a multiple of its budget; larger is closer to exact [default: 4]."
        ),
    ] = None,
    full_maps: Annotated[
        bool | None, typer.Option("--full-maps", help="Exact, full-size importance maps (memory: 4 bytes per weight).")
    ] = None,
    stability: Annotated[
        bool | None,
        typer.Option("--stability/--no-stability", help="Measure mask overlap of two data halves [default: on]."),
    ] = None,
    cache: Annotated[
        bool | None,
        typer.Option(
            "--cache/--no-cache",
            help="Store every training sequence's frozen-prefix state in the plan, so train starts at once "
            "[default: off].",
        ),
    ] = None,
    overwrite: OverwriteOpt = False,
    device: DeviceOpt = None,
    dist_backend: DistBackendOpt = None,
    stream_experts: StreamExpertsOpt = None,
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
    json_output: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Pick the expert weights to train by gradient importance on calibration data (a plan for usaf train)."""
    from usaf.cli.stage import run_stage

    run_stage(
        "score",
        cli={
            "model": model,
            "data": data,
            "out": out,
            "workspace": workspace,
            "frac": frac,
            "train_from": train_from,
            "layers": layers or None,
            "calib_samples": calib_samples,
            "statistic": statistic,
            "budget": budget,
            "router": router,
            "device": device,
            "dist_backend": dist_backend,
            "stream_experts": stream_experts,
            "microbatch": microbatch,
            "seed": seed,
            "candidates_factor": candidates_factor,
            "full_maps": full_maps,
            "stability": stability,
            "cache": cache,
            "overwrite": overwrite or None,
        },
        config_file=config,
        json_output=json_output,
        verbose=verbose,
        summary=_print_summary,
    )


def _print_summary(console, manifest, path: Path) -> None:
    from rich.table import Table

    s = manifest.summary
    table = Table(title=f"plan → {path}", title_justify="left")
    for column in ("layer", "tensor", "selected", "budget", "experts used", "stability"):
        table.add_column(column, justify="left" if column == "tensor" else "right")
    for t in s.tensors:
        used = sum(1 for n in t.per_expert if n)
        table.add_row(
            str(t.layer),
            t.name.rsplit(".", 1)[-1],
            f"{t.selected:,}",
            f"{t.budget:,}",
            f"{used}/{len(t.per_expert)}",
            "-" if t.stability is None else f"{t.stability:.3f}",
        )
    console.print(table)
    hottest = []
    for layer in s.routing:
        total = max(sum(layer.tokens_per_expert), 1)
        top = max(range(len(layer.tokens_per_expert)), key=lambda e: layer.tokens_per_expert[e])
        hottest.append(
            f"L{layer.layer}: expert {top} {layer.tokens_per_expert[top] / total:.0%}, {layer.dead_experts} dead"
        )
    console.print(
        f"{s.expert_entries:,} expert weights + {s.router_params:,} router weights = {s.trainable_params:,} trainable "
        f"({s.budget}, frac {s.frac}, |{s.statistic}| over {s.calib_samples} sequences / {s.calib_tokens:,} tokens"
        + (f"; mask stability {s.stability_mean:.3f}" if s.stability_mean is not None else "")
        + ")"
    )
    console.print("hottest experts: " + "; ".join(hottest))
    if s.prefix_cache is not None:
        from usaf.units import human_bytes

        c = s.prefix_cache
        console.print(
            f"prefix cache: {c.samples:,} sequences / {c.tokens:,} tokens entering layer {c.start} "
            f"({human_bytes(c.bytes)}, {c.dtype})"
        )
