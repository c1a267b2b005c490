"""``usaf train``: sparse fine-tuning with RigL reselection, router co-training and exact resume."""

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
    StatisticOpt,
    StreamExpertsOpt,
    TrainFromOpt,
    VerboseOpt,
    WorkspaceOpt,
)

Opt = typer.Option


def command(
    model: Annotated[Path | None, Opt(help="Quantized model directory [default: newest in the workspace].")] = None,
    data: Annotated[Path | None, Opt(help="Tokens directory or JSONL [default: newest matching the model].")] = None,
    plan: Annotated[
        Path | None, Opt(help="Plan from usaf score [default: newest for the model, else scored now into RUN/plan].")
    ] = None,
    eval_data: Annotated[Path | None, Opt(help="Held-out tokens (a tokens dir uses its heldout.jsonl).")] = None,
    out: Annotated[Path | None, Opt(help="Run directory [default: WORKSPACE/run/<time>-<name>].")] = None,
    frac: FracOpt = None,
    train_from: TrainFromOpt = None,
    layers: LayersOpt = None,
    calib_samples: CalibSamplesOpt = None,
    statistic: StatisticOpt = None,
    budget: BudgetOpt = None,
    steps: Annotated[int | None, Opt(help="Optimizer steps (or --epochs).")] = None,
    epochs: Annotated[float | None, Opt(help="Passes over the data [default: 1].")] = None,
    seq_len: Annotated[int | None, Opt(help="Cut longer sequences to N tokens [default: as tokenized].")] = None,
    microbatch: Annotated[int | None, Opt(help="Sequences per forward [default: 2].")] = None,
    grad_accum: Annotated[int | None, Opt(help="Microbatches per optimizer step [default: 1].")] = None,
    lr: Annotated[float | None, Opt(help="Peak learning rate of the deltas [default: 3e-3].")] = None,
    router_lr: Annotated[float | None, Opt(help="Peak learning rate of the routers [default: 1e-4].")] = None,
    weight_decay: Annotated[float | None, Opt(help="Decoupled, toward the pretrained weights [default: 0].")] = None,
    clip: Annotated[float | None, Opt(help="Gradient-norm clip over all trainables [default: 1.0].")] = None,
    warmup: Annotated[float | None, Opt(help="Warmup as a fraction of the run [default: 0.05].")] = None,
    reselect_every: Annotated[
        int | None,
        Opt(help="Steps between RigL reselections; 0 = static mask [default: 50; static for runs of <= 50 steps]."),
    ] = None,
    reselect_fraction: Annotated[
        float | None, Opt(help="Initial fraction replaced, cosine to 0 at 75% [default: 0.2].")
    ] = None,
    aux_loss_coef: Annotated[float | None, Opt(help="The model's load-balancing loss weight [default: 0].")] = None,
    z_loss_coef: Annotated[float | None, Opt(help="Router z-loss weight [default: 0].")] = None,
    router: Annotated[bool | None, Opt("--router/--no-router", help="Train the routers [default: on].")] = None,
    eval_every: Annotated[
        int | None, Opt(help="Held-out loss every N steps; 0 = only at the end [default: 0].")
    ] = None,
    save_every: Annotated[int | None, Opt(help="Checkpoint every N steps [default: 50].")] = None,
    seed: Annotated[int | None, Opt(help="Seed of the data order [default: 0].")] = None,
    resume: Annotated[bool | None, Opt("--resume", help="Continue the interrupted run in --out.")] = None,
    overwrite: Annotated[bool | None, Opt("--overwrite", help="Replace --out.")] = None,
    dtype: Annotated[
        str | None, Opt(help="auto | float32 | bfloat16 | float16 (with dynamic loss scaling) [default: auto].")
    ] = None,
    device: DeviceOpt = None,
    dist_backend: DistBackendOpt = None,
    stream_experts: StreamExpertsOpt = None,
    prefix_cache_gib: Annotated[
        float | None,
        Opt(help="RAM for cached frozen-prefix states before they spill to the run's disk file [default: 2]."),
    ] = None,
    vram: Annotated[
        str | None,
        Opt(help="Device memory budget (12GiB, ...): usaf plan picks --microbatch, --grad-accum, --stream-experts, "
            "--prefix-cache-gib and (without a plan) --train-from where not given [default: this device's]."),
    ] = None,
    ram: Annotated[
        str | None, Opt(help="Host memory budget (32GiB, ...) for the same choice [default: this machine's].")
    ] = None,
    nproc: Annotated[
        int | None,
        Opt(
            "--nproc",
            min=1,
            help="Launch N data-parallel processes on this machine through torchrun (same as "
            "`torchrun --standalone --nproc-per-node N -m usaf train ...`).",
        ),
    ] = None,
    workspace: WorkspaceOpt = None,
    config: ConfigOpt = None,
    json_output: JsonOpt = False,
    verbose: VerboseOpt = False,
) -> None:
    """Train sparse deltas of the planned expert weights (+ routers) over the 4-bit base.

    Ctrl-C saves a checkpoint; the same command resumes from it exactly. Data parallel: run it under
    torchrun (or pass --nproc N).
    """
    from usaf.cli.stage import relaunch_under_torchrun, run_stage

    if nproc is not None and nproc > 1:
        relaunch_under_torchrun(nproc, verbose=verbose)

    run_stage(
        "train",
        cli={
            "model": model,
            "data": data,
            "plan": plan,
            "eval_data": eval_data,
            "out": out,
            "workspace": workspace,
            "frac": frac,
            "train_from": train_from,
            "layers": layers or None,
            "calib_samples": calib_samples,
            "statistic": statistic,
            "budget": budget,
            "steps": steps,
            "epochs": epochs,
            "seq_len": seq_len,
            "microbatch": microbatch,
            "grad_accum": grad_accum,
            "lr": lr,
            "router_lr": router_lr,
            "weight_decay": weight_decay,
            "clip": clip,
            "warmup": warmup,
            "reselect_every": reselect_every,
            "reselect_fraction": reselect_fraction,
            "aux_loss_coef": aux_loss_coef,
            "z_loss_coef": z_loss_coef,
            "router": router,
            "eval_every": eval_every,
            "save_every": save_every,
            "seed": seed,
            "resume": resume,
            "overwrite": overwrite,
            "device": device,
            "dist_backend": dist_backend,
            "stream_experts": stream_experts,
            "prefix_cache_gib": prefix_cache_gib,
            "vram": vram,
            "ram": ram,
            "dtype": dtype,
        },
        config_file=config,
        json_output=json_output,
        verbose=verbose,
        summary=_print_summary,
    )


