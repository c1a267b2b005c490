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
dropped instead. A field marked ``own_only`` (its name means something else to other commands) is read from
the flag and the command's own table alone.

Every problem, from every source, is collected and reported in one :class:`UsafError` that names
where each bad value came from (the variable, not the flag, for a ``USAF_*`` value; the file and table for a
TOML one), so a user fixes them all in one go. Two checks hold for every command at once:

- a float setting must be finite (``inf``, ``nan``, ``1e309``), from any source (``StageConfig``);
- a ``--config`` file may hold only the tables of commands that read one (:func:`register_tables`), each
  with that command's keys, and ``[defaults]`` only keys some command has; a misspelt name is refused with
  the closest valid one.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, PrivateAttr, TypeAdapter, ValidationError, field_validator

from usaf.errors import UsafError, not_a

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ENV_PREFIX = "USAF_"
DEFAULTS_TABLE = "defaults"

C = TypeVar("C", bound=BaseModel)


class StageConfig(BaseModel):
    """Base of every stage's settings: frozen, unknown keys are errors, and floats are finite.

    ``allow_inf_nan=False``: ``--lr inf``, ``USAF_LR=nan`` or ``lr = 1e309`` (which parses to inf) would
    train to NaN or overflow a step count; refused here once, for every float field of every command.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    _sources: dict[str, str] = PrivateAttr(default_factory=dict)  # field -> where resolve_config found it
    # shared-source values (USAF_*, [defaults], legacy) dropped because an artifact given decides them: where each came
    # from -> the deciding flag and value, for the command to say (dropped in silence before; found in review)
    _dropped: dict[str, str] = PrivateAttr(default_factory=dict)

    @field_validator("*", mode="after")
    @classmethod
    def _home_expanded(cls, value: Any) -> Any:
        """``~`` in a path setting is the home directory: a shell expands it only at a word's start, so ``--out=~/x``,
        a quoted path, a ``USAF_*`` variable or a ``--config`` value wrote into a directory named ``~`` (review)."""
        if isinstance(value, Path):
            return _expanded(value)
        if isinstance(value, list) and value and all(isinstance(v, Path) for v in value):
            return [_expanded(v) for v in value]
        return value

    def __eq__(self, other: object) -> bool:
        """Equal settings are equal values: where each came from (``_sources``) is no part of them."""
        if not isinstance(other, BaseModel):
            return NotImplemented
        return type(self) is type(other) and self.__dict__ == other.__dict__


def _expanded(path: Path) -> Path:
    try:
        return path.expanduser()
    except RuntimeError:  # no home directory to expand to: the path as given
        return path


LEGACY_SOURCE = "legacy env "  # a setting's source: the original tool's variable (``legacy env LR_PEAK``)


def source_of(settings: BaseModel, field: str) -> str:
    """Where a resolved setting came from, as a user would look for it: ``--lr``, ``USAF_LR``, ``--config f.toml
    [train] lr``, ``legacy env LR_PEAK``; its flag when it was defaulted or set by code.

    For the checks made after resolving (a size, a context length): their message names this, not the flag.
    """
    sources = getattr(settings, "_sources", None) or {}
    return sources.get(field, flag_name(field))


def was_given(settings: BaseModel, field: str) -> bool:
    """The value came from somewhere the user set it (a flag, ``USAF_*``, a ``--config`` table, a legacy variable),
    not from the field's default."""
    return field in (getattr(settings, "_sources", None) or {})


def refuse_unused(settings: BaseModel, field: str, why: str, remedy: str, note: Callable[[str], None]) -> None:
    """A setting given that the command would not use: refused from its flag, where the user asked for it in this
    command; ``note``-d from ``USAF_*`` or ``--config``, which may be meant for other runs. Never accepted in
    silence. Nothing where it was not given."""
    if not was_given(settings, field):
        return
    source, value = source_of(settings, field), getattr(settings, field)
    problem = f"{source} {value}: {why}"
    if source == flag_name(field):
        if isinstance(value, bool):  # a switch: as typed (--all-files, --no-follow-symlinks), not "--all-files True"
            problem = f"{flag_name(field) if value else '--no-' + flag_name(field)[2:]}: {why}"
        raise UsafError(problem, remedy)
    note(problem)


