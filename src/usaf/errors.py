"""The one error type users see.

A ``UsafError`` is a problem with the user's input or environment (a wrong path, a malformed line, a
value out of range). The CLI prints it as one red line plus a hint and exits with code 2. Anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import signal
from typing import Any


class UsafError(Exception):
    """A user-facing error: what is wrong (naming the file, line or flag) and how to fix it."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


# Ctrl-C; kill, schedulers and container stops; a closed terminal (Windows has no SIGHUP).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def take_signals(handler: Any, signals: tuple[int, ...] = STOP_SIGNALS) -> dict[int, Any]:
    """Install ``handler`` for each of ``signals`` not set to be ignored; the previous handlers of those taken, to put
    back. A signal ignored when usaf started stays ignored, as Python leaves an ignored SIGINT: nohup's SIGHUP (a
    closed terminal must not stop the run nohup was to keep), the SIGINT of a job a script started in the background
    (the terminal's Ctrl-C is not for it). Taken over, ``nohup usaf train ... &`` stopped at logout (found in
    review). Main thread only (Python's rule for signal handlers)."""
    return {sig: signal.signal(sig, handler) for sig in signals if signal.getsignal(sig) is not signal.SIG_IGN}


class StopSignal(KeyboardInterrupt):
    """A run stopped at a step boundary by a signal: Ctrl-C (SIGINT), ``kill``/a scheduler/a container stop
    (SIGTERM) or a closed terminal (SIGHUP). Handled like Ctrl-C; the command exits with the shell's
    convention for that signal, 128 + its number (130, 143, 129)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.exit_code = 128 + signum
        self.name = signal.Signals(signum).name


def not_a(path: object, wanted: str) -> str:
    """Why ``path`` is not the ``wanted`` ("file" or "directory"), for the one line naming it: a file given as a model
    directory was "no such directory", a directory given as --config "no such file", a pipe "not a directory" with a
    hint to fix permissions (found in review)."""
    import os.path  # lazy: errors stays an import of the standard library's signal alone

    if os.path.isdir(path):
        return "a directory, not a file"
    if os.path.isfile(path):
        return "a file, not a directory"
    if os.path.exists(path):
        return f"not a {wanted} (a pipe, socket or device)"
    return f"no such {wanted}"
