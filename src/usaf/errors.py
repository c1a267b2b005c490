"""The one error type users see.

A ``UsafError`` is a problem with the user's input or environment (a wrong path, a malformed line, a
value out of range). The CLI prints it as one red line plus a hint and exits with code 2. Anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UsafError(Exception):
    """A user-facing error: what is wrong (naming the file, line or flag) and how to fix it."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"