# Every ``--config`` table and the keys it may hold; installed by :mod:`usaf.settings` (which sits above
# this module), read when a file is checked. None: only the command's own table is checked.
Tables = Callable[[], Mapping[str, Collection[str]]]
_tables: Tables | None = None


def register_tables(tables: Tables) -> None:
    """Install the catalogue of ``--config`` tables: table name -> the setting names it may hold."""
    global _tables
    _tables = tables


def cli_meta(info: Any) -> dict[str, Any]:
    """A field's command-line metadata: ``json_schema_extra={"cli": {...}}`` (keys: usaf.settings.fields)."""
    extra = info.json_schema_extra
    return dict(extra.get("cli", {})) if isinstance(extra, dict) else {}


def table_fields(model: type[BaseModel]) -> frozenset[str]:
    """The settings a ``--config`` table may hold: every field but a positional argument the command line requires
    (generate's PROMPT), without which the command does not start, so that a table's value could never be used
    (``[generate] prompt`` was accepted and ignored; found in review)."""
    return frozenset(
        name for name, info in model.model_fields.items() if not (cli_meta(info).get("argument") and info.is_required())
    )


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def legacy_note(settings: BaseModel) -> str | None:
    """The settings read from the original tool's variables, said: ``STEPS=3`` set a 3-step run in silence, where
    ``LR_PEAK`` was named as the lr's source (found in review). None where none was read."""
    read = [(source.removeprefix(LEGACY_SOURCE), field) for field, source in (getattr(settings, "_sources", None) or
            {}).items() if source.startswith(LEGACY_SOURCE)]  # fmt: skip
    if not read:
        return None
    shown = ", ".join(f"{name}={getattr(settings, field)} as {flag_name(field)}" for name, field in read)
    return f"read from the original tool's environment variables: {shown} (usaf's own: {env_name(read[0][1])}, ...)"


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def load_toml(path: Path) -> dict[str, Any]:
    """Read a ``--config`` TOML file, turning every failure into one clear line."""
    path = _expanded(path)
    if not path.is_file():
        raise UsafError(f"--config {path}: {not_a(path, 'file')}", "pass the path of a TOML file")
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
    if _literal_ints(annotation):  # pydantic converts "4" for an int field, not for Literal[2, 3, 4, 8]: USAF_NBITS=4
        try:  # was refused for every value (found in review)
            return int(raw.strip())
        except ValueError:
            return raw  # refused by the field, naming it
    return raw


