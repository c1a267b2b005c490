"""The on-disk <-> in-memory plan of a whole checkpoint, checked in both directions.

Given a checkpoint's tensor names (and shapes, from safetensors headers), :func:`build_mapping`
says for every in-memory tensor where its value comes from: a fused expert tensor built from
per-expert tensors (or copied, or decoded), or one on-disk tensor under the same or a renamed name,
or the tensor it is tied to. It refuses what would silently leave random weights (a partial expert
stack, a tensor no file provides) and reports every on-disk tensor that lands nowhere.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from usaf.errors import UsafError
from usaf.families.checkpoint import MXFP4, TensorInfo, load_tensors, quantized_formats, read_checkpoint
from usaf.families.convert import ExpertLayerPlan, ExpertOp, FusedTensorPlan
from usaf.families.meta import expected_tensors
from usaf.families.registry import load_model_config, resolve_family
from usaf.families.spec import DiskLayout, FamilySpec

_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")
_MAX_LISTED = 12


@dataclass(frozen=True)
class MappingPlan:
    """Where every in-memory tensor of a model comes from in one checkpoint."""

    spec: FamilySpec
    disk_layout: DiskLayout
    experts: tuple[ExpertLayerPlan, ...]  # one per MoE layer, in layer order
    renamed: Mapping[str, str]  # on-disk name -> in-memory name, every non-expert tensor (identity included)
    tied: Mapping[str, str] = field(default_factory=dict)  # in-memory name -> in-memory name it shares
    ignored: Mapping[str, str] = field(default_factory=dict)  # on-disk name -> why it is not loaded
    unmapped: tuple[str, ...] = ()  # on-disk names that land nowhere (refused unless strict=False)

    def expert_layer(self, layer: int) -> ExpertLayerPlan:
        for plan in self.experts:
            if plan.layer == layer:
                return plan
        raise KeyError(f"layer {layer} is not a MoE layer of this plan")

    @property
    def memory_names(self) -> tuple[str, ...]:
        """Every in-memory tensor that gets a value (experts, renamed and tied)."""
        names = [t for plan in self.experts for t in plan.targets]
        return (*names, *self.renamed.values(), *self.tied)

    @property
    def disk_names(self) -> tuple[str, ...]:
        """Every on-disk tensor the plan reads."""
        return (*(n for plan in self.experts for n in plan.source_names), *self.renamed)

    @property
    def memory_to_disk(self) -> dict[str, str]:
        """In-memory name -> on-disk name, for the non-expert tensors (export writes these names)."""
        return {memory: disk for disk, memory in self.renamed.items()}

    def summary(self) -> dict[str, int]:
        renamed = sum(1 for d, m in self.renamed.items() if d != m)
        return {
            "moe_layers": len(self.experts),
            "expert_tensors": sum(len(p.tensors) for p in self.experts),
            "expert_sources": sum(len(p.source_names) for p in self.experts),
            "identity": len(self.renamed) - renamed,
            "renamed": renamed,
            "tied": len(self.tied),
            "ignored": len(self.ignored),
            "unmapped": len(self.unmapped),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "family": self.spec.family,
            "model_type": self.spec.model_type,
            "disk_layout": self.disk_layout.value,
            "summary": self.summary(),
            "experts": [
                {
                    "layer": p.layer,
                    "tensors": [
                        {
                            "target": t.target,
                            "op": t.op.value,
                            "sources": list(t.source_names),
                            "how": t.describe(p.layout),
                        }
                        for t in p.tensors
                    ],
                }
                for p in self.experts
            ],
            "renamed": dict(self.renamed),
            "tied": dict(self.tied),
            "ignored": dict(self.ignored),
            "unmapped": list(self.unmapped),
        }


def _listed(items: list[str]) -> str:
    more = f" (+{len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return "; ".join(items[:_MAX_LISTED]) + more


def _per_expert_regex(spec: FamilySpec, template: str) -> re.Pattern[str]:
    # ^<layers_prefix>.(layer).<moe_module>.experts.(e).gate_proj.weight$
    body = re.escape(template).replace(re.escape("{e}"), r"(\d+)")
    return re.compile(rf"^{re.escape(spec.layers_prefix)}\.(\d+)\.{re.escape(spec.moe_module)}\.{body}$")


def _expected(spec: FamilySpec, expected: Mapping[str, Any] | Iterable[str] | None) -> dict[str, tuple | None]:
    if expected is None:
        if not spec.config:
            raise ValueError("build_mapping needs `expected` for a spec without its config")

        return dict(expected_tensors(spec.config, spec))
    if isinstance(expected, Mapping):
        return {
            k: (tuple(v.shape) if hasattr(v, "shape") else (tuple(v) if v is not None else None))
            for k, v in expected.items()
        }
    return dict.fromkeys(expected)


def canonical_disk_names(spec: FamilySpec, expected: Mapping[str, Any] | Iterable[str] | None = None) -> list[str]:
    """The names the family's own ``save_pretrained`` writes (for exporting without a source checkpoint)."""
    mem = _expected(spec, expected)
    expert_targets = {n for i in spec.moe_layers for n in spec.expert_names(i).values()}
    names = [spec.disk.to_disk(n) for n in mem if n not in expert_targets]
    if spec.tie_word_embeddings:
        names = [n for n in names if not n.endswith("lm_head.weight")]
    naming = spec.disk.per_expert
    for i in spec.moe_layers:
        if spec.disk.canonical is DiskLayout.PER_EXPERT and naming is not None:
            for template in (naming.gate, naming.up, naming.down):
                names += [
                    spec.disk.to_disk(f"{spec.moe_prefix(i)}.{template.format(e=e)}") for e in range(spec.num_experts)
                ]
        else:
            names += [spec.disk.to_disk(n) for n in spec.expert_names(i).values()]
    return names


