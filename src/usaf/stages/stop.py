"""A stop request (Ctrl-C, SIGTERM, SIGHUP) that ends a long run at a boundary of its own choosing.

``usaf train`` checks it before each step and saves a checkpoint; ``usaf score`` before each calibration batch and
each probe step of its lr test, and saves what it has done. A signal only sets a flag, so whatever is saved holds
whole units of work.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any

from usaf.distributed import PeerLost, World
from usaf.errors import STOP_SIGNALS, StopSignal, take_signals

__all__ = ["STOP_SIGNALS", "StopRequest", "note_at_stop", "rerun_to_resume", "take_note_at_stop"]


SECOND_STOP = ("stopped at once by a second signal, without saving: anything saved before stays, and the same command "
               "resumes from it (where nothing was, it starts over)")

# Set once a stage has said what an interrupt kept (its last line): the command's own closing line, "nothing
# half-written was left behind", then adds nothing, and after "saved ..." it read as contradicting it (found in review).
_SAID_AT_STOP = threading.Event()


def note_at_stop(progress: Any, message: str) -> None:
    """An interrupted stage's last word: what it kept (or could not keep) and how to go on."""
    progress.note(message)
    _SAID_AT_STOP.set()


def said_at_stop() -> bool:
    """Whether a stage has said what its interrupt kept (and the CLI has not yet taken the word)."""
    return _SAID_AT_STOP.is_set()


def take_note_at_stop() -> bool:
    """Whether a stage said what its interrupt kept since the last call (the CLI's handler asks once per command)."""
    said = _SAID_AT_STOP.is_set()
    _SAID_AT_STOP.clear()
    return said


class StopRequest:
    """Ctrl-C, SIGTERM or SIGHUP stops the run at the next step boundary, never inside a step.

    A signal only sets a flag; the loop checks it before each step (data parallel: the ranks agree on it
    with one all-reduce, so all of them reach the collective checkpoint together) and raises
    :class:`usaf.errors.StopSignal` (a KeyboardInterrupt) there, so the checkpoint holds whole steps only and
    the command exits with 128 + the signal's number. In one process a second signal leaves at once without
    writing (the last checkpoint stays intact); under torchrun repeated signals change nothing (a
    terminal's Ctrl-C reaches every rank and torchrun forwards it again; a rank stuck in a step is
    torchrun's to kill). Installed only in the main thread (Python's rule for signal handlers).
    """

    def __init__(self, world: World) -> None:
        self.world = world
        self.signum: int | None = None  # the first stop signal received
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = take_signals(self._handle)  # one the shell set to be ignored stays so (nohup's SIGHUP)
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self.world.active and isinstance(exc, PeerLost):
            # A rank died and torchrun is stopping the others with SIGTERM: with the default handler back, that
            # signal could end this rank before it says which checkpoint is the newest (seen under load). The flag
            # handler stays for the little that is left of the command.
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.requested and not self.world.active:  # the second signal: leave now, no checkpoint
            # said: the command ended silently, where the first signal's save had not come (found in review)
            sys.stderr.write(f"\n{SECOND_STOP}\n")
            raise SystemExit(128 + signum)
        self.signum = self.signum or signum

    def check(self, *, alone: bool = False) -> None:
        """Raise :class:`StopSignal` where a stop was requested: on any rank (a collective every rank makes at the same
        boundary), or ``alone``: on this one (work one rank does while the others wait for its result)."""
        requested = self.requested if alone else self.world.any(self.requested)
        if requested:  # a rank that got none stops for its peers: as Ctrl-C
            raise StopSignal(self.signum or signal.SIGINT)


def rerun_to_resume(starts_over: str | None = None) -> str:
    """How to go on after a stop, for its note: the same command, or, where it was given a flag that starts over
    (``--overwrite``, ``--force``), the same command without it; rerun with that flag, the note's "same command"
    discarded the work it said was kept (found in review)."""
    if starts_over is None:
        return "run the same command to resume"
    return f"run the same command without {starts_over} to resume (with it, it starts over)"
