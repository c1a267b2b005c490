"""Standard streams that outlive their reader.

``nohup usaf train ... 2>&1 | tee log &``: at logout the hangup is ignored (usaf.errors.take_signals), but ``tee``
dies, and the next progress line's write raised BrokenPipeError out of the training loop: the run ended with exit 1
and no checkpoint, its steps lost, with nowhere left to say so (found in review). A stream whose reader is gone is
pointed at the null device instead (the remedy Python's documentation gives for SIGPIPE), so the run goes on, saves
and finishes as it would have; what it would have printed is dropped.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any, TextIO


class OutlivesItsReader:
    """``stream`` (sys.stdout or sys.stderr), pointed at the null device the first time a write or flush finds its
    reader gone (EPIPE); everything else is the stream's own."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            self._unless_reader_gone(e)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            self._unless_reader_gone(e)

    def _unless_reader_gone(self, e: OSError) -> None:
        if e.errno != errno.EPIPE:
            raise e
        null = os.open(os.devnull, os.O_WRONLY)
        try:  # the buffered text and every later write (Python's or a library's, through the descriptor) go there
            os.dup2(null, self._stream.fileno())
        finally:
            os.close(null)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def outlive_readers() -> None:
    """Wrap sys.stdout and sys.stderr (the command-line entry point's, not a test runner's capture)."""
    sys.stdout = OutlivesItsReader(sys.stdout)  # type: ignore[assignment]
    sys.stderr = OutlivesItsReader(sys.stderr)  # type: ignore[assignment]
