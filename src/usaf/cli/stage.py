"""The body every stage command shares: settings → stage → JSON or a human summary."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import typer

from usaf.cli.flags import settings_command
from usaf.errors import UsafError


def stage_command(name: str, *, summary: Callable[[Any, Any, Path], None], doc: str) -> Any:
    """``usaf NAME``: its flags from ``usaf.settings.NAME``'s model, its body :func:`run_stage`."""

    def body(cli: dict[str, Any], *, config: Path | None, json_output: bool, verbose: bool) -> None:
        run_stage(name, cli=cli, config_file=config, json_output=json_output, verbose=verbose, summary=summary)

    return settings_command(f"usaf.settings.{name}:{name.capitalize()}Config", body, doc=doc)


def run_stage(
    name: str,
    *,
    cli: Mapping[str, Any],
    config_file: Path | None,
    json_output: bool,
    verbose: bool,
    summary: Callable[[Any, Any, Path], None],
) -> None:
    """Resolve ``usaf.stages.<name>``'s settings, run it with a progress bar, print the result.

    Args:
        name: the stage module (``"tokenize"``); its ``<Name>Config`` class and ``run`` are used, and
            ``name`` is also its ``--config`` TOML table.
        cli: flag values by setting name (``None`` = not given).
        config_file: the ``--config`` file.
        json_output: print the manifest (and the path) as JSON instead of ``summary``.
        verbose: tracebacks on errors.
        summary: ``summary(console, manifest, path)`` prints the human-readable result.

    A stage module may define ``LEGACY_ENV`` (the original tool's variable names it honours).
    """
    from usaf.cli.console import handle_errors

    with handle_errors(verbose), _process_group():
        from usaf.cli.console import out, print_json
        from usaf.cli.progress import RichProgress
        from usaf.config import resolve_config

        stage = importlib.import_module(f"usaf.stages.{name}")
        config_class = getattr(stage, f"{name.capitalize()}Config")
        settings = resolve_config(
            config_class,
            section=name,
            cli=dict(cli),
            config_file=config_file,
            legacy_env=getattr(stage, "LEGACY_ENV", None),
        )
        say_environment(settings)
        manifest, path = stage.run(settings, progress=RichProgress())
        from usaf.distributed import world

        if not world().is_main:  # under torchrun, rank 0 alone reports
            return
        if json_output:
            print_json({"path": str(path), **manifest.model_dump(mode="json")})
        else:
            summary(out, manifest, path)


def say_environment(settings: Any) -> None:
    """Notes of the settings read from the original tool's environment variables (:func:`usaf.config.legacy_note`),
    and of the ``USAF_*`` variables no setting has (:func:`usaf.cli.doctor.misspelt_variables`). Under torchrun
    (``--nproc``) rank 0 alone says them: the launcher gives every rank the same environment, and each rank said
    them once, N times in all."""
    if os.environ.get("RANK", "0") != "0":
        return
    from usaf.cli.console import err
    from usaf.cli.doctor import misspelt_variables
    from usaf.config import legacy_note

    said = [legacy_note(settings), *misspelt_variables(os.environ)]
    for line in filter(None, said):
        err.print(line, style="dim", markup=False, highlight=False)


@contextlib.contextmanager
def _process_group() -> Iterator[None]:
    """Leave torch.distributed's process group when the command ends (a no-op in one process); after an error
    without waiting for the other ranks (:func:`usaf.distributed.shutdown`)."""
    clean = False
    try:
        yield
        clean = True
    finally:
        # only where it was imported (no process group exists before): imported here after a Ctrl-C that cut the
        # stage's imports short, it imported the half-loaded torch again, whose traceback replaced the interrupt
        # (exit 1, not 130; found in review)
        shutdown = getattr(sys.modules.get("usaf.distributed"), "shutdown", None)
        if shutdown is not None:
            shutdown(clean=clean)


def relaunch_under_torchrun(nproc: int, *, verbose: bool = False) -> None:
    """``usaf train --nproc N ...``: run the same command line under torchrun with N local processes.

    Exits with torchrun's status. Refused when already launched by torchrun.
    """
    from usaf.cli import rank_errors
    from usaf.cli.console import handle_errors, say_rank_line
    from usaf.distributed import launched

    with handle_errors(verbose):
        if launched():
            raise UsafError("--nproc: this process was already launched by torchrun", "drop --nproc under torchrun")
    args = _without_option(sys.argv[1:], "--nproc")
    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))  # cores shared by ranks
    os.environ["OMP_NUM_THREADS"] = threads  # the ranks inherit it
    if verbose:  # every rank's traceback, as it happens
        raise typer.Exit(_said_and_status(_torchrun(["--standalone", f"--nproc-per-node={nproc}", "-m", "usaf",
                                                     *args])))  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="usaf-ranks-") as said:  # each rank's last line, said once
        os.environ[rank_errors.ERRORS_ENV] = said
        exitcodes = _torchrun(["--standalone", f"--nproc-per-node={nproc}", "-m", "usaf", *args])
        rank_errors.say_distinct(Path(said), say_rank_line)
    raise typer.Exit(_said_and_status(exitcodes))


