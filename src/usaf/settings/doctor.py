"""Settings of ``usaf doctor`` (table ``[doctor]`` of ``--config``)."""

from __future__ import annotations

from usaf.config import StageConfig
from usaf.settings import fields as f


class DoctorConfig(StageConfig):
    """Settings of ``usaf doctor`` (table ``[doctor]`` of ``--config``); unset device: legacy USE_CUDA, else auto."""

    device: str | None = f.device(None, default_text="")