def build_mapping(
    spec: FamilySpec,
    disk: Mapping[str, TensorInfo] | Iterable[str] | None = None,
    *,
    expected: Mapping[str, Any] | Iterable[str] | None = None,
    strict: bool = True,
) -> MappingPlan:
    """Plan how a checkpoint's tensors become the in-memory model's, and check it both ways.

    Args:
        spec: the model's family spec.
        disk: on-disk names (with :class:`TensorInfo` for shape checks); None = the family's
            canonical names (what its ``save_pretrained`` writes).
        expected: in-memory names (or name -> shape / tensor) every one of which must get a value;
            default: the ``state_dict`` of the model built from ``spec.config`` on the meta device.
        strict: refuse on-disk tensors that land nowhere (else they are listed in ``unmapped``).

    Raises:
        UsafError: quantized format usaf cannot decode, partial expert stacks, missing or
            mis-shaped tensors, and (strict) tensors that land nowhere.
    """
    mem_expected = _expected(spec, expected)
    if disk is None:
        disk = canonical_disk_names(spec, mem_expected)
    infos: dict[str, TensorInfo | None] = dict(disk) if isinstance(disk, Mapping) else dict.fromkeys(disk)
    _refuse_quantized(spec, infos)
    return _Planner(spec, infos, mem_expected).plan(strict=strict)


def _refuse_quantized(spec: FamilySpec, infos: Mapping[str, Any]) -> None:
    formats = quantized_formats(infos)
    mxfp4 = formats.pop(MXFP4, None)
    if mxfp4 and not spec.disk.accepts_mxfp4:
        formats[MXFP4] = mxfp4
    if formats:
        fmt, examples = next(iter(formats.items()))
        raise UsafError(
            f"the {spec.model_type} checkpoint is quantized as {fmt} (e.g. {examples[0]}); usaf cannot map it",
            "use the unquantized (bf16/fp16) release of the model, or dequantize it first",
        )


