"""Settings resolution shared by every command.

Each stage describes its settings once, as a frozen pydantic model whose fields default to the
documented default. The CLI passes flags that default to ``None`` (= not set), and
:func:`resolve_config` fills each field from the first source that sets it:

1. the command-line flag (``--seq-len``),
2. a ``USAF_*`` environment variable (``USAF_SEQ_LEN``),
3. the ``--config`` TOML file: the command's own table (``[tokenize]``) over ``[defaults]``,
4. a legacy environment variable of the original tool (``FRAC``, ``STEPS``, ...), where mapped,
5. the field's default.

A field whose metadata names a ``decided_by`` field (``frac`` is decided by train's ``plan``) is refused
when set on the command line or in the command's own table while its decider is set: the artifact decides
it. From a shared source (``USAF_*``, ``[defaults]``, legacy variables: every command reads those) it is
dropped instead.

Every problem, from every source, is collected and reported in one :class:`UsafError` that names
where each bad value came from, so a user fixes them all in one go.
"""

from __future__ import annotations

import json
import os
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from usaf.errors import UsafError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ENV_PREFIX = "USAF_"
DEFAULTS_TABLE = "defaults"

C = TypeVar("C", bound=BaseModel)


class StageConfig(BaseModel):
    """Base of every stage's settings: frozen, and unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def cli_meta(info: Any) -> dict[str, Any]:
    """A field's command-line metadata: ``json_schema_extra={"cli": {...}}`` (keys: usaf.settings.fields)."""
    extra = info.json_schema_extra
    return dict(extra.get("cli", {})) if isinstance(extra, dict) else {}


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def load_toml(path: Path) -> dict[str, Any]:
    """Read a ``--config`` TOML file, turning every failure into one clear line."""
    if not path.is_file():
        raise UsafError(f"--config {path}: no such file", "pass the path of a TOML file")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise UsafError(f"--config {path}: not valid TOML: {e}", "fix the file's syntax") from None
    except UnicodeDecodeError as e:  # tomllib decodes the bytes itself: a binary or Latin-1 file
        raise UsafError(f"--config {path}: not UTF-8 text (byte {e.start})", "TOML files must be UTF-8") from None
    except OSError as e:
        raise UsafError(f"--config {path}: cannot read it: {e.strerror}", "check its permissions") from None


def _is_list_field(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (list, tuple):
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_is_list_field(a) for a in typing.get_args(annotation))
    return False


def _parse_env_value(raw: str, annotation: Any) -> Any:
    """Environment variables are strings; lists are comma-separated or a JSON array."""
    if _is_list_field(annotation):
        raw = raw.strip()
        if raw.startswith("["):
            try:
                return json.loads(raw)
            except json.JSONDecodeError:
                pass
        return [part.strip() for part in raw.split(",") if part.strip()]
    return raw


def resolve_config(
    cls: type[C],
    *,
    section: str,
    cli: Mapping[str, Any],
    config_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    legacy_env: Mapping[str, str] | None = None,
) -> C:
    """Build ``cls`` from flags, environment, TOML and defaults (in that order of precedence).

    Args:
        cls: the stage's settings model.
        section: the TOML table of this command (``"tokenize"``).
        cli: flag values by field name; ``None`` means the flag was not given.
        config_file: the ``--config`` TOML file, if any.
        env: the environment (``os.environ`` by default).
        legacy_env: original-tool variable name -> field name, honoured below the TOML file.

    Raises:
        UsafError: listing every invalid value with its source and the fix.
    """
    env = os.environ if env is None else env
    fields = cls.model_fields
    values: dict[str, Any] = {}
    origin: dict[str, str] = {}
    problems: list[str] = []

    def offer(field: str, value: Any, source: str) -> None:
        if field not in values and value is not None:
            values[field] = value
            origin[field] = source

    unknown_cli = set(cli) - set(fields)
    if unknown_cli:  # a programming error in the CLI layer, not a user error
        raise TypeError(f"{cls.__name__} has no fields {sorted(unknown_cli)}")
    for field, value in cli.items():
        offer(field, value, flag_name(field))

    for field, info in fields.items():
        raw = env.get(env_name(field))
        if raw is not None and raw != "":
            offer(field, _parse_env_value(raw, info.annotation), env_name(field))

    if config_file is not None:
        document = load_toml(config_file)
        own = document.get(section, {})
        shared = document.get(DEFAULTS_TABLE, {})
        for name, table in ((section, own), (DEFAULTS_TABLE, shared)):
            if not isinstance(table, dict):
                problems.append(f"--config {config_file}: [{name}] must be a table")
        if isinstance(own, dict):
            for key in sorted(set(own) - set(fields)):
                problems.append(
                    f"--config {config_file}: [{section}] has no setting '{key}' (known: {', '.join(sorted(fields))})"
                )
            for field in fields:
                offer(field, own.get(field), f"--config {config_file} [{section}] {field}")
        if isinstance(shared, dict):
            for field in fields:
                offer(field, shared.get(field), f"--config {config_file} [{DEFAULTS_TABLE}] {field}")

    for legacy, field in (legacy_env or {}).items():
        raw = env.get(legacy)
        if raw is not None and raw != "" and field in fields:
            offer(field, _parse_env_value(raw, fields[field].annotation), f"legacy env {legacy}")

    _apply_deciders(fields, values, origin, own_table=f"--config {config_file} [{section}] ")

    if not problems:
        try:
            return cls(**values)
        except ValidationError as e:
            for err in e.errors():
                field = str(err["loc"][0]) if err["loc"] else ""
                if not field:  # a cross-field check: its message names the flags itself
                    problems.append(str(err["msg"]).removeprefix("Value error, "))
                    continue
                where = origin.get(field, f"{flag_name(field)} (default)")
                given = f" = {values[field]!r}" if field in values else ""
                problems.append(f"{where}{given}: {err['msg']}")
    raise UsafError(
        "invalid settings: " + "; ".join(problems),
        "fix the values above (flags win over USAF_* variables, which win over --config)",
    )


def _apply_deciders(
    fields: Mapping[str, Any], values: dict[str, Any], origin: dict[str, str], *, own_table: str
) -> None:
    """Refuse (or, from a shared source, drop) the values that an artifact given in another field decides.

    ``own_table``: the origin prefix of the command's own TOML table; with the flag, the sources a user
    writes for this command alone.
    """
    flag = flag_name
    refused: list[tuple[str, str]] = []
    for field, info in fields.items():
        decider = cli_meta(info).get("decided_by")
        if decider not in fields or values.get(decider) is None or field not in values:
            continue
        if origin[field] == flag(field) or origin[field].startswith(own_table):
            refused.append((field, decider))
        else:  # USAF_*, [defaults] or a legacy variable: meant for every command, not against this artifact
            del values[field], origin[field]
    if refused:
        deciders = {decider for _, decider in refused}
        remedies = [cli_meta(fields[d]).get("remedy") for d in sorted(deciders)]
        given = ", ".join(flag(field) for field, _ in refused)
        raise UsafError(
            "; ".join(f"{origin[field]}: {flag(d)} {values[d]} decides it" for field, d in refused),
            f"drop {given}" + "".join(f", or {r}" for r in remedies if r),
        )