def _print_summary(console, manifest, path: Path) -> None:
    from rich.table import Table

    s = manifest.summary
    table = Table(title=f"run → {path}", title_justify="left", show_header=False)
    table.add_column(justify="left")
    table.add_column(justify="right")
    rate = s.tokens / s.seconds if s.seconds else 0.0
    rows = [
        ("steps (skipped)", f"{s.steps} ({s.skipped_steps})"),
        ("tokens", f"{s.tokens:,}"),
        ("wall time (with loading and scoring)", f"{s.seconds:,.0f} s ({rate:,.0f} tokens/s)"),
        ("train loss first → last", f"{s.first_loss:.4f} → {s.final_loss:.4f}"),
    ]
    if s.eval_losses:
        rows.append(("held-out loss first → last", f"{s.eval_losses[0][1]:.4f} → {s.eval_losses[-1][1]:.4f}"))
    rows += [
        ("layers", ", ".join(map(str, s.trainable_layers))),
        ("expert weights + router weights", f"{s.expert_entries:,} + {s.router_params:,}"),
        ("reselections (grown in total)", f"{len(s.reselections)} ({sum(r.grown for r in s.reselections):,})"),
        ("dropped-and-kept entries", f"{s.frozen_entries:,}"),
    ]
    if s.prefix_cache_hits is not None:
        rows.append(("prefix cache hits / misses", f"{s.prefix_cache_hits:,} / {s.prefix_cache_misses:,}"))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    for warning in s.routing_warnings:
        console.print(f"warning: {warning}")
