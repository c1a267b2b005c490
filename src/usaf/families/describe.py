"""What a model directory holds, from ``config.json`` and safetensors headers only (no weights read).

Parameter counts are split by role so a user sees at once how much of a model usaf will quantize
(experts) and how much stays in full precision (everything else).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from usaf.errors import UsafError
from usaf.families.checkpoint import TensorInfo, checkpoint_files, quantized_formats, read_checkpoint
from usaf.families.mapping import build_mapping
from usaf.families.meta import unique_numels
from usaf.families.registry import load_model_config, resolve_family
from usaf.families.spec import FamilySpec
from usaf.units import human_bytes

ROLES = ("experts", "routers", "shared experts", "attention", "embeddings", "norms", "dense MLP", "other")
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "float8_e4m3fn": 1}
_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "F8_E4M3": "float8_e4m3fn",
              "F8_E5M2": "float8_e5m2", "U8": "uint8", "I8": "int8", "I32": "int32", "I64": "int64", "BOOL": "bool",
              "F8_E8M0": "float8_e8m0fnu"}  # fmt: skip


@dataclass(frozen=True)
class RoleCount:
    role: str
    params: int
    bytes: int


@dataclass(frozen=True)
class ModelDescription:
    """A model directory at a glance; ``rows()`` for a two-column table, ``to_dict()`` for JSON."""

    model_dir: str
    spec: FamilySpec = field(repr=False)
    disk_layout: str | None  # "per_expert" | "fused" | "mxfp4" | None (no weight files)
    quantized: str | None  # quantized checkpoint format recognised by name, if any
    dtypes: tuple[str, ...]
    counts: tuple[RoleCount, ...]  # one per role in ROLES order (roles with nothing are kept, as 0)
    counts_source: str  # where the counts come from, in words
    files: int  # safetensors files read
    not_loaded: RoleCount | None = None  # on-disk tensors transformers does not load (e.g. DeepSeek MTP)
    problem: str | None = None  # why the checkpoint would not map, if it would not

    @property
    def total_params(self) -> int:
        return sum(c.params for c in self.counts)

    @property
    def total_bytes(self) -> int:
        return sum(c.bytes for c in self.counts)

    def count(self, role: str) -> RoleCount:
        return next(c for c in self.counts if c.role == role)

    def rows(self) -> list[tuple[str, str]]:
        s = self.spec
        rows = [
            ("model", self.model_dir),
            ("family", f"{s.family} (model_type {s.model_type}; {', '.join(s.architectures) or 'no architectures'})"),
            ("layers", f"{s.num_layers} total; MoE: {_ranges(s.moe_layers)}; dense: {_ranges(s.dense_layers) or '-'}"),
            ("experts", f"{s.num_experts} per MoE layer, top-{s.top_k}"),
            ("widths", f"expert I={s.expert_width}, hidden H={s.hidden_size}"
             + (f", dense MLP {s.dense_width}" if s.dense_width else "")),
            ("router", f"{s.moe_module}.{s.router.module}: {s.router.describe()}"),
            ("shared experts", f"{s.moe_module}.{s.shared.module} (width {s.shared.width})" if s.shared else "none"),
            ("in memory", _memory_layout(s)),
            ("on disk", (self.disk_layout or "no weight files") + (f", {self.quantized}" if self.quantized else "")),
            ("dtypes", ", ".join(self.dtypes) or "unknown"),
        ]  # fmt: skip
        for c in self.counts:
            rows.append((f"params: {c.role}", f"{c.params:,} ({human_bytes(c.bytes)})"))
        rows.append(("params: total", f"{self.total_params:,} ({human_bytes(self.total_bytes)})"))
        if self.not_loaded:
            rows.append(("not loaded", f"{self.not_loaded.params:,} ({human_bytes(self.not_loaded.bytes)})"))
        rows.append(("counts from", self.counts_source))
        if self.problem:
            rows.append(("problem", self.problem))
        return rows

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["spec"] = self.spec.to_dict()
        out["counts"] = {c.role: {"params": c.params, "bytes": c.bytes} for c in self.counts}
        out["total_params"], out["total_bytes"] = self.total_params, self.total_bytes
        return out


def _ranges(layers: tuple[int, ...]) -> str:
    parts, start = [], None
    for i, n in enumerate(layers):
        if start is None:
            start = n
        if i + 1 == len(layers) or layers[i + 1] != n + 1:
            parts.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ",".join(parts)


def _memory_layout(s: FamilySpec) -> str:
    e, i, h = "E", "I", "H"
    gu = f"[{e},{h},2{i}]" if s.layout.transposed else f"[{e},2{i},{h}]"
    dn = f"[{e},{i},{h}]" if s.layout.transposed else f"[{e},{h},{i}]"
    order = "gate/up interleaved" if s.layout.interleaved else "gate then up"
    return f"gate_up_proj {gu} ({order}), down_proj {dn}" + (", with biases" if s.layout.has_bias else "")


def tensor_role(spec: FamilySpec, memory_name: str) -> str:
    """The role (one of ROLES) of an in-memory tensor name (per-expert on-disk names work too)."""
    parts = memory_name.split(".")
    layer = None
    if "layers" in parts:
        idx = parts.index("layers")
        if idx + 1 < len(parts) and parts[idx + 1].isdigit():
            layer = int(parts[idx + 1])
    if layer is not None and layer in spec.moe_layers:
        if memory_name.startswith(spec.experts_prefix(layer) + "."):
            return "experts"
        if memory_name.startswith(spec.router_prefix(layer) + "."):
            return "routers"
        if any(memory_name.startswith(p + ".") for p in spec.shared_prefixes(layer)):
            return "shared experts"
    if "embed_tokens" in memory_name or memory_name.startswith("lm_head.") or ".lm_head." in memory_name:
        return "embeddings"
    if len(parts) >= 2 and "norm" in parts[-2]:
        return "norms"
    if any(p in parts for p in ("self_attn", "attention", "attn", "linear_attn", "mamba", "mixer")):  # token mixing
        return "attention"
    if layer is not None and layer in spec.dense_layers and spec.moe_module in parts:
        return "dense MLP"
    return "other"


def _params_of(info: TensorInfo) -> int:
    if info.name.endswith("_blocks") and info.dtype == "U8":
        return info.numel * 2  # MXFP4: two 4-bit values per byte
    if info.name.endswith(("_scales", "weight_scale_inv")):
        return 0  # quantization scales are not parameters (their bytes still count)
    return info.numel


def describe_model(model_dir: Path) -> ModelDescription:
    """Describe a model directory from ``config.json`` and safetensors headers; no weights are read."""
    model_dir = Path(model_dir)
    config = load_model_config(model_dir)
    spec = resolve_family(config)
    infos = read_checkpoint(model_dir, required=False)
    params = dict.fromkeys(ROLES, 0)
    nbytes = dict.fromkeys(ROLES, 0)
    if not infos:
        return _from_config(model_dir, spec, config, params, nbytes)

    problem, ignored, layout = None, {}, None
    try:
        plan = build_mapping(spec, infos, strict=False)
        ignored = set(plan.ignored) | set(plan.unmapped)
        layout = plan.disk_layout.value
        if plan.unmapped:
            problem = f"{len(plan.unmapped)} tensor(s) land nowhere, e.g. {plan.unmapped[0]}"
    except UsafError as e:
        problem = str(e)
        ignored = {n for n in infos if n.startswith(f"{spec.layers_prefix}.") and _layer_of(n) >= spec.num_layers}
    skipped = RoleCount("not loaded", 0, 0)
    for name, info in infos.items():
        if name in ignored:
            skipped = RoleCount("not loaded", skipped.params + _params_of(info), skipped.bytes + info.nbytes)
            continue
        role = tensor_role(spec, spec.disk.to_memory(name))
        params[role] += _params_of(info)
        nbytes[role] += info.nbytes
    quant = quantized_formats(infos)
    return ModelDescription(
        model_dir=str(model_dir),
        spec=spec,
        disk_layout=layout,
        quantized=", ".join(quant) or None,
        dtypes=tuple(sorted({_ST_DTYPES.get(i.dtype, i.dtype) for i in infos.values()})),
        counts=tuple(RoleCount(r, params[r], nbytes[r]) for r in ROLES),
        counts_source=f"safetensors headers ({len(checkpoint_files(model_dir))} file(s))",
        files=len(checkpoint_files(model_dir)),
        not_loaded=skipped if skipped.params or skipped.bytes else None,
        problem=problem,
    )


def _layer_of(name: str) -> int:
    parts = name.split(".")
    idx = parts.index("layers") if "layers" in parts else -1
    return int(parts[idx + 1]) if 0 <= idx < len(parts) - 1 and parts[idx + 1].isdigit() else -1


def _from_config(model_dir: Path, spec: FamilySpec, config: dict, params: dict, nbytes: dict) -> ModelDescription:
    """Counts of the model built from config.json on the meta device (exact numel; bytes at the config dtype)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    dtype = str(
        text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    )
    size = _DTYPE_BYTES.get(dtype.replace("torch.", ""), 2)
    try:
        numels = unique_numels(config)
        source = f"computed from config.json (model built on the meta device; bytes at {dtype}); no weight files"
    except Exception as e:  # transformers cannot build it: describe what the config says, without counts
        numels, source = {}, f"unavailable: no weight files, and the model could not be built ({type(e).__name__})"
    for name, n in numels.items():
        role = tensor_role(spec, name)
        params[role] += n
        nbytes[role] += n * size
    return ModelDescription(
        model_dir=str(model_dir),
        spec=spec,
        disk_layout=None,
        quantized=None,
        dtypes=(dtype,),
        counts=tuple(RoleCount(r, params[r], nbytes[r]) for r in ROLES),
        counts_source=source,
        files=0,
    )
