"""The only place that knows devices: cpu, cuda (also ROCm), mps and directml.

Stages are handed a :class:`Backend` (never a global) and branch on its :class:`Capabilities`
and :class:`DTypePolicy`, not on its name::

    backend = resolve_backend("auto")          # or "cpu", "cuda:1", "mps", "directml"
    x = x.to(backend.device, backend.policy.compute)
    with backend.autocast():
        loss = model(x)

``resolve_backend`` also honours the original tool's ``USE_CUDA``/``USE_AMP`` (below any explicit
device) and warns about ``USE_MULTI_GPU``; ``probe_backends`` reports every backend, available or
not, for ``usaf doctor``. Importing this package imports torch; ``torch_directml`` is imported only
when DirectML is asked for or probed.
"""

from usaf.backends.base import Backend, DeviceInfo, MemoryStats, Note, Probe, host_memory
from usaf.backends.capabilities import Capabilities, DTypePolicy, dtype_name, dtype_policy
from usaf.backends.legacy import LegacySettings, explain_env, read_legacy_env
from usaf.backends.resolve import probe, probe_backends, resolve_backend
from usaf.backends.spec import AUTO_ORDER, KINDS, SPEC_FORMS, DeviceSpec, parse_device_spec

__all__ = [
    "AUTO_ORDER",
    "KINDS",
    "SPEC_FORMS",
    "Backend",
    "Capabilities",
    "DTypePolicy",
    "DeviceInfo",
    "DeviceSpec",
    "LegacySettings",
    "MemoryStats",
    "Note",
    "Probe",
    "dtype_name",
    "dtype_policy",
    "explain_env",
    "host_memory",
    "parse_device_spec",
    "probe",
    "probe_backends",
    "read_legacy_env",
    "resolve_backend",
]
