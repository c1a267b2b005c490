"""The one pair of rich consoles, and how a command turns errors into exit codes.

Results (tables, ``--json``) go to stdout; progress, notes and errors go to stderr, so that
``usaf inspect DIR --json | jq`` works while progress still shows.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from usaf.cli import rank_errors
from usaf.errors import StopSignal, UsafError, take_signals

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

EXIT_INTERRUPTED = 130


def note(message: str) -> None:
    """A one-line remark on stderr (which artifact was picked, what a run will cost)."""
    err.print(f"[dim]{message}[/dim]")


def print_json(data: Any) -> None:
    # Plain print: rich would wrap long lines and break machine readers.
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


@contextlib.contextmanager
def handle_errors(verbose: bool = False) -> Iterator[None]:
    """UsafError -> one red line (+ hint) and exit 2; Ctrl-C -> exit 130, SIGTERM -> 143, SIGHUP -> 129; bugs keep
    their traceback.

    The error is printed inside the signal handling, with stop signals ignored meanwhile: printed after it, the
    default handler was back, and torchrun's SIGTERM (sent as a peer died) ended rank 0 before it said which
    checkpoint is the newest (a flaky test, found 2026-12-06)."""
    with _stop_signals_as_ctrl_c() as reporting:
        try:
            yield
        except UsafError as e:
            reporting()
            _say_error(e, verbose)
            raise typer.Exit(UsafError.exit_code) from None
        except (OSError, RuntimeError) as e:  # a full disk, or memory, where no stage answered it: else a bug
            translated = _stray_disk_error(e) if isinstance(e, OSError) else _out_of_memory(e)
            if translated is None:
                raise
            reporting()
            _say_error(translated, verbose)
            raise typer.Exit(UsafError.exit_code) from None
        except KeyboardInterrupt as e:  # a second signal now ends the process (the first one's handler reset it)
            name = getattr(e, "name", "SIGINT")
            what = "interrupted" if name == "SIGINT" else f"stopped by {name}"
            # where the stage said what it kept, only which signal stopped it (its note says "interrupted")
            line = f"{what}: nothing half-written was left behind" if not _stage_said_what_it_kept() else (
                None if name == "SIGINT" else f"{what}: the work above is kept")  # fmt: skip
            if line is not None and rank_errors.record("stopped", line):
                say_stopped(line)
            raise typer.Exit(getattr(e, "exit_code", EXIT_INTERRUPTED)) from None


# Ctrl-C raises KeyboardInterrupt by itself; these ended the process where it stood.
_STOP_AS_CTRL_C = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextlib.contextmanager
def _stop_signals_as_ctrl_c() -> Iterator[Callable[[], None]]:
    """SIGTERM (kill, a scheduler, a container stop) and SIGHUP (a closed terminal) raise as Ctrl-C does, so what a
    command was writing is cleaned up as after Ctrl-C. They killed the process where it stood: a tokenize stopped so
    left its half-written temporary output (GBs) where no later run of another output removes it (found in review).
    Long stages' own handlers (:class:`usaf.stages.stop.StopRequest`) take over while they run, to stop at a
    boundary and save. A second signal ends the process at once (its default), as a second Ctrl-C does there.

    Yields ``reporting``: call it once the command is over and only reports its end; the signals are ignored from
    then until the context exits, so the last line is said."""
    if threading.current_thread() is not threading.main_thread():  # Python's rule for signal handlers
        yield lambda: None
        return

    def stop(signum, frame) -> None:
        signal.signal(signum, signal.SIG_DFL)
        raise StopSignal(signum)

    def reporting() -> None:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)

    previous = take_signals(stop, _STOP_AS_CTRL_C)  # nohup's SIGHUP stays ignored
    try:
        yield reporting
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # None: not installed from Python (then nothing to put back)
                signal.signal(sig, handler)


def _stage_said_what_it_kept() -> bool:
    """Whether the interrupted stage's own last line said what it kept (:func:`usaf.stages.stop.note_at_stop`): then
    "nothing half-written was left behind" after it adds nothing and reads as contradicting it (found in review)."""
    stop = sys.modules.get("usaf.stages.stop")  # not imported: no stage ran far enough to say anything
    return stop is not None and stop.take_note_at_stop()


def say_stopped(text: str) -> None:
    """``interrupted: ...``: the first word yellow."""
    what, _, rest = text.partition(":")
    err.print(f"[yellow]{what}[/yellow]:", end="")
    err.print(rest, markup=False, emoji=False, highlight=False)


def say_rank_line(rank: int, said: rank_errors.Said) -> None:
    """Another rank's last line that rank 0 did not say, under its rank (a launcher's, after torchrun)."""
    kind, text, hint = said
    text = text if text.startswith("rank ") else f"rank {rank}: {text}"  # a PeerLost names its rank itself
    if kind == "stopped":
        say_stopped(text)
    else:
        _print_error(UsafError(text, hint), verbose=False)


def say_parse_error(message: str, hint: str) -> None:
    """A command line click could not parse (:mod:`usaf.cli.usage_errors`), said as usaf's errors are."""
    _say_error(UsafError(message, hint), verbose=False)


def _say_error(e: UsafError, verbose: bool) -> None:
    """The error, where this rank is the one to say it (:mod:`usaf.cli.rank_errors`)."""
    if rank_errors.record("error", e.message, e.hint):
        _print_error(e, verbose)


def _print_error(e: UsafError, verbose: bool) -> None:
    if verbose:
        err.print(traceback.format_exc(), markup=False)
    # Messages hold user text (paths, values like "[doctor]" or ":x:"): never markup or emoji.
    err.print("[bold red]error:[/bold red] ", end="")
    err.print(e.message, markup=False, emoji=False, highlight=False)
    if e.hint:
        err.print("[yellow]hint:[/yellow] ", end="")
        err.print(e.hint, markup=False, emoji=False, highlight=False)


def _out_of_memory(e: RuntimeError) -> UsafError | None:
    """Last resort for memory that ran out where no stage plans for it (train retries a step at a smaller microbatch;
    ``usaf generate`` on a card its model does not fit gave torch's traceback; found in review): one line with
    torch's own first line, and the ways out."""
    message = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if type(e).__name__ != "OutOfMemoryError" and "can't allocate memory" not in message:
        return None
    return UsafError(
        f"out of memory ({message[:200]})",
        "lower --microbatch or --seq-len, pass --stream-experts where the command takes it, or --device cpu; "
        "usaf plan MODEL says what fits",
    )


def _stray_disk_error(e: OSError) -> UsafError | None:
    """Last resort for a full or read-only disk at a write no stage guards (the write sites are the first
    place, naming the flag): the path the OS names, or the working directory when it names none."""
    # lazy: usaf --help imports every cli module; the disk translation is needed only when a command failed
    from usaf.artifacts.disk import disk_error

    return disk_error(e, Path(e.filename) if e.filename else Path.cwd(), flag=None)
