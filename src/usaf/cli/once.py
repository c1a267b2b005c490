"""Commands whose single-valued options are given once: click keeps the last of two occurrences, so
``usaf generate --checkpoint A --checkpoint B`` used B, the first accepted and ignored in silence (found in review),
and ``--stability --no-stability`` kept whichever came last."""

from __future__ import annotations

from typing import Any

from typer.core import TyperCommand


class OptionsGivenOnce(TyperCommand):
    """A Typer command refusing a single-valued option given twice with other values (the same value twice, as a
    script may repeat it, is no conflict). Options that take several values (``--held-out A --held-out B``) are
    not single-valued."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        given: dict[str, list[tuple[str, str]]] = {}  # parameter name -> (spelling, value) as given
        options = {}
        for param in self.params:  # typer's own click classes: read by attribute
            if getattr(param, "param_type_name", "") == "option" and not param.multiple and not param.count:
                options.update({name: param for name in [*param.opts, *param.secondary_opts]})
        i = 0
        while i < len(args) and args[i] != "--":  # after "--", arguments only
            name, eq, value = args[i].partition("=") if args[i].startswith("--") else (args[i], "", "")
            param = options.get(name)
            if param is not None:
                if param.is_flag:
                    value = name  # a switch's value is its spelling: --x and --no-x conflict
                elif not eq:
                    value = args[i + 1] if i + 1 < len(args) else ""
                    i += 1  # the value, which may look like an option
                given.setdefault(param.name, []).append((name, value))
            i += 1
        for occurrences in given.values():
            if len({value for _, value in occurrences}) > 1:
                shown = ", ".join(f"{name} {value}" if name != value else name for name, value in occurrences)
                ctx.fail(f"{occurrences[0][0]} given more than once, with other values ({shown}): give it once")
        return super().parse_args(ctx, args)