class _Planner:
    """One build_mapping run: collects every problem first, so one error lists them all."""

    def __init__(self, spec: FamilySpec, infos: dict[str, TensorInfo | None], expected: dict[str, Any]):
        self.spec, self.infos, self.expected = spec, infos, expected
        self.problems: list[str] = []
        self.claimed: set[str] = set()  # in-memory-side names consumed by expert plans
        self.layouts: dict[DiskLayout, list[int]] = {}
        # on-disk names seen through the family's renames ("in-memory side") -> on-disk name
        self.by_memory: dict[str, str] = {}
        for name in infos:
            memory = spec.disk.to_memory(name)
            if memory in self.by_memory:
                raise UsafError(f"checkpoint has both {self.by_memory[memory]} and {name} for {memory}", "remove one")
            self.by_memory[memory] = name
        # per-expert names present: (layer, role) -> {expert: in-memory-side name}
        self.per_expert: dict[tuple[int, str], dict[int, str]] = {}
        naming = spec.disk.per_expert
        if naming is not None:
            for role, template in (("gate", naming.gate), ("up", naming.up), ("down", naming.down)):
                regex = _per_expert_regex(spec, template)
                for memory in self.by_memory:
                    m = regex.match(memory)
                    if m and int(m[1]) in spec.moe_layers:
                        self.per_expert.setdefault((int(m[1]), role), {})[int(m[2])] = memory

    def shape_of(self, memory: str) -> tuple[int, ...] | None:
        info = self.infos.get(self.by_memory[memory])
        return info.shape if info is not None else None

    def check_shape(self, memory: str, want: tuple[int, ...]) -> None:
        got = self.shape_of(memory)
        if got is not None and tuple(got) != tuple(want):
            self.problems.append(f"{self.by_memory[memory]}: shape {list(got)}, expected {list(want)}")

    def plan(self, *, strict: bool) -> MappingPlan:
        spec = self.spec
        layers = [p for p in (self.expert_layer(i) for i in spec.moe_layers) if p is not None]
        if len(self.layouts) > 1:
            listed = ", ".join(f"{k.value} (layers {v})" for k, v in self.layouts.items())
            self.problems.append(f"experts are stored in mixed layouts: {listed}")
        renamed, ignored, unmapped = self.other_tensors()
        tied = self.tied_and_missing({t for p in layers for t in p.targets} | set(renamed.values()))
        if self.problems:
            raise UsafError(
                f"the checkpoint does not match its {spec.model_type} config: {_listed(self.problems)}",
                "the download may be incomplete or the config.json belong to another model",
            )
        if unmapped and strict:
            raise UsafError(
                f"{len(unmapped)} checkpoint tensor(s) land nowhere in the {spec.model_type} model: "
                + _listed(sorted(unmapped)),
                "the checkpoint holds tensors this config does not describe; check config.json",
            )
        disk_layout = next(iter(self.layouts)) if self.layouts else spec.disk.canonical
        return MappingPlan(spec, disk_layout, tuple(layers), renamed, tied, ignored, tuple(sorted(unmapped)))

    def expert_layer(self, i: int) -> ExpertLayerPlan | None:
        spec, names = self.spec, self.spec.expert_names(i)
        if names["gate_up"] + "_blocks" in self.by_memory:
            layout = DiskLayout.MXFP4
        elif names["gate_up"] in self.by_memory or names["down"] in self.by_memory:
            layout = DiskLayout.FUSED
        elif any((i, r) in self.per_expert for r in ("gate", "up", "down")):
            layout = DiskLayout.PER_EXPERT
        else:
            self.problems.append(f"layer {i}: no expert tensors (expected e.g. {spec.disk.to_disk(names['gate_up'])})")
            return None
        self.layouts.setdefault(layout, []).append(i)
        tensors = self.per_expert_tensors(i) if layout is DiskLayout.PER_EXPERT else self.fused_tensors(i)
        if tensors is None:
            return None
        for t in tensors:  # the spec's shapes must be the model's: a wrong E/I/H fails here, not at load
            want = self.expected.get(t.target, "absent")
            if want == "absent":
                self.problems.append(f"{t.target}: the model has no such tensor (spec and model disagree)")
            elif want is not None and tuple(want) != t.shape:
                self.problems.append(f"{t.target}: spec shape {list(t.shape)}, model shape {list(want)}")
        return ExpertLayerPlan(i, spec.layout, spec.num_experts, tuple(tensors))

    def per_expert_tensors(self, i: int) -> list[FusedTensorPlan] | None:
        spec, e_count = self.spec, self.spec.num_experts
        names, shapes = spec.expert_names(i), spec.expert_shapes()
        if spec.layout.has_bias:
            self.problems.append(f"layer {i}: per-expert checkpoints with expert biases are not supported")
            return None
        per_role_shape = {
            "gate": (spec.expert_width, spec.hidden_size),  # [I, H]
            "up": (spec.expert_width, spec.hidden_size),  # [I, H]
            "down": (spec.hidden_size, spec.expert_width),  # [H, I]
        }
        missing: dict[int, list[str]] = {}
        for role, want in per_role_shape.items():
            present = self.per_expert.get((i, role), {})
            for e in range(e_count):
                if e not in present:
                    missing.setdefault(e, []).append(role)
            extra = sorted(e for e in present if e >= e_count)
            if extra:
                self.problems.append(f"layer {i}: {role} of experts {extra} on disk, but num_experts = {e_count}")
            for e, memory in present.items():
                if e < e_count:
                    self.check_shape(memory, want)
        if missing:
            listed = ", ".join(f"{e} ({'/'.join(r)})" for e, r in sorted(missing.items()))
            self.problems.append(f"layer {i}: partial expert stack, experts missing: {listed} of {e_count}")
            return None
        gates, ups, downs = (
            tuple(self.by_memory[self.per_expert[(i, role)][e]] for e in range(e_count)) for role in per_role_shape
        )
        self.claimed.update(spec.disk.to_memory(n) for n in (*gates, *ups, *downs))
        return [
            FusedTensorPlan(names["gate_up"], "gate_up", ExpertOp.STACK_GATE_UP, (gates, ups), shapes["gate_up"]),
            FusedTensorPlan(names["down"], "down", ExpertOp.STACK_DOWN, (downs,), shapes["down"]),
        ]

    def fused_tensors(self, i: int) -> list[FusedTensorPlan]:
        spec, shapes, tensors = self.spec, self.spec.expert_shapes(), []
        for role, memory in spec.expert_names(i).items():
            blocks, scales = memory + "_blocks", memory + "_scales"
            if blocks in self.by_memory:
                # each weight may be MXFP4 or plain (a width that is no multiple of 32 cannot be MXFP4)
                if scales not in self.by_memory:
                    self.problems.append(f"layer {i}: {blocks} without {scales}")
                    continue
                sources = ((self.by_memory[blocks], self.by_memory[scales]),)
                tensors.append(FusedTensorPlan(memory, role, ExpertOp.MXFP4, sources, shapes[role]))
                self.claimed.update((blocks, scales))
            elif memory in self.by_memory:
                self.check_shape(memory, shapes[role])
                tensors.append(FusedTensorPlan(memory, role, ExpertOp.COPY, ((self.by_memory[memory],),), shapes[role]))
                self.claimed.add(memory)
            else:
                self.problems.append(f"layer {i}: {spec.disk.to_disk(memory)} missing")
        return tensors

    def other_tensors(self) -> tuple[dict[str, str], dict[str, str], list[str]]:
        """Every non-expert on-disk tensor: renamed (incl. identity), ignored with a reason, or unmapped."""
        spec = self.spec
        renamed: dict[str, str] = {}
        ignored: dict[str, str] = {}
        unmapped: list[str] = []
        for memory, name in self.by_memory.items():
            if memory in self.claimed:
                continue
            if memory in self.expected:
                if self.expected[memory] is not None:
                    self.check_shape(memory, self.expected[memory])
                renamed[name] = memory
                continue
            m = _LAYER_RE.search(memory)
            layer = int(m[1]) if m else -1
            if spec.num_layers <= layer < spec.num_layers + spec.mtp_layers:
                ignored[name] = f"MTP layer {layer} (num_nextn_predict_layers={spec.mtp_layers}); not loaded"
            elif memory.endswith("rotary_emb.inv_freq"):
                ignored[name] = "rotary inv_freq buffer; the model recomputes it"
            else:
                unmapped.append(name)
        return renamed, ignored, unmapped

    def tied_and_missing(self, targets: set[str]) -> dict[str, str]:
        """Tied tensors (lm_head -> embeddings); every other model tensor without a value is a problem."""
        tied: dict[str, str] = {}
        missing = [n for n in self.expected if n not in targets]
        embed = next((n for n in self.expected if n.endswith("embed_tokens.weight")), None)
        for n in list(missing):
            if self.spec.tie_word_embeddings and n.endswith("lm_head.weight") and embed in targets:
                tied[n] = embed
                missing.remove(n)
        if missing:
            self.problems.append(f"no on-disk tensor for {len(missing)} model tensor(s): {', '.join(missing[:8])}")
        return tied


def map_checkpoint(model_dir: Path, spec: FamilySpec | None = None, *, strict: bool = True) -> MappingPlan:
    """Read ``model_dir``'s config and safetensors headers and build its mapping plan."""
    spec = spec or resolve_family(load_model_config(model_dir))
    return build_mapping(spec, read_checkpoint(model_dir), strict=strict)


def load_expert_layer(model_dir: Path, plan: ExpertLayerPlan, infos: Mapping[str, TensorInfo] | None = None, **kw):
    """Read one MoE layer's on-disk expert tensors and fuse them: in-memory name -> tensor."""
    return plan.fuse(load_tensors(model_dir, plan.source_names, infos), **kw)