def _literal_ints(annotation: Any) -> bool:
    """Whether the field is a ``Literal`` of whole numbers (``Literal[2, 3, 4, 8]``, or one of them or None)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_literal_ints(a) for a in typing.get_args(annotation))
    values = typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else ()
    return bool(values) and all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _takes_bool(annotation: Any) -> bool:
    """Whether a field of this annotation holds a boolean (``bool``, ``bool | None``)."""
    return annotation is bool or bool in typing.get_args(annotation)


def _names_a_path(info: Any) -> bool:
    """Whether a field holds a path (``Path``, ``list[Path]``, optional or not) or a directory-or-hub-id text
    (``names_a_path``), where an empty value would read as the current directory."""
    annotation = info.annotation
    args = typing.get_args(annotation)
    inner = [a for arg in (annotation, *args) for a in (arg, *typing.get_args(arg))]
    return Path in inner or bool(cli_meta(info).get("names_a_path"))


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
    stand_ins: set[str] = set()  # fields whose refused value was replaced for the checks of the others

    def offer(field: str, value: Any, source: str) -> None:
        if field not in values and value is not None:
            if isinstance(value, bool) and not _takes_bool(fields[field].annotation):  # lax pydantic read true as 1
                problems.append(f"{source} = {str(value).lower()}: a boolean, which this setting does not take")
                return
            if _names_a_path(fields[field]) and (value == "" or (isinstance(value, list) and "" in value)):
                # a list was said as `= ""` (review)
                shown = '""' if value == "" else f'{json.dumps(value, default=str)}, whose ""'
                problems.append(f"{shown.join((source + ' = ', ''))} is an empty path, which reads as the current "
                                "directory")  # fmt: skip
                # the refused value's place held by one that passes, so the checks of the others run without "no
                # INPUTS given" or "--model is required" of it (found in review); its own errors are not said
                values[field] = ([v for v in value if v != ""] or ["."]) if isinstance(value, list) else "."
                origin[field] = source
                stand_ins.add(field)
                return
            values[field] = value
            origin[field] = source

    unknown_cli = set(cli) - set(fields)
    if unknown_cli:  # a programming error in the CLI layer, not a user error
        raise TypeError(f"{cls.__name__} has no fields {sorted(unknown_cli)}")
    for field, value in cli.items():
        offer(field, value, flag_name(field))

    shared = [field for field, info in fields.items() if not cli_meta(info).get("own_only")]  # see settings.fields
    for field, info in fields.items():
        raw = env.get(env_name(field)) if field in shared else None
        if raw is not None and raw != "":
            offer(field, _parse_env_value(raw, info.annotation), env_name(field))

    if config_file is not None:
        document = load_toml(config_file)
        own = document.get(section, {})
        defaults = document.get(DEFAULTS_TABLE, {})
        problems += document_problems(document, config_file, section, table_fields(cls), shared)
        if isinstance(own, dict):
            for field in fields:
                offer(field, own.get(field), f"--config {config_file} [{section}] {field}")
        if isinstance(defaults, dict):
            for field in shared:
                offer(field, defaults.get(field), f"--config {config_file} [{DEFAULTS_TABLE}] {field}")

    problems += _unread_variables(fields, shared, values, env, section)

    for legacy, field in (legacy_env or {}).items():
        raw = env.get(legacy)
        if raw is not None and raw != "" and field in shared:
            offer(field, _parse_env_value(raw, fields[field].annotation), f"{LEGACY_SOURCE}{legacy}")

    dropped = _apply_deciders(fields, values, origin, own_table=f"--config {config_file} [{section}] ")
    _apply_alternatives(fields, values, origin, section)

    try:  # the values read are checked even when the file has unknown names: every problem at once
        settings = cls(**values)
    except ValidationError as e:
        problems += _value_problems(e, values, origin, ignored=stand_ins)
    else:
        if not problems:
            settings._sources = dict(origin)
            settings._dropped = dropped
            return settings
    # which source wins matters only where one was not a flag: said of every error, it read as unrelated (review)
    shared_source = any(("USAF_" in p or "--config" in p or "legacy env" in p) for p in problems)
    raise UsafError(
        "invalid settings: " + "; ".join(problems),
        f"fix {'the setting' if len(problems) == 1 else 'each setting'} the error names"
        + (" (flags win over USAF_* variables, which win over --config)" if shared_source else ""),
    )


def _unread_variables(
    fields: Mapping[str, Any], shared: Collection[str], values: Mapping[str, Any], env: Mapping[str, str], section: str
) -> list[str]:
    """``USAF_<FIELD>`` of a field no command reads from the environment (``own_only`` in every command that has it),
    set where neither the flag nor the command's own table gave the field: refused, not ignored in silence. One
    that asks for the field's default (``USAF_OVERWRITE=0``) is moot: what happens anyway (review)."""
    read_from_env = (_tables() if _tables is not None else {}).get(DEFAULTS_TABLE)  # by some command
    if read_from_env is None:
        return []
    problems = []
    for field in sorted(set(fields) - set(shared) - set(values) - set(read_from_env)):
        raw = env.get(env_name(field))
        if not raw:
            continue
        try:  # read as the field reads it (a bool's "0" is False)
            annotation = fields[field].annotation
            moot = TypeAdapter(annotation).validate_python(_parse_env_value(raw, annotation)) == fields[field].default
        except (ValueError, TypeError):
            moot = False
        if not moot:
            problems.append(f"{env_name(field)}: read by no command (each that has {flag_name(field)} reads it from "
                            f"the flag or its own --config table only): pass {flag_name(field)}, or put {field} under "
                            f"[{section}] of a --config file")  # fmt: skip
    return problems


