"""The options that are not settings: they steer the command line itself, not a stage.

Every setting's flag is generated from its field in :mod:`usaf.settings` (:mod:`usaf.cli.flags`); these few
are the same for every command that takes them, and ``tests/test_options.py`` lists them as the only
parameters a command may have besides its settings model's fields.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated

import typer


def path_not_empty(value: str) -> Path:
    """A path flag's value; an empty one is refused: click read ``--out ""`` (an unset shell variable, ``--out
    "$OUT"``) as the current directory, and ``--base ""`` read it as the model (found in review)."""
    return Path(name_not_empty(value))


def name_not_empty(value: str) -> str:
    """A directory or hub id (``names_a_path``): refused empty, as :func:`path_not_empty`."""
    if value == "":
        raise typer.BadParameter("an empty path (an unset shell variable?): pass a path")
    return value


ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", help="TOML file of settings: the command's table over [defaults].", show_default=False,
                 parser=path_not_empty, metavar="<path>"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print a machine-readable JSON summary on stdout.")]
VerboseOpt = Annotated[
    bool, typer.Option("--verbose", "-v", help="Show tracebacks and debug logging.", envvar="USAF_VERBOSE")
]
NprocOpt = Annotated[
    int | None,
    typer.Option(
        "--nproc",
        min=1,
        help="Launch N data-parallel processes on this machine through torchrun (same as "
        "`torchrun --standalone --nproc-per-node N -m usaf train ...`).",
    ),
]


def _param(name: str, annotation: object, default: object) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)


CONFIG = _param("config", ConfigOpt, None)
JSON = _param("json_output", JsonOpt, False)
VERBOSE = _param("verbose", VerboseOpt, False)
NPROC = _param("nproc", NprocOpt, None)

STAGE_EXTRAS = (CONFIG, JSON, VERBOSE)  # every command with a --config table
COMMAND_EXTRAS = (JSON, VERBOSE)  # inspect, tiny-model: command-line settings only
