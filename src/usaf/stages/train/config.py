"""The settings of ``usaf train`` (declared once, in :mod:`usaf.settings.train`), and the original tool's variables."""

from __future__ import annotations

from usaf.settings.train import TrainConfig

# The original tool's environment variables, honoured below --config (README documents them).
LEGACY_ENV = {
    "FRAC": "frac",
    "STEPS": "steps",
    "EPOCHS": "epochs",
    "TRAIN_FROM": "train_from",
    "MICROBATCH": "microbatch",
    "LR_PEAK": "lr",
    "RESELECT_EVERY": "reselect_every",
    "DATASET_PATH": "data",
    "QUANT_PATH": "model",
}

__all__ = ["LEGACY_ENV", "TrainConfig"]