def _value_problems(
    e: ValidationError, values: Mapping[str, Any], origin: Mapping[str, str], *, ignored: Collection[str] = ()
) -> list[str]:
    """One line per bad value, naming where it came from (the flag, the variable, the file's table); none of the
    ``ignored`` fields (a stand-in for a value already refused)."""
    problems = []
    for err in e.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        if field in ignored:
            continue
        if not field:  # a cross-field check: its message names the flags, renamed to where each came from
            problems.append(_name_sources(str(err["msg"]).removeprefix("Value error, "), origin))
            continue
        where = origin.get(field, f"{flag_name(field)} (default)")
        given = f" = {values[field]!r}" if field in values else ""
        reason = _reason(err)
        if err["type"] == "list_type" and isinstance(values.get(field), str) and "--config" in where:
            reason += f' (in TOML, a list: {field} = [{json.dumps(values[field])}])'  # pydantic's words alone (review)
        problems.append(f"{where}{given}: {reason}")
    return problems


def _reason(err: Mapping[str, Any]) -> str:
    """pydantic's message for one bad value, where its own would not say what to pass."""
    if err["type"] == "finite_number":  # inf, -inf, nan, or a literal beyond float range (1e309)
        return "not a finite number (inf or nan; a literal such as 1e309 overflows to inf)"
    return str(err["msg"])


def _name_sources(message: str, origin: Mapping[str, str]) -> str:
    """A cross-field message with each ``--flag`` whose value came from elsewhere named by that source.

    ``--reselect-every 500 exceeds --steps 3`` with ``USAF_RESELECT_EVERY=500`` becomes ``USAF_RESELECT_EVERY
    500 exceeds --steps 3``: a user looks for the value where it was set, and no flag was given.
    """
    for field, source in origin.items():
        flag = flag_name(field)
        if source != flag:
            message = re.sub(re.escape(flag) + r"(?![\w-])", lambda _, name=source: name, message)  # verbatim
    return message


def _closest(name: str, known: Collection[str], spell: str = "'{}'") -> str:
    """`` (did you mean 'x'?)`` for a misspelt name, else the known names (a short list) or nothing."""
    match = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    if match:
        return f" (did you mean {spell.format(match[0])}?)"
    return f" (known: {', '.join(spell.format(k) for k in sorted(known))})" if len(known) <= 60 else ""


