"""Settings of ``usaf plan`` (flags, ``USAF_*`` variables, the ``[plan]`` table of ``--config``).

The model is declared in :mod:`usaf.settings.plan` (with every other command's); re-exported here.
"""

from __future__ import annotations

from usaf.settings.plan import PlanConfig

# The original tool's variables, honoured below --config, as usaf score and usaf train do.
LEGACY_ENV = {"FRAC": "frac", "TRAIN_FROM": "train_from", "MICROBATCH": "microbatch"}

__all__ = ["LEGACY_ENV", "PlanConfig"]
