"""How stages report progress without knowing about terminals (the CLI renders it with rich)."""

from __future__ import annotations

from typing import Protocol


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