def document_problems(
    document: Mapping[str, Any], path: Path, section: str, fields: Collection[str], shared_fields: Collection[str]
) -> list[str]:
    """Every unknown table and key of a ``--config`` document, each with the closest valid name, and every
    ``[defaults]`` key no command reads from there.

    ``section``/``fields``: the running command's table and settings, ``shared_fields`` those of them it reads from
    ``[defaults]`` (they win over the catalogue, so a settings model that is not a registered command, as in tests,
    checks its own table all the same). Without a registered catalogue only that table is checked.
    """
    tables = {name: set(keys) for name, keys in (_tables() if _tables is not None else {}).items()}
    defaults_keys = tables.pop(DEFAULTS_TABLE, set())  # the names some command reads from [defaults]
    tables[section] = set(fields)
    anywhere = set().union(*tables.values())
    shared = (defaults_keys | (set(shared_fields) & set(fields))) if _tables is not None else anywhere
    where = f"--config {path}"
    problems = []
    for name, table in document.items():
        if name != DEFAULTS_TABLE and name not in tables:
            if _tables is None:
                continue
            if not isinstance(table, dict):
                problems.append(f"{where}: '{name}' is outside any table (settings go under [defaults] or [COMMAND])")
            else:
                closest = _closest(name, [DEFAULTS_TABLE, *tables], spell="[{}]")
                problems.append(f"{where}: unknown table [{name}]{closest}")
            continue
        if not isinstance(table, dict):
            problems.append(f"{where}: [{name}] must be a table")
            continue
        if name == DEFAULTS_TABLE and _tables is None:
            continue  # which commands exist is unknown: a key of another command's may be right
        known = shared if name == DEFAULTS_TABLE else tables[name]
        for key in sorted(set(table) - known):
            if name == DEFAULTS_TABLE and key in anywhere:  # read by nobody from [defaults]: it was accepted, unused
                owners = sorted(command for command, keys in tables.items() if key in keys)
                listed = ", ".join(owners[:-1]) + f" and {owners[-1]}" if len(owners) > 1 else owners[0]
                problems.append(f"{where}: [{name}] has '{key}', which {listed} read only from their own table: put "
                                f"it under {' or '.join(f'[{o}]' for o in owners)}")  # fmt: skip
                continue
            what = f"'{key}', a setting no command has" if name == DEFAULTS_TABLE else f"no setting '{key}'"
            problems.append(f"{where}: [{name}] has {what}{_closest(key, known)}")
    return problems


def _rank(source: str, section: str) -> int:
    """A source's precedence (lower wins): the flag, ``USAF_*``, the command's table, ``[defaults]``, legacy."""
    if source.startswith("--config "):
        return 2 if f" [{section}] " in source else 3
    if source.startswith("legacy env "):
        return 4
    return 1 if source.startswith(ENV_PREFIX) else 0


def _apply_alternatives(
    fields: Mapping[str, Any], values: dict[str, Any], origin: dict[str, str], section: str
) -> None:
    """Two fields that are one choice (train's ``--epochs`` or ``--steps``, metadata ``alternative_to``): from
    sources of different precedence, the higher one's wins and the other is dropped, as for one field (``USAF_STEPS``
    with ``--epochs`` was refused although flags win over USAF_*; found in review). From one level both are kept,
    for the model's check to refuse."""
    for field, info in fields.items():
        other = cli_meta(info).get("alternative_to")
        if other not in values or field not in values:
            continue
        mine, theirs = _rank(origin[field], section), _rank(origin[other], section)
        if mine != theirs:
            loser = other if mine < theirs else field
            del values[loser], origin[loser]


def _apply_deciders(
    fields: Mapping[str, Any], values: dict[str, Any], origin: dict[str, str], *, own_table: str
) -> dict[str, str]:
    """Refuse (or, from a shared source, drop) the values that an artifact given in another field decides; returns
    the dropped ones (``USAF_FRAC 0.1`` -> ``--plan p``).

    ``own_table``: the origin prefix of the command's own TOML table; with the flag, the sources a user
    writes for this command alone.
    """
    dropped: dict[str, str] = {}
    flag = flag_name
    refused: list[tuple[str, str]] = []
    for field, info in fields.items():
        decider = cli_meta(info).get("decided_by")
        if decider not in fields or values.get(decider) is None or field not in values:
            continue
        if origin[field] == flag(field) or origin[field].startswith(own_table):
            refused.append((field, decider))
        else:  # USAF_*, [defaults] or a legacy variable: meant for every command, not against this artifact
            dropped[f"{origin[field]} {values[field]}"] = f"{flag(decider)} {values[decider]}"
            del values[field], origin[field]
    if refused:
        deciders = {decider for _, decider in refused}
        remedies = [cli_meta(fields[d]).get("remedy") for d in sorted(deciders)]
        given = ", ".join(origin[field] for field, _ in refused)  # where it came from: a --config table's key too
        raise UsafError(
            "; ".join(f"{origin[field]}: {flag(d)} {values[d]} decides it" for field, d in refused),
            f"drop {given}" + "".join(f", or {r}" for r in remedies if r),
        )
    return dropped
