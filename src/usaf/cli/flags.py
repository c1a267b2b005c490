"""Typer commands built from the settings models, so each option is declared once (in :mod:`usaf.settings`).

A field becomes a parameter ``Annotated[T | None, typer.Option("--kebab-name", help=...)] = None``: ``None``
means "not given", which :func:`usaf.config.resolve_config` needs to let ``USAF_*`` variables, ``--config``
and defaults fill the setting. The help is the field's description followed by ``[default: …]``, written
from the field's default or its declared ``default_text`` (metadata keys: :mod:`usaf.settings.fields`).
Typer reads the generated ``__signature__``; the command body receives the flags as a dict by field name.

pydantic and the settings models are imported inside the functions, when Typer first builds a command:
importing a command module stays as light as it was (``tests/test_doctor.py`` checks).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from usaf.cli.options import STAGE_EXTRAS, name_not_empty, path_not_empty

Body = Callable[..., None]


def default_text(info: Any) -> str:
    """What ``[default: …]`` says for a field ("" = nothing): the declared text, else its default."""
    from pydantic_core import PydanticUndefined

    from usaf.config import cli_meta
    from usaf.settings.argv import is_plain_switch

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
    from usaf.config import cli_meta

    return not cli_meta(info).get("hidden", False)


def parameters(model: type) -> Iterator[inspect.Parameter]:
    """The command-line parameters of a settings model, in field order."""
    from usaf.config import cli_meta
    from usaf.settings.argv import cli_type, declaration

    for name, info in model.model_fields.items():
        if not is_flag(info):
            continue
        meta = cli_meta(info)
        base = cli_type(info.annotation)
        help_ = help_text(info)
        paths = ({"parser": path_not_empty} if base in (Path, list[Path]) else
                 {"parser": name_not_empty} if meta.get("names_a_path") else {})  # fmt: skip
        if meta.get("argument"):
            spec: Any = typer.Argument(help=help_, show_default=False, metavar=name.upper(), **paths)  # as said
        else:
            bounds = {key: meta[key] for key in ("min", "max") if key in meta}
            names = (declaration(name, info), *([meta["alias"]] if "alias" in meta else []))
            spec = typer.Option(*names, help=help_, show_default=False, **bounds, **paths,
                                **({"metavar": "<path>"} if base is Path else {}))  # as click's path type says it
        required = info.is_required()
        annotation = Annotated[base if required else base | None, spec]  # type: ignore[operator]
        default = inspect.Parameter.empty if required else None
        yield inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)


def settings_command(
    model: str | type, body: Body, *, doc: str, extras: Sequence[inspect.Parameter] = STAGE_EXTRAS
) -> SettingsCommand:
    """A Typer command whose options are the fields of ``model`` plus the CLI-only ``extras``.

    ``model`` is ``"module:Class"`` (imported when Typer first reads the command) or the class itself.

    ``body(cli, **extras)`` gets the flags by field name (``None`` = not given; an empty repeatable option
    and an absent plain switch are ``None`` too) and the extras by their parameter names.
    """
    return SettingsCommand(model, body, doc=doc, extras=extras)


class SettingsCommand:
    """A callable whose signature is built from its settings model when Typer first reads it.

    The model is imported then, not when the command module is: importing a command module (and the app)
    loads neither pydantic nor the settings models until a command line is parsed or its help printed.
    """

    def __init__(self, model: str | type, body: Body, *, doc: str, extras: Sequence[inspect.Parameter]) -> None:
        self._model = model
        self._body = body
        self._extras = tuple(extras)
        self.extras = tuple(p.name for p in extras)  # for tests/test_options.py
        self.__doc__ = doc
        name = model if isinstance(model, str) else model.__name__
        self.__name__ = self.__qualname__ = name.rpartition(":")[2].removesuffix("Config").lower()
        self.__module__ = body.__module__

    @functools.cached_property
    def settings_model(self) -> type:
        if not isinstance(self._model, str):
            return self._model
        module, _, name = self._model.partition(":")
        return getattr(importlib.import_module(module), name)

    @functools.cached_property
    def _fields(self) -> list[inspect.Parameter]:
        return list(parameters(self.settings_model))

    @property
    def __signature__(self) -> inspect.Signature:  # what Typer reads (inspect.signature)
        return inspect.Signature([*self._fields, *self._extras])

    @property
    def __annotations__(self) -> dict[str, Any]:  # what Typer reads too (typing.get_type_hints)
        return {p.name: p.annotation for p in [*self._fields, *self._extras]}

    def __call__(self, **kwargs: Any) -> None:
        from usaf.settings.argv import is_plain_switch

        fields = self.settings_model.model_fields
        cli = {}
        for p in self._fields:
            value = kwargs.pop(p.name, None)
            if value in ((), []) or (value is False and is_plain_switch(fields[p.name])):
                value = None
            cli[p.name] = list(value) if isinstance(value, tuple) else value
        self._body(cli, **kwargs)
