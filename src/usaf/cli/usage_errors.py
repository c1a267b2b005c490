"""Parse errors said as usaf's other errors are. A value that is no number (``--steps abc``), an option the command
does not have, a missing argument or a mistyped command printed click's ``Usage:`` block, a ``Try ...`` line and
``Error: Invalid value ...``, where every other usaf error is one ``error:`` line and a ``hint:`` line (found in
review): scripts and users read one shape. The exit status stays 2, click's and usaf's alike."""

from __future__ import annotations

import importlib
from typing import Any

from typer.core import TyperCommand, TyperGroup


class _SaysParseErrors:
    """Mixed into the command and the group classes: their parse and command-lookup errors print as usaf's."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)  # type: ignore[misc]
        except Exception as e:
            _said_as_usaf(e, ctx)
            raise


class ParseErrorsAsUsaf(_SaysParseErrors, TyperCommand):
    """A command whose parse errors print as usaf's errors do."""


class GroupParseErrorsAsUsaf(_SaysParseErrors, TyperGroup):
    """The ``usaf`` group: a mistyped command (``usaf trian``) or a group option prints as usaf's errors do."""

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        try:
            return super().resolve_command(ctx, args)
        except Exception as e:
            _said_as_usaf(e, ctx)
            raise


def _said_as_usaf(e: Exception, parsing: Any) -> None:
    """Makes click's usage error ``e`` print as usaf's errors when click shows it; anything else is left as it is,
    and so is the help that ``usaf`` alone prints (click raises it as a usage error). ``parsing`` is the context
    of the command that raised it: an option's missing value comes without one of its own."""
    if not isinstance(e, _usage_error_class()) or type(e).__name__ == "NoArgsIsHelpError":
        return
    ctx = getattr(e, "ctx", None) or parsing
    path = getattr(ctx, "command_path", None) or "usaf"
    lists = "the commands" if isinstance(getattr(ctx, "command", None), TyperGroup) else "its options"
    message = e.format_message()

    def show(file: Any = None) -> None:
        from usaf.cli.console import say_parse_error  # lazy: usaf --help stays instant (rich)

        say_parse_error(message[:1].lower() + message[1:], f"`{path} -h` lists {lists}")

    e.show = show  # type: ignore[attr-defined]  # click calls e.show() and exits with e.exit_code (2)


def _usage_error_class() -> type:
    """Typer since 0.2x carries its own click (``typer._click``); before, the installed click."""
    core = importlib.import_module("typer.core")
    click = getattr(core, "_click", None) or importlib.import_module("click")
    return click.exceptions.UsageError
