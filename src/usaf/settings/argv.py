"""How a settings field is spelled on the command line, and the command line that gives a settings object.

Shared by the CLI builder (:mod:`usaf.cli.flags`) and by whatever shows a user the command that does what it
did (``usaf demo``'s step-by-step lines), so both spell every flag the same way.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

from pydantic import BaseModel

from usaf.config import cli_meta


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def cli_type(annotation: Any) -> Any:
    """The command-line type of a field's annotation: ``X | None`` → X, ``Literal["a", "b"]`` → str,
    ``Annotated[X, ...]`` → X (pydantic strips it from a field's own annotation, not from inside ``| None``)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return cli_type(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return cli_type(args[0]) if len(args) == 1 else str
    if origin is Literal:
        return type(typing.get_args(annotation)[0])
    if origin in (list, tuple):
        return list[cli_type(typing.get_args(annotation)[0])]  # type: ignore[misc]
    return annotation


def is_plain_switch(info: Any) -> bool:
    """``--x`` alone (given = True, absent = not set), where a negative flag would say nothing."""
    flag = cli_meta(info).get("flag")
    if flag is not None:
        return "/" not in flag
    return cli_type(info.annotation) is bool and info.default is False


def declaration(name: str, info: Any) -> str:
    """``--name``, ``--name/--no-name`` (booleans not defaulting to False) or the field's own declaration."""
    meta = cli_meta(info)
    if "flag" in meta:
        return meta["flag"]
    if cli_type(info.annotation) is bool and not is_plain_switch(info):
        return f"{flag_of(name)}/--no-{name.replace('_', '-')}"
    return flag_of(name)


def command_line(command: str, settings: BaseModel) -> list[str]:
    """``usaf COMMAND ...`` giving ``settings``: every setting that differs from its default, as its flag."""
    args = ["usaf", command]
    for name, info in type(settings).model_fields.items():
        value = getattr(settings, name)
        if cli_meta(info).get("hidden") or value == info.get_default(call_default_factory=True):
            continue
        if cli_meta(info).get("argument"):
            args += [str(v) for v in value] if isinstance(value, list) else [str(value)]
            continue
        on, _, off = declaration(name, info).partition("/")
        if isinstance(value, bool):
            args.append(on if value else off)
        elif isinstance(value, list):
            args += [part for item in value for part in (on, str(item))]
        else:
            args += [on, str(value)]
    return args
