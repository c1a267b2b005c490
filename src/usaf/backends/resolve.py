"""Choosing the backend: the device spec, the legacy variables, and what is present on this machine."""

from __future__ import annotations

import os
from collections.abc import Mapping

from usaf.backends import cpu, cuda, directml, mps
from usaf.backends.base import Backend, Note, Probe
from usaf.backends.legacy import USE_AMP, USE_CUDA, read_legacy_env
from usaf.backends.spec import AUTO, AUTO_ORDER, CPU, CUDA, DIRECTML, MPS, DeviceSpec, parse_device_spec
from usaf.errors import UsafError

_CREATE = {CPU: cpu.create, CUDA: cuda.create, MPS: mps.create, DIRECTML: directml.create}


def probe(kind: str, env: Mapping[str, str] | None = None) -> Probe:
    """Probe one backend (importing ``torch_directml`` only for ``directml``)."""
    env = os.environ if env is None else env
    if kind == CUDA:
        return cuda.probe(env)
    if kind == MPS:
        return mps.probe()
    if kind == DIRECTML:
        return directml.probe()
    if kind == CPU:
        return cpu.probe()
    raise ValueError(f"unknown backend {kind!r}")


def probe_backends(env: Mapping[str, str] | None = None) -> list[Probe]:
    """Every backend, available or not (with the reason and fix), in ``--device auto`` order."""
    return [probe(kind, env) for kind in AUTO_ORDER]


def _unavailable(origin: str, p: Probe, env: Mapping[str, str]) -> UsafError:
    available = [other for other in probe_backends(env) if other.available]  # in auto order; cpu is last
    found = ", ".join(f"{a.name} ({', '.join(d.name for d in a.devices)})" for a in available)
    hint = f"{p.fix}; or " if p.fix else ""
    hint += f"pass --device auto (here: {available[0].name}) or one of the devices found"
    if origin.startswith(USE_CUDA):
        hint = f"unset {USE_CUDA}, or " + hint
    message = f"{origin}: {p.label} is not available here: {p.reason}; found instead: {found}"
    return UsafError(message, hint)


def _no_such_index(origin: str, p: Probe, index: int) -> UsafError:
    listing = ", ".join(f"{d.device} {d.name}" for d in p.devices)
    hint = f"pass an index from 0 to {len(p.devices) - 1}, or --device {p.name} for the first one"
    if p.name == CUDA:
        hint += " (CUDA_VISIBLE_DEVICES renumbers the GPUs it lists from 0)"
    message = f"{origin}: there is no device {p.name}:{index} (found {len(p.devices)}: {listing})"
    return UsafError(message, hint)


def _precision_notes(backend: Backend, amp: bool | None, source: str) -> list[Note]:
    if amp is True and not backend.policy.mixed:
        message = f"{source} asks for mixed precision, but {backend.label} has no bf16 or fp16: using fp32"
        return [Note("warning", message)]
    if amp is False and backend.capabilities.prefers_half:
        return [Note("info", f"{source}: mixed precision off, computing in fp32 on {backend.label}")]
    if amp is True and not backend.capabilities.prefers_half:  # a CPU run in bf16 was not said (USE_AMP=1 left set)
        half = str(backend.policy.compute).removeprefix("torch.")
        return [Note("info", f"{source}: mixed precision on, so --dtype auto computes in {half} on {backend.label} "
                             "(fp32 without it)")]  # fmt: skip
    return []


def resolve_backend(
    spec: str | None = None,
    *,
    source: str = "--device",
    env: Mapping[str, str] | None = None,
    amp: bool | None = None,
    default: str = AUTO,
) -> Backend:
    """Turn a device spec into a ready :class:`Backend`.

    Precedence: an explicit ``spec`` (the caller resolves ``--device`` > ``USAF_DEVICE`` >
    ``--config``) wins over legacy ``USE_CUDA`` (1: cuda, 0: auto without CUDA), which wins over
    ``auto`` (cuda -> directml -> mps -> cpu). ``amp`` wins over legacy ``USE_AMP``.

    Args:
        spec: ``auto|cpu|cuda|cuda:N|mps|directml|directml:N``; ``None`` or ``""``: not set.
        source: where ``spec`` came from (``--device``, ``USAF_DEVICE``, a ``--config`` key), as errors name it.
        env: environment for the legacy variables and device visibility (``os.environ`` by default).
        amp: force mixed precision on/off; ``None``: ``USE_AMP`` if set, else the backend's default.
        default: the device where neither ``spec`` nor ``USE_CUDA=1`` names one (``usaf export`` verifies on
            ``cpu``: passed as ``spec``, a ``USE_CUDA`` was said to be overridden by a device "set explicitly").

    Returns:
        The backend; its ``notes`` hold remarks for the user (ignored or unsupported variables).

    Raises:
        UsafError: for a malformed spec or legacy value, or a device not present here; the message
            names ``--device``, what was found instead, and the fix.
    """
    env = os.environ if env is None else env
    legacy = read_legacy_env(env)
    notes = list(legacy.notes)
    explicit = spec.strip() if spec else ""  # "" is "not set", as resolve_config treats it
    if explicit:
        parsed, origin = parse_device_spec(explicit, source=source), f"{source} {explicit}"
        if legacy.use_cuda is not None:
            ignored = f"{USE_CUDA}={env[USE_CUDA]!r} ignored: the device is set explicitly ({parsed})"
            notes.append(Note("info", ignored))
    elif legacy.use_cuda:
        parsed, origin = DeviceSpec(CUDA), f"{USE_CUDA}={env[USE_CUDA]!r} (legacy for --device cuda)"
    elif default != AUTO and not legacy.use_cuda:
        parsed, origin = parse_device_spec(default, source=source), f"{source} {default} (the default)"
    else:
        parsed, origin = DeviceSpec(AUTO), "--device auto"

    amp_source = "the amp setting"
    if amp is None and legacy.amp is not None:
        amp, amp_source = legacy.amp, f"{USE_AMP}={env[USE_AMP]!r}"

    if parsed.kind == AUTO:
        skip_cuda = legacy.use_cuda is False and not explicit
        kind = next(k for k in AUTO_ORDER if not (skip_cuda and k == CUDA) and probe(k, env).available)
        index = None
    else:
        found = probe(parsed.kind, env)
        if not found.available:
            raise _unavailable(origin, found, env)
        if parsed.index is not None and parsed.index >= len(found.devices):
            raise _no_such_index(origin, found, parsed.index)
        kind, index = parsed.kind, parsed.index

    backend = _CREATE[kind](index, amp=amp, notes=())
    backend.notes = (*notes, *backend.notes, *_precision_notes(backend, amp, amp_source))
    return backend
