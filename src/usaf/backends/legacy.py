"""The original tool's environment variables (``USE_CUDA``, ``USE_AMP``, ``USE_MULTI_GPU``).

People migrating keep these set, so they are honoured below every explicit setting:
``--device`` > ``USAF_DEVICE`` > ``--config`` > ``USE_CUDA`` > ``auto``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from usaf.backends.base import Note
from usaf.errors import UsafError

USE_CUDA = "USE_CUDA"
USE_AMP = "USE_AMP"
USE_MULTI_GPU = "USE_MULTI_GPU"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class LegacySettings:
    """What the legacy variables ask for.

    Attributes:
        use_cuda: ``USE_CUDA``: ``True`` = device cuda, ``False`` = auto without CUDA, ``None`` = unset.
        amp: ``USE_AMP``: mixed precision forced on/off, ``None`` = the backend's default.
        notes: warnings for what is not supported (``USE_MULTI_GPU``).
    """

    use_cuda: bool | None = None
    amp: bool | None = None
    notes: tuple[Note, ...] = ()


def _flag(env: Mapping[str, str], name: str, replacement: str) -> bool | None:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise UsafError(f"{name}={raw!r} is not 0 or 1", f"set {name}=1 or {name}=0, or use {replacement}")


def read_legacy_env(env: Mapping[str, str]) -> LegacySettings:
    """Read ``USE_CUDA``, ``USE_AMP`` and ``USE_MULTI_GPU``.

    Raises:
        UsafError: for a value that is not a recognisable 0/1 (naming the variable and the flag that
            replaces it).
    """
    use_cuda = _flag(env, USE_CUDA, "--device cuda / --device cpu")
    amp = _flag(env, USE_AMP, "the backend's default precision (unset it)")
    notes: list[Note] = []
    multi = env.get(USE_MULTI_GPU, "").strip().lower()
    if multi and multi not in _FALSE:
        notes.append(
            Note(
                "warning",
                f"{USE_MULTI_GPU}={env[USE_MULTI_GPU]!r} is not read: a usaf process runs on one device; "
                "data parallel is torchrun's (usaf train --nproc N, or torchrun -m usaf train); using one device",
            )
        )
    return LegacySettings(use_cuda=use_cuda, amp=amp, notes=tuple(notes))


# Device-related variables doctor explains; the USAF_* ones are explained by the CLI.
_FLAG_MEANINGS = {
    (USE_CUDA, True): "legacy: device cuda (below --device, USAF_DEVICE and --config)",
    (USE_CUDA, False): "legacy: choose automatically but never CUDA (below --device, USAF_DEVICE, --config)",
    (USE_AMP, True): "legacy: mixed precision on (bf16 where the backend has it, else fp16 + loss scaling)",
    (USE_AMP, False): "legacy: mixed precision off (fp32 everywhere)",
}
_OTHER_MEANINGS = {
    USE_MULTI_GPU: "legacy: not read (one device per process; data parallel: usaf train --nproc N, or torchrun)",
    "CUDA_VISIBLE_DEVICES": "which NVIDIA GPUs torch sees, renumbered from cuda:0",
    "HIP_VISIBLE_DEVICES": "which AMD GPUs a ROCm build of torch sees, renumbered from cuda:0",
    "ROCR_VISIBLE_DEVICES": "which AMD GPUs the ROCm runtime exposes",
    "HSA_OVERRIDE_GFX_VERSION": "ROCm: treat the GPU as this gfx version (consumer cards ROCm does not list)",
    "PYTORCH_CUDA_ALLOC_CONF": "torch CUDA allocator settings",
    "PYTORCH_HIP_ALLOC_CONF": "torch ROCm allocator settings",
    "PYTORCH_ENABLE_MPS_FALLBACK": "MPS: run ops MPS lacks on the CPU instead of failing",
    "PYTORCH_MPS_HIGH_WATERMARK_RATIO": "MPS: cap on memory use relative to the recommended maximum",
    "OMP_NUM_THREADS": "CPU threads torch uses",
}


def explain_env(env: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """The device-related variables that are set, as ``(name, value, meaning)`` rows."""
    rows: list[tuple[str, str, str]] = []
    for name in (USE_CUDA, USE_AMP):
        raw = env.get(name)
        if raw is None:
            continue
        try:
            value = _flag(env, name, "")
        except UsafError:
            rows.append((name, raw, "legacy: not 0 or 1, so an error when a run reads it"))
            continue
        meaning = "legacy: unset (empty)" if value is None else _FLAG_MEANINGS[name, value]
        rows.append((name, raw, meaning))
    for name, meaning in _OTHER_MEANINGS.items():
        if name in env:
            rows.append((name, env[name], meaning))
    return rows
