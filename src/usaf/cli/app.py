"""The Typer application. Command modules import only typer and the standard library at import
time (their heavy imports sit inside the command bodies), so ``usaf --help`` stays instant.

A command is listed here only once it works; later stages add their module and one line below.
"""

from __future__ import annotations

import signal
import sys
from typing import Annotated

import typer

from usaf._version import __version__
from usaf.cli import demo, doctor, eval_, export, generate, inspect, plan, quantize, score, tiny_model, tokenize, train
from usaf.cli.closed_pipes import outlive_readers
from usaf.cli.console import handle_errors
from usaf.cli.once import SaysTheValueUsed
from usaf.cli.usage_errors import GroupParseErrorsAsUsaf
from usaf.errors import UsafError

app = typer.Typer(
    name="usaf",
    cls=GroupParseErrorsAsUsaf,
    help=(
        "Sparse native fine-tuning of Mixture-of-Experts language models on one consumer GPU or a CPU.\n\n"
        "Stages chain through a workspace: each writes a typed artifact directory the next one finds."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts say "[default: ...]": literal text, not rich markup
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"usaf {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool | None,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = None,
) -> None:
    """usaf command line."""


app.command("demo", cls=SaysTheValueUsed)(demo.command)
app.command("tokenize", no_args_is_help=False, cls=SaysTheValueUsed)(tokenize.command)
app.command("quantize", cls=SaysTheValueUsed)(quantize.command)
app.command("score", cls=SaysTheValueUsed)(score.command)
app.command("train", cls=SaysTheValueUsed)(train.command)
app.command("eval", cls=SaysTheValueUsed)(eval_.command)
app.command("plan", cls=SaysTheValueUsed)(plan.command)
app.command("export", cls=SaysTheValueUsed)(export.command)
app.command("generate", cls=SaysTheValueUsed)(generate.command)
app.command("inspect", cls=SaysTheValueUsed)(inspect.command)
app.command("doctor", cls=SaysTheValueUsed)(doctor.command)
app.command("tiny-model", cls=SaysTheValueUsed)(tiny_model.command)


def main() -> None:
    outlive_readers()  # a dead `| tee` ended a run with exit 1 and no checkpoint
    try:
        with handle_errors():
            _refuse_undecodable(sys.argv[1:])
        app()
    except typer.Exit as e:  # raised outside Typer's own handling (above)
        sys.exit(e.exit_code)
    finally:
        _over()


def _refuse_undecodable(arguments: list[str]) -> None:
    """An argument that is not UTF-8 (a Latin-1 file name; Python holds its bytes as surrogate escapes) cannot be
    written into a manifest or a tokens line, all UTF-8: the command crashed at its end with a traceback (found in
    review). Files *under* a directory input get their names escaped as sources instead (``corpus.name_text``)."""
    from usaf.data.corpus import name_text  # lazy: usaf --help stays instant (a stage's module)

    for i, argument in enumerate(arguments):
        if (shown := name_text(argument)) == argument:
            continue
        flag, _, value = argument.partition("=") if argument.startswith("--") else ("", "", argument)
        if not flag and i > 0 and _takes_a_value(arguments[0], arguments[i - 1]):
            flag = arguments[i - 1]
        if flag:  # a flag's value (--out, --model): named, and no directory of escaped names to offer (review)
            raise UsafError(f"{flag} {name_text(value)}: not UTF-8 text (shown with its bytes escaped); usaf records "
                            "every path in UTF-8 files", "give a path whose name is UTF-8 (rename it, or pass "
                            "another)")  # fmt: skip
        raise UsafError(
            f"{shown}: not UTF-8 text (shown with its bytes escaped); usaf records every path in UTF-8 files",
            "rename it to a UTF-8 name, or pass the directory that holds it (its files' names are escaped)",
        )


def _takes_a_value(command: str, option: str) -> bool:
    """Whether ``option`` of ``usaf COMMAND`` is one that takes the next argument as its value (not a switch). Read
    by attribute: typer's parameters are its own click's (``typer._click``), not the installed click's classes."""
    sub = getattr(typer.main.get_command(app), "commands", {}).get(command)
    return any(option in p.opts and getattr(p, "is_flag", None) is False for p in getattr(sub, "params", []))


def _over() -> None:
    """The command is over: its output committed, or its error said. A Ctrl-C from here on, during the interpreter's
    teardown (a second or more with torch loaded), ended the process at 130 without a word after a finished export,
    which a script then took for a failure (found in review): it is ignored, and so is a closed terminal's SIGHUP,
    and the exit status is the command's. SIGTERM keeps its default: a supervisor (torchrun, a scheduler) can always
    end a teardown that hangs."""
    for name in ("SIGINT", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
