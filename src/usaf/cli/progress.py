"""A rich progress bar implementing :class:`usaf.stages.progress.Progress` (bytes and tokens per second)."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from usaf.cli.console import err

_LOG_WIDTH = 400  # a progress line in a log: wider than any usaf writes, so never wrapped


class RichProgress:
    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._progress: Progress | None = None
        self._task: Any = None
        self._started = 0.0

    def start(self, description: str, total: int | None, unit: str, *, done: int = 0) -> None:
        # Into a log (stderr not a terminal) rich prints the bar once, at its end, on 80 columns: a line longer
        # than that wrapped, leaving "kB" or "MB" alone on the next line and the loss cut to "0:0…" (found in
        # review). There the line is a log line: no bar, and as wide as it needs.
        logging = not err.is_terminal
        console = Console(stderr=True, highlight=False, width=_LOG_WIDTH) if logging else err
        columns: list[Any] = [TextColumn("[bold]{task.description}")] + ([] if logging else [BarColumn()])
        if unit == "bytes":
            columns += [DownloadColumn(), TransferSpeedColumn()]
        else:
            columns += [TextColumn("{task.completed}/{task.total} " + unit)]
        columns += [TextColumn("{task.fields[rate]}"), TimeRemainingColumn()]
        self._progress = Progress(*columns, console=console, disable=not self.enabled, transient=False)
        self._progress.start()
        # done as the task's start, not an advance: rich's speed and time left count only this process's units (a
        # resumed run's bar showed 137,624 steps/s; found in review)
        self._task = self._progress.add_task(description, total=total, completed=done, rate="")
        self._started = time.perf_counter()

    def advance(self, amount: int, **counters: int) -> None:
        if self._progress is None:
            return
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        # Integers are running totals since start() (shown with their rate); floats are current values (a loss).
        rate = "  ".join(
            f"{name} {value:.4f}" if isinstance(value, float) else f"{value:,} {name} ({value / elapsed:,.0f}/s)"
            for name, value in counters.items()
        )
        self._progress.update(self._task, advance=amount, rate=rate)

    def note(self, message: str) -> None:
        err.print(f"[dim]{escape(message)}[/dim]")  # messages hold paths and hints like usaf[plot]: not markup

    def finish(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
