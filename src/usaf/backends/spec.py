"""Device spec strings: ``auto|cpu|cuda|cuda:N|mps|directml|directml:N``.

Parsing is pure (no torch calls) so a typo is reported before any device is touched. Whether the
parsed device exists on this machine is checked by :func:`usaf.backends.resolve_backend`.
"""

from __future__ import annotations

from dataclasses import dataclass

from usaf.errors import UsafError

AUTO = "auto"
CPU = "cpu"
CUDA = "cuda"
MPS = "mps"
DIRECTML = "directml"

KINDS: tuple[str, ...] = (CPU, CUDA, MPS, DIRECTML)
#: The order ``--device auto`` tries: discrete GPUs first, then Apple silicon, then the always-there CPU.
AUTO_ORDER: tuple[str, ...] = (CUDA, DIRECTML, MPS, CPU)
#: Backends that address several devices by index (``cuda:1``).
INDEXED: frozenset[str] = frozenset({CUDA, DIRECTML})

SPEC_FORMS = "auto, cpu, cuda, cuda:N, mps, directml or directml:N"

# Names people reach for that are spelled differently here; each maps to the hint that fixes it.
_ALIASES = {
    "gpu": "NVIDIA and ROCm GPUs are --device cuda",
    "nvidia": "NVIDIA GPUs are --device cuda",
    "rocm": "ROCm builds of torch use the CUDA device name: --device cuda",
    "hip": "ROCm builds of torch use the CUDA device name: --device cuda",
    "amd": "AMD GPUs are --device cuda on Linux with ROCm, --device directml on Windows",
    "dml": "DirectML is spelled --device directml",
    "privateuseone": "DirectML is spelled --device directml",
    "metal": "Apple GPUs are --device mps",
    "apple": "Apple GPUs are --device mps",
}


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed ``--device`` value.

    Attributes:
        kind: ``"auto"`` or one of :data:`KINDS`.
        index: the device index for ``cuda:N``/``directml:N``; ``None`` means "the default one".
    """

    kind: str
    index: int | None = None

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


def _bad(source: str, text: str, why: str, hint: str) -> UsafError:
    return UsafError(f"{source} {text}: {why}", hint)


def parse_device_spec(text: str, *, source: str = "--device") -> DeviceSpec:
    """Parse a device spec, case-insensitively and ignoring surrounding spaces.

    Args:
        text: the value of ``--device`` (or ``USAF_DEVICE``, or ``device`` in a ``--config`` file).
        source: where the value came from, as the error names it (``usaf.config.source_of``).

    Returns:
        The parsed spec.

    Raises:
        UsafError: for an unknown name or a bad index, naming ``source`` and the accepted forms.
    """
    raw = text.strip().lower()
    if not raw:
        raise _bad(source, repr(text), "empty device", f"pass one of {SPEC_FORMS}")
    kind, sep, index_text = raw.partition(":")
    if kind not in (AUTO, *KINDS):
        hint = _ALIASES.get(kind, f"pass one of {SPEC_FORMS}")
        raise _bad(source, text, f"unknown device '{kind}'", hint)
    if not sep:
        return DeviceSpec(kind)
    if kind not in INDEXED:
        raise _bad(source, text, f"'{kind}' takes no index", f"pass --device {kind}")
    if not (index_text.isascii() and index_text.isdigit()):  # rejects '', '-1', '1.5', '²'
        raise _bad(
            source,
            text,
            f"device index '{index_text}' is not a non-negative integer",
            f"pass --device {kind} or {kind}:N with N = 0, 1, ...",
        )
    return DeviceSpec(kind, int(index_text))
