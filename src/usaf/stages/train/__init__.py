"""``usaf train``: sparse fine-tuning of a quantized MoE model from a plan, with RigL reselection.

The run directory holds ``run-settings.json``, ``metrics.jsonl``, atomic ``checkpoints/step-N/`` and, when
the run completes, ``final/`` and ``manifest.json``. Ctrl-C writes a checkpoint of the last finished
step; running the same command again (or ``--resume``) continues from the newest checkpoint exactly.

Under ``torchrun`` every rank runs this same function (see :mod:`usaf.distributed`): checks and reads on
every rank, writes on rank 0 between barriers, collectives in the same order everywhere.

Modules: :mod:`.config` (the settings), :mod:`.inputs` (everything resolved and checked before expensive
work), :mod:`.budget` (``--vram/--ram``), :mod:`.run` (the stage function), :mod:`.loop` (the step loop and
the RigL cadence), :mod:`.trainer` (one step's mechanics, evaluation, checkpoints). Importing the package
imports no torch.
"""

from usaf.stages.train.config import LEGACY_ENV, TrainConfig
from usaf.stages.train.run import run  # binds ``run`` to the function, not the module of the same name

__all__ = ["LEGACY_ENV", "TrainConfig", "run"]
