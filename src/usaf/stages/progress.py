"""How stages report progress without knowing about terminals (the CLI renders it with rich)."""

from __future__ import annotations

from typing import Any, Protocol


class Progress(Protocol):
    def start(self, description: str, total: int | None, unit: str, *, done: int = 0) -> None:
        """Begin a phase of ``total`` units (``None``: unknown), ``done`` of them already (a resumed phase: shown as
        done, not counted in the rate)."""

    def advance(self, amount: int, **counters: float) -> None:
        """``amount`` more units done; int ``counters`` are running totals (tokens), floats current values (loss)."""

    def note(self, message: str) -> None:
        """A one-line remark for the user."""

    def finish(self) -> None:
        """End the current phase."""


class NullProgress:
    """Progress that shows nothing (library use, tests)."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def start(self, description: str, total: int | None, unit: str, *, done: int = 0) -> None:
        pass

    def advance(self, amount: int, **counters: float) -> None:
        pass

    def note(self, message: str) -> None:
        self.notes.append(message)

    def finish(self) -> None:
        pass


def say_backend_notes(backend: Any, progress: Progress) -> None:
    """The device's remarks for the user (``backend.notes``: an unsupported ``USE_MULTI_GPU``, a ``USE_AMP=1`` the
    device cannot honour, a ``USE_CUDA`` an explicit ``--device`` overrides). Only ``usaf doctor`` showed them: a
    run with ``USE_MULTI_GPU=1`` used one device in silence (found in review)."""
    for note in getattr(backend, "notes", ()):
        progress.note(note.message)
