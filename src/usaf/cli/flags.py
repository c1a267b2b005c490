"""Typer commands built from the settings models, so each option is declared once (in :mod:`usaf.settings`).

A field becomes a parameter ``Annotated[T | None, typer.Option("--kebab-name", help=...)] = None``: ``None``
means "not given", which :func:`usaf.config.resolve_config` needs to let ``USAF_*`` variables, ``--config``
and defaults fill the setting. The help is the field's description followed by ``[default: …]``, written
from the field's default or its declared ``default_text`` (metadata keys: :mod:`usaf.settings.fields`).
Typer reads the generated ``__signature__``; the command body receives the flags as a dict by field name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from usaf.cli.options import STAGE_EXTRAS
from usaf.config import cli_meta
from usaf.settings.argv import cli_type, declaration, is_plain_switch

Body = Callable[..., None]


def default_text(info: Any) -> str:
    """What ``[default: …]`` says for a field ("" = nothing): the declared text, else its default."""
    meta = cli_meta(info)
    if "default_text" in meta:
        return str(meta["default_text"])
    value = info.get_default(call_default_factory=True)
    if value is None or value is PydanticUndefined or value == [] or is_plain_switch(info):
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def help_text(info: Any) -> str:
    text = default_text(info)
    return (info.description or "") + (f" [default: {text}]" if text else "")


def is_flag(info: Any) -> bool:
    """Whether a field appears on the command line (``hidden`` ones are ``--config``/``USAF_*`` only)."""
    return not cli_meta(info).get("hidden", False)


def parameters(model: type[BaseModel]) -> Iterator[inspect.Parameter]:
    """The command-line parameters of a settings model, in field order."""
    for name, info in model.model_fields.items():
        if not is_flag(info):
            continue
        meta = cli_meta(info)
        base = cli_type(info.annotation)
        help_ = help_text(info)
        if meta.get("argument"):
            spec: Any = typer.Argument(help=help_, show_default=False)
        else:
            bounds = {key: meta[key] for key in ("min", "max") if key in meta}
            spec = typer.Option(declaration(name, info), help=help_, show_default=False, **bounds)
        required = info.is_required()
        annotation = Annotated[base if required else base | None, spec]  # type: ignore[operator]
        default = inspect.Parameter.empty if required else None
        yield inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)


def settings_command(
    model: type[BaseModel], body: Body, *, doc: str, extras: Sequence[inspect.Parameter] = STAGE_EXTRAS
) -> Callable[..., None]:
    """A Typer command whose options are ``model``'s fields plus the CLI-only ``extras``.

    ``body(cli, **extras)`` gets the flags by field name (``None`` = not given; an empty repeatable option
    and an absent plain switch are ``None`` too) and the extras by their parameter names.
    """
    fields = list(parameters(model))
    switches = {p.name for p in fields if is_plain_switch(model.model_fields[p.name])}

    def command(**kwargs: Any) -> None:
        cli = {}
        for p in fields:
            value = kwargs.pop(p.name, None)
            if value in ((), []) or (p.name in switches and value is False):
                value = None
            cli[p.name] = list(value) if isinstance(value, tuple) else value
        body(cli, **kwargs)

    params = [*fields, *extras]
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = doc
    command.__name__ = command.__qualname__ = model.__name__.removesuffix("Config").lower()
    command.settings_model = model  # type: ignore[attr-defined]  # for tests/test_options.py
    command.extras = tuple(p.name for p in extras)  # type: ignore[attr-defined]
    return command
