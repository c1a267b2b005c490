"""Option aliases shared by commands, so each flag is spelled and documented once.

Every flag defaults to ``None`` (= not set) so :func:`usaf.config.resolve_config` can tell a flag
the user gave from one that should fall through to ``USAF_*`` variables, ``--config`` or defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", help="TOML file of settings: the command's table over [defaults].", show_default=False),
]
WorkspaceOpt = Annotated[
    Path | None,
    typer.Option(
        "--workspace",
        help="Where stages write by default and look for their inputs [env: USAF_WORKSPACE; default: current dir].",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print a machine-readable JSON summary on stdout.")]
VerboseOpt = Annotated[
    bool, typer.Option("--verbose", "-v", help="Show tracebacks and debug logging.", envvar="USAF_VERBOSE")
]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace the output directory if it exists.")]
DeviceOpt = Annotated[
    str | None,
    typer.Option(
        "--device",
        help="auto|cpu|cuda|cuda:N|mps|directml [env: USAF_DEVICE; legacy USE_CUDA=1 means cuda].",
        show_default=False,
    ),
]

DistBackendOpt = Annotated[
    str | None,
    typer.Option(
        "--dist-backend",
        help="Under torchrun: gloo | nccl [default: nccl on CUDA, else gloo].",
        show_default=False,
    ),
]

StreamExpertsOpt = Annotated[
    bool | None,
    typer.Option(
        "--stream-experts/--no-stream-experts",
        help="Keep the 4-bit experts in host memory and stream the frozen layers' to the device one layer "
        "ahead [default: when they would take over half the free device memory].",
        show_default=False,
    ),
]


# Selection options shared by `usaf score` and `usaf train` (which scores on the fly without a plan).
FracOpt = Annotated[
    float | None, typer.Option(help="Fraction of the trainable layers' expert weights [default: 0.005].")
]
TrainFromOpt = Annotated[int | None, typer.Option(help="First trainable layer (every MoE layer from it up).")]
LayersOpt = Annotated[list[int] | None, typer.Option("--layers", help="A trainable MoE layer (repeatable).")]
CalibSamplesOpt = Annotated[int | None, typer.Option(help="Calibration sequences [default: 64].")]
StatisticOpt = Annotated[str | None, typer.Option(help="grad (|g|, default) | grad2 (g²) | grad_x_weight (|w·g|).")]
BudgetOpt = Annotated[
    str | None, typer.Option(help="per-tensor (default) | per-layer | global | per-expert: how --frac is spread.")
]
