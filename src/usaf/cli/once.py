"""Commands that say which value of a single-valued option given twice they use: click keeps the last occurrence
in silence, so ``usaf generate --checkpoint A --checkpoint B`` used B with the first accepted and ignored, and
``--stability --no-stability`` kept whichever came last (found in review). The last still wins (a script's
``$CMD --save-every 2`` overrides what ``$CMD`` gives), and a note says so."""

from __future__ import annotations

from typing import Any

from usaf.cli.usage_errors import ParseErrorsAsUsaf


class SaysTheValueUsed(ParseErrorsAsUsaf):
    """A Typer command noting each single-valued option given more than once with other values (the same value
    twice is no news). Options that take several values (``--held-out A --held-out B``) are not single-valued."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        from usaf.cli.console import err  # lazy: usaf --help stays instant

        for occurrences in _given(self.params, args).values():
            if len({value for _, value in occurrences}) > 1:
                shown = ", ".join(_spelled(name, value) for name, value in occurrences)
                err.print(f"{occurrences[0][0]} given more than once ({shown}): the last, "
                          f"{_spelled(*occurrences[-1])}, is used", style="dim", markup=False,
                          highlight=False)  # fmt: skip
        return super().parse_args(ctx, args)


def _given(params: list[Any], args: list[str]) -> dict[str, list[tuple[str, str]]]:
    """Each single-valued option's occurrences in ``args``: (spelling, value); a switch's value is its spelling."""
    options = {}
    for param in params:  # typer's own click classes: read by attribute
        if getattr(param, "param_type_name", "") == "option" and not param.multiple and not param.count:
            options.update({name: param for name in [*param.opts, *param.secondary_opts]})
    given: dict[str, list[tuple[str, str]]] = {}
    i = 0
    while i < len(args) and args[i] != "--":  # after "--", arguments only
        name, eq, value = args[i].partition("=") if args[i].startswith("--") else (args[i], "", "")
        param = options.get(name)
        if param is not None:
            if param.is_flag:
                value = name  # --x and --no-x differ
            elif not eq:
                value = args[i + 1] if i + 1 < len(args) else ""
                i += 1  # the value, which may look like an option
            given.setdefault(param.name, []).append((name, value))
        i += 1
    return given


def _spelled(name: str, value: str) -> str:
    return name if name == value else f"{name} {value}"
