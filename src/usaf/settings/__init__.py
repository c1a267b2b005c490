"""Every command's settings, declared once: the flag, its type, default and help come from these models.

Light on purpose (stdlib, pydantic, :mod:`usaf.config`): the CLI builds its commands from these models
(:mod:`usaf.cli.flags`, when Typer first reads a command), so ``usaf --help`` must not import torch. A
stage module re-exports its model (``usaf.stages.score.ScoreConfig``). Field metadata under
``json_schema_extra={"cli": {...}}`` (:func:`usaf.settings.fields.cli`) says how a field becomes a flag
and which artifact decides it.
"""

from usaf.settings.fields import FRAC, SELECTION_FIELDS

__all__ = ["FRAC", "SELECTION_FIELDS"]
