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
from rich.table import Column

from usaf.cli.console import err
from usaf.units import human_bytes

_LOG_WIDTH = 400  # a progress line in a log: wider than any usaf writes, so never wrapped
# Into a log, a line this often while a bar runs: rich prints a bar there once, at its end, so a train under tee or a
# scheduler said nothing for its whole run (182 s of a reviewer's 189; hours on a real job)
LOG_EVERY_SECONDS = 30.0
# The counters' column takes what is left of the line and is cut first: rich shrank every column alike, and at 80
# columns it cut a training bar's time left and its loss (after a resume, almost all of it; found in review)
_SHRINKS_FIRST = Column(ratio=1, no_wrap=True, overflow="ellipsis")


class RichProgress:
    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._progress: Progress | None = None
        self._task: Any = None
        self._started = 0.0
        self._logging = False  # stderr is no terminal: lines, not a bar
        self._logged = 0.0  # when the last log line was written
        self._line: tuple[str, str, int | None, int] = ("", "", None, 0)  # description, unit, total, done at start

    def start(self, description: str, total: int | None, unit: str, *, done: int = 0) -> None:
        # Into a log (stderr not a terminal) rich prints the bar once, at its end, on 80 columns: a line longer
        # than that wrapped, leaving "kB" or "MB" alone on the next line and the loss cut to "0:0…" (found in
        # review). There the line is a log line: no bar, and as wide as it needs.
        logging = not err.is_terminal
        console = Console(stderr=True, highlight=False, width=_LOG_WIDTH) if logging else err
        columns: list[Any] = [TextColumn("[bold]{task.description}")] + ([] if logging else [BarColumn(bar_width=20)])
        if unit == "bytes":
            columns += [DownloadColumn(), TransferSpeedColumn()]
        else:
            columns += [TextColumn("{task.completed}/{task.total} " + unit)]
        # the time left before the counters, which are cut first where the line is too long
        columns += [TimeRemainingColumn(), TextColumn("{task.fields[rate]}", table_column=_SHRINKS_FIRST)]
        # into a log, rich's line at the end showed a bare time (read as the time taken: it was the time left) and
        # counts without their commas: the log's lines are usaf's own (_log_line), rich only counts
        self._progress = Progress(*columns, console=console, disable=not self.enabled or logging, transient=False,
                                  expand=not logging)  # the counters take what the line has left
        self._progress.start()
        # done as the task's start, not an advance: rich's speed and time left count only this process's units (a
        # resumed run's bar showed 137,624 steps/s; found in review)
        self._task = self._progress.add_task(description, total=total, completed=done, rate="")
        self._started = self._logged = time.perf_counter()
        self._logging, self._line = logging and self.enabled, (description, unit, total, done)

    def advance(self, amount: int, **counters: int) -> None:
        if self._progress is None:
            return
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        # Integers are running totals since start() (shown with their rate); floats are current values (a loss).
        # the current values first: where a line is too short its end is cut, and the loss is what a user watches
        ordered = sorted(counters.items(), key=lambda item: not isinstance(item[1], float))
        rate = "  ".join(
            f"{name} {value:.4f}" if isinstance(value, float) else f"{value:,} {name} ({value / elapsed:,.0f}/s)"
            for name, value in ordered
        )
        self._progress.update(self._task, advance=amount, rate=rate)
        now = time.perf_counter()
        if self._logging and now - self._logged >= LOG_EVERY_SECONDS:
            self._logged = now
            err.print(self._log_line(now - self._started), highlight=False, soft_wrap=True)

    def _log_line(self, elapsed: float, *, end: bool = False) -> str:
        """Where the bar is, as one line of a log: ``training 467/1,668 steps (28 %), about 0:02:08 left, 0:00:50 so
        far  loss 3.3124``; at its ``end``, ``training 1,668/1,668 steps (100 %) in 0:02:58  loss 3.1015`` (or, cut
        short, ``... (28 %), stopped after 0:00:50``)."""
        description, unit, total, start = self._line
        task = self._progress.tasks[0] if self._progress is not None else None
        done = int(task.completed) if task is not None else start
        rate = task.fields.get("rate", "") if task is not None else ""
        count = human_bytes if unit == "bytes" else "{:,}".format
        where = f"{count(done)}/{count(total)}" if total else count(done)
        where += "" if unit == "bytes" else f" {unit}"
        if total:
            where += f" ({100 * done / total:.0f} %)"
        if unit == "bytes" and done > start:  # as rich's speed column showed it
            where += f", {human_bytes((done - start) / max(elapsed, 1e-9))}/s"
        if end:
            where += f" in {_clock(elapsed)}" if not total or done >= total else f", stopped after {_clock(elapsed)}"
        else:
            if total and done > start:  # the units of this process: a resumed run's earlier ones took no time here
                where += f", about {_clock((total - done) * elapsed / (done - start))} left"
            where += f", {_clock(elapsed)} so far"
        return escape(f"{description} {where}  {rate}".rstrip())

    def note(self, message: str) -> None:
        err.print(f"[dim]{escape(message)}[/dim]")  # messages hold paths and hints like usaf[plot]: not markup

    def finish(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            if self._logging:
                err.print(self._log_line(time.perf_counter() - self._started, end=True), highlight=False,
                          soft_wrap=True)  # fmt: skip
            self._progress = None


def _clock(seconds: float) -> str:
    """``0:02:08``: as rich's time column shows it."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"

