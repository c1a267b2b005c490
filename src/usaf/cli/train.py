"""``usaf train``: sparse fine-tuning with RigL reselection, router co-training and exact resume."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from usaf.cli.flags import settings_command
from usaf.cli.options import NPROC, STAGE_EXTRAS


def _run(cli: dict[str, Any], *, nproc: int | None, config: Path | None, json_output: bool, verbose: bool) -> None:
    from usaf.cli.stage import relaunch_under_torchrun, run_stage

    if nproc is not None and nproc > 1:
        relaunch_under_torchrun(nproc, verbose=verbose)
    run_stage("train", cli=cli, config_file=config, json_output=json_output, verbose=verbose, summary=_print_summary)


command = settings_command(
    "usaf.settings.train:TrainConfig",
    _run,
    extras=(NPROC, *STAGE_EXTRAS),
    doc="""Train sparse deltas of the planned expert weights (+ routers) over the 4-bit base.

    Ctrl-C saves a checkpoint; the same command resumes from it exactly. Data parallel: run it under
    torchrun (or pass --nproc N).
    """,
)


def _print_summary(console, manifest, path: Path) -> None:
    from rich.table import Table

    from usaf.artifacts.run import PLAN_DIR
    from usaf.units import human_bytes

    s = manifest.summary
    table = Table(title=f"run → {path}", title_justify="left", show_header=False)
    table.add_column(justify="left")
    table.add_column(justify="right")
    trained = s.session_tokens if s.session_tokens is not None else s.tokens  # in s.seconds
    rate = trained / s.seconds if s.seconds else 0.0
    since = f" since the resume at step {s.resumed_at_step}" if s.resumed_at_step is not None else ""
    # scoring is counted where this start scored the run's plan (into RUN/plan, before its first step); it said so
    # of every run, a plan given or found included (found in review)
    scored = s.resumed_at_step is None and any(i.role == "plan" and Path(i.path) == path / PLAN_DIR
                                               for i in manifest.inputs)  # fmt: skip
    rows = [
        ("steps (skipped)", f"{s.steps} ({s.skipped_steps})"),
        ("tokens", f"{s.tokens:,}"),
        (f"wall time{since} (with loading{' and scoring' if scored else ''})",
         f"{s.seconds:,.0f} s ({rate:,.0f} tokens/s)"),
    ]
    if s.loss_window is not None:  # one step's loss is one microbatch's: the ends' means say where training went
        rows.append((f"train loss, mean of the first → last {s.loss_window} steps",
                     f"{s.first_losses_mean:.4f} → {s.last_losses_mean:.4f}"))  # fmt: skip
    else:
        rows.append(("train loss first → last", f"{s.first_loss:.4f} → {s.final_loss:.4f}"))
    if s.eval_losses:
        untrained = s.eval_losses[0][0] == 0  # measured before the first step (a run of an older usaf: not)
        label = "held-out loss untrained → trained" if untrained else "held-out loss first → last"
        first, last = (f"{loss:.4f}" if loss is not None and math.isfinite(loss) else "nan"
                       for loss in (s.eval_losses[0][1], s.eval_losses[-1][1]))  # fmt: skip
        rows.append((label, f"{first} → {last}"))
    rows += [
        ("layers", ", ".join(map(str, s.trainable_layers))),
        *([("lr", f"{s.lr:.1e} (from {s.lr_source})")] if s.lr is not None else []),
        ("delta weights + router weights", f"{s.expert_entries:,} + {s.router_params:,}"),
        ("reselections (grown in total)", f"{len(s.reselections)} ({sum(r.grown for r in s.reselections):,})"),
        ("dropped-and-kept entries", f"{s.frozen_entries:,}"),
    ]
    if s.changed_entries is not None:  # export's count; the two above overlap where a dropped entry grew back
        rows.append(("delta weights changed in all (export's count)", f"{s.changed_entries:,}"))
    if s.prefix_cache_hits is not None:
        rows.append((f"prefix cache hits / misses{since}", f"{s.prefix_cache_hits:,} / {s.prefix_cache_misses:,}"))
    if s.checkpoints:  # what the run holds on disk besides final/; --keep-checkpoints keeps fewer
        kept = manifest.config.get("keep_checkpoints")
        how = f"--keep-checkpoints {kept}" if kept else "all: --keep-checkpoints N"
        rows.append((f"checkpoints kept ({how})", f"{s.checkpoints} ({human_bytes(s.checkpoint_bytes or 0)})"))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    for warning in s.routing_warnings:
        console.print(f"warning: {warning}")