def _torchrun(arguments: list[str]) -> dict[int, int]:
    """torchrun's launcher in this process: the failed ranks' exit codes (negative: killed by that signal; rank -1:
    the launcher's own stop, as its status), empty where every rank succeeded.

    Run as a subprocess, torchrun turned every rank's refusal or interrupt into its own traceback (ChildFailedError,
    SignalException) and exit 1, after the rank's one error line (found in review). Each rank has said why: the
    launcher's own log of the failure is silenced, and its exceptions become the exit status.
    """
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # each of its loggers sets its own level as it is made (LOGLEVEL, else WARNING), so the parent's alone left
    # "Received 2 death signal, shutting down workers" on a Ctrl-C (found in review)
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(get_args_parser().parse_args(arguments))
    except ChildFailedError as e:
        return {rank: failure.exitcode for rank, failure in e.failures.items()}
    except SignalException as e:  # Ctrl-C or a kill reached the launcher too: the ranks saved and stopped
        return {-1: 128 + int(e.sigval)}
    return {}


def _said_and_status(exitcodes: dict[int, int]) -> int:
    """The exit status of a launch (:func:`_torchrun`'s codes), saying each rank a signal killed, which could say
    nothing itself."""
    if not exitcodes:
        return 0
    from usaf.cli.console import say_rank_line  # lazy: rich, only to say it

    for rank, message, hint in killed_lines(exitcodes):
        say_rank_line(rank, ("error", message, hint))
    return failed_status(exitcodes)


def failed_status(exitcodes: dict[int, int]) -> int:
    """The command's status from the failed ranks' exit codes (a negative code: killed by that signal, as 128 + s):
    the cause's (:func:`cause_rank`)."""
    code = exitcodes[cause_rank(exitcodes)]
    return code if code >= 0 else 128 - code


def cause_rank(exitcodes: dict[int, int]) -> int:
    """The rank whose failure ended the launch. First a rank a signal killed (SIGKILL: the out-of-memory killer's;
    SIGSEGV): the others' failures follow from it (a peer lost, exit 2; the launcher's SIGTERM), and usaf's ranks
    leave on SIGTERM, so the launcher's own SIGKILL, after a grace period, does not come. The command said 143 or 2
    of a rank killed from outside (found in review). Then the lowest rank that failed on its own, not one the
    launcher stopped (SIGTERM) because another failed first: a refusal on rank 1 reached rank 0 as SIGTERM while it
    was leaving with the same refusal, and the command said 143 instead of 2 (seen in CI)."""
    if killed := _killed_ranks(exitcodes):
        return killed[0]
    statuses = {rank: code if code >= 0 else 128 - code for rank, code in exitcodes.items()}
    causes = [rank for rank in sorted(statuses) if statuses[rank] != 128 + int(signal.SIGTERM)]
    return causes[0] if causes else min(statuses)


def _killed_ranks(exitcodes: dict[int, int]) -> list[int]:
    """The ranks a signal killed, lowest first: a negative code other than SIGTERM's (a rank's SIGTERM, SIGINT or
    SIGHUP is a stop its handler says, with a status of 128 + s)."""
    return [rank for rank in sorted(exitcodes) if exitcodes[rank] < 0 and exitcodes[rank] != -int(signal.SIGTERM)]


def killed_lines(exitcodes: dict[int, int]) -> list[tuple[int, str, str]]:
    """``(rank, message, hint)`` for each rank a signal killed (SIGKILL: the out-of-memory killer's; SIGSEGV), which
    could say nothing itself (:func:`_killed_ranks`); the other ranks may have left with their own "another process
    of the run stopped"."""
    lines = []
    for rank in _killed_ranks(exitcodes):
        number = -exitcodes[rank]
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        why = (" (the system's out-of-memory killer sends SIGKILL: `dmesg` or `journalctl -k` says whether it did)"
               if name == "SIGKILL" else "")  # fmt: skip
        lines.append((rank, f"rank {rank} was killed by {name}{why}",
                      "rerun the same command to resume from the last checkpoint (fewer --nproc or a smaller "
                      "--microbatch if it ran out of memory)"))  # fmt: skip
    return lines


def _without_option(args: list[str], name: str) -> list[str]:
    """``args`` without ``name VALUE`` / ``name=VALUE``."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(name + "="):
            out.append(arg)
    return out
