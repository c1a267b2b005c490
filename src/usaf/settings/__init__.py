"""Every command's settings, declared once: the flag, its type, default and help come from these models.

Light on purpose (stdlib, pydantic, :mod:`usaf.config`): the CLI builds its commands from these models
(:mod:`usaf.cli.flags`, when Typer first reads a command), so ``usaf --help`` must not import torch. A
stage module re-exports its model (``usaf.stages.score.ScoreConfig``). Field metadata under
``json_schema_extra={"cli": {...}}`` (:func:`usaf.settings.fields.cli`) says how a field becomes a flag
and which artifact decides it.

:data:`TABLES` lists the commands that read ``--config``; :mod:`usaf.config` checks a file's tables and keys
against them (registered here, because the settings models sit above it).
"""

from __future__ import annotations

import functools
import importlib

from usaf.config import DEFAULTS_TABLE, cli_meta, register_tables, table_fields
from usaf.settings.fields import FRAC, SELECTION_FIELDS

__all__ = ["FRAC", "SELECTION_FIELDS", "TABLES", "table_keys"]

# The ``--config`` table of every command that reads one -> its settings model ("module:Class" here).
# inspect and tiny-model take command-line settings only: a table of theirs would be read by nothing.
TABLES = {
    "demo": "demo:DemoConfig",
    "doctor": "doctor:DoctorConfig",
    "tokenize": "tokenize:TokenizeConfig",
    "quantize": "quantize:QuantizeConfig",
    "score": "score:ScoreConfig",
    "train": "train:TrainConfig",
    "eval": "eval:EvalConfig",
    "plan": "plan:PlanConfig",
    "export": "export:ExportConfig",
    "generate": "generate:GenerateConfig",
}


@functools.cache
def table_keys() -> dict[str, frozenset[str]]:
    """Each ``--config`` table's valid keys: its command's setting names; and ``[defaults]``'s, the names some command
    reads from a shared source (every setting but those marked ``own_only``)."""
    keys, shared = {}, set()
    for table, spec in TABLES.items():
        module, _, name = spec.partition(":")
        # lazy: only a --config file needs every command's model; importing one command's stays cheap
        model = getattr(importlib.import_module(f"usaf.settings.{module}"), name)
        keys[table] = table_fields(model)
        shared |= {field for field in keys[table] if not cli_meta(model.model_fields[field]).get("own_only")}
    return {**keys, DEFAULTS_TABLE: frozenset(shared)}


register_tables(table_keys)
