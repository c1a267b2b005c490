"""Where every tensor of an exported checkpoint comes from, one unit at a time.

A :class:`Unit` is what is produced together: one non-expert tensor (copied, or a router replaced by
its trained value), or one MoE layer's experts (fused into transformers' in-memory layout, the
change's deltas added in the stored ``(E, O, I)`` orientation, split back into the family's on-disk
tensors by the same :class:`~usaf.families.ExpertLayerPlan` that quantize used to fuse them). Units
only load what they need, so the writer holds at most one shard plus one layer.

Two sources:

- :class:`OriginalSource` (``--base``): the original checkpoint's own tensors, names and dtypes.
  Untrained tensors are copied byte for byte; trained layers get ``original + delta``.
- :class:`QuantizedSource` (no ``--base``): the quantized model's stored non-expert weights (already
  the original's bytes) and its experts dequantized, plus the deltas, under the family's canonical
  on-disk names (what its ``save_pretrained`` writes).

Either way the sum is formed in fp32 and rounded once to the output dtype. Nothing is re-quantized.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from usaf.artifacts.quantized import EXPERTS_FILE, read_base_index
from usaf.artifacts.run import TrainedChange
from usaf.artifacts.safety import load_torch
from usaf.families import ExpertLayerPlan, ExpertOp, FamilySpec, MappingPlan, TensorInfo, build_mapping, load_tensors
from usaf.families.checkpoint import read_header
from usaf.quant import QuantizedTensor, dequantize

if TYPE_CHECKING:
    from usaf.stages.export_base import ExpertDigests

# safetensors dtype code -> bytes per element (for sizing shards before anything is loaded)
_ITEMSIZE = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip
_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
_FLOAT_CODES = {"F64", "F32", "F16", "BF16"}  # what --dtype casts (fp8 and integer tensors keep their type)


@dataclass(frozen=True)
class Unit:
    """Output tensors produced together."""

    order: tuple[int, str]  # (layer or -1, name): shards follow the model's layer order
    kind: Literal["copy", "router", "delta", "experts"]  # delta: a linear target (attention, shared) + its delta
    names: tuple[str, ...]  # output (on-disk) names
    nbytes: int  # bytes they will take in the output
    layer: int | None = None  # experts units, and copies of an untrained MoE layer's experts: the layer
    source: str | None = None  # router/delta units: the source tensor's name (on disk or in the base shards)


@dataclass
class Counts:
    expert_tensors_changed: int = 0
    expert_entries: int = 0
    router_tensors: int = 0
    tensors_copied: int = 0
    notes: list[str] = field(default_factory=list)
    entries_rounded_away: int = 0  # delta entries whose written weight is the written base's: the change rounded off
    trained_l1: float = 0.0  # sum |delta| over every entry, as trained
    written_l1_error: float = 0.0  # sum |(written weight - written base) - delta|: what the output dtype did to it
    router_weights_changed: int = 0  # router weights the training moved (fp32 master against the original)
    router_weights_rounded_away: int = 0  # of those, written as the original's value in the output dtype


def rounded_change(before: torch.Tensor, after: torch.Tensor, values: torch.Tensor) -> tuple[int, float, float]:
    """What rounding to the output dtype left of a delta: ``(entries rounded away, sum |delta|, sum |written change -
    delta|)``. ``before``/``after``: ``(m,)`` the base and the merged weight at the delta's entries, both already in
    the output dtype; ``values``: ``(m,)`` the deltas as trained.

    The trained weight is base + delta in fp32; written in bf16 (8 mantissa bits) a delta under half the weight's
    step there vanishes, and the export said "N delta entries applied" and verified, as the logits' check is blind
    at that size (found in review: 2-3 % of the demo's entries, 75 % of a run at a 100x smaller lr)."""
    change = after.float() - before.float()
    gone = int(((change == 0) & (values != 0)).sum())
    return gone, float(values.abs().sum()), float((change - values.float()).abs().sum())


def _stored(memory: torch.Tensor, transposed: bool) -> torch.Tensor:
    """A fused expert tensor in the deltas' (E, O, I) orientation: a view of the memory layout."""
    return memory.transpose(1, 2) if transposed else memory


def _at(stored: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Coordinates of flat ``indices`` (m,) into ``stored`` (E, O, I), for reading a view without copying it whole."""
    return torch.unravel_index(indices.to(torch.int64), tuple(stored.shape))


def merge_delta(
    memory: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, *, transposed: bool, owned: bool = False
) -> torch.Tensor:
    """``memory + delta`` in fp32, in the memory layout.

    Args:
        memory: ``(E, O, I)``, or ``(E, I, O)`` if ``transposed`` (gpt-oss), any float dtype.
        indices: ``(m,)`` sorted unique flat indices into the stored ``(E, O, I)`` orientation.
        values: ``(m,)`` fp32 deltas.
        transposed: the memory layout is the stored one transposed.
        owned: ``memory`` may be modified (then an fp32 tensor whose stored view is contiguous is
            updated in place instead of copied: one layer's experts in memory, not two).
    """
    stored = memory.transpose(1, 2) if transposed else memory  # (E, O, I) view: the deltas' orientation
    if owned and stored.dtype == torch.float32 and stored.is_contiguous():
        merged = stored
    else:
        merged = torch.empty(stored.shape, dtype=torch.float32).copy_(stored)  # (E, O, I) fp32, contiguous
    merged.view(-1).index_add_(0, indices.to(torch.int64), values.to(torch.float32))
    return merged.transpose(1, 2) if transposed else merged  # a view back in the memory layout


def least_precise(dtypes) -> torch.dtype:
    """Of float dtypes, the one with the fewest mantissa bits (what bounds an export's rounding)."""
    order = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    found = [d for d in order if d in set(dtypes)]
    return found[0] if found else torch.float32


class ExportSource(ABC):
    """What both sources share: the units to write, dtype policy, routers, delta bookkeeping."""

    def __init__(self, spec: FamilySpec, change: TrainedChange, dtype: torch.dtype | None) -> None:
        self.spec = spec
        self.change = change
        self.dtype = dtype  # --dtype for floating tensors; None keeps each tensor's own
        self.counts = Counts()
        self.units: list[Unit] = []
        self.expert_dtype: torch.dtype = torch.float32  # the least precise dtype expert tensors are written in
        self.written: dict[str, torch.dtype] = {}  # in-memory name -> dtype, for every changed tensor written

    def out_code(self, code: str) -> str:
        return _CODES[self.dtype] if self.dtype is not None and code in _FLOAT_CODES else code

    def out_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype

    def nbytes(self, code: str, shape: tuple[int, ...]) -> int:
        n = 1
        for d in shape:
            n *= d
        return n * _ITEMSIZE.get(self.out_code(code), 4)

    def cast(self, t: torch.Tensor) -> torch.Tensor:
        """Cast to the output dtype; a tensor that keeps its dtype is written as it was (counted as copied)."""
        out = t.to(self.out_dtype(t.dtype)).contiguous()
        if out.dtype == t.dtype:
            self.counts.tensors_copied += 1
        return out

    def router(self, memory_name: str, original: torch.Tensor) -> torch.Tensor:
        """The trained router weight (fp32 master) in the original tensor's dtype (or --dtype)."""
        trained = self.change.routers[memory_name]
        if tuple(trained.shape) != tuple(original.shape):
            raise ValueError(f"{memory_name}: trained router {tuple(trained.shape)}, model {tuple(original.shape)}")
        self.counts.router_tensors += 1
        self.written[memory_name] = self.out_dtype(original.dtype)
        out = trained.to(self.written[memory_name]).contiguous()
        moved = trained.float() != original.float()  # (E, H) the trained weights
        self.counts.router_weights_changed += int(moved.sum())
        self.counts.router_weights_rounded_away += int((moved & (out == original.to(out.dtype))).sum())
        return out

    def kind_of(self, memory_name: str | None) -> str:
        """A non-expert tensor's unit kind: a trained router, a linear target with a delta, or a copy."""
        if memory_name in self.change.routers:
            return "router"
        return "delta" if memory_name in self.change.deltas else "copy"

    def linear_delta(self, memory_name: str, original: torch.Tensor) -> torch.Tensor:
        """A linear target's weight ``(O, I)`` + its delta, summed in fp32 and rounded once to the output dtype."""
        indices, values = self.change.deltas[memory_name]
        out_dtype = self.out_dtype(original.dtype)
        at = _at(original[None], indices)
        before = original[None][at].to(out_dtype)  # (m,)
        merged = merge_delta(original[None], indices, values, transposed=False)[0]  # (O, I) fp32: (1, O, I) stored
        self.counts.expert_tensors_changed += 1
        self.counts.expert_entries += int(indices.numel())
        self.written[memory_name] = out_dtype
        out = merged.to(out_dtype).contiguous()
        self._account(before, out[None][at], values)
        return out

    def _account(self, before: torch.Tensor, after: torch.Tensor, values: torch.Tensor) -> None:
        gone, trained, error = rounded_change(before, after, values)
        self.counts.entries_rounded_away += gone
        self.counts.trained_l1 += trained
        self.counts.written_l1_error += error

    def rounding_note(self) -> str | None:
        """What the output dtype did to the change, where it rounded any delta entry or trained router weight away."""
        c = self.counts
        if not c.entries_rounded_away and not c.router_weights_rounded_away:
            return None
        # in float32 already, "--dtype float32 writes it whole" was false: such deltas are below fp32's own step
        way = ("below float32's own step at those weights: the change is too small to hold" if
               all(dtype == torch.float32 for dtype in self.written.values()) else "--dtype float32 writes it whole")
        # counted apart: the note said delta entries alone (review)
        routers = (f"{c.router_weights_rounded_away:,} of the {c.router_weights_changed:,} trained router weights"
                   if c.router_weights_rounded_away else "")
        if not c.entries_rounded_away:
            return f"{routers} round away in the output dtype (a change under half the weight's step there); {way}"
        share = c.entries_rounded_away / max(c.expert_entries, 1)
        shown = f"{share:.1%}" if share >= 0.001 else "under 0.1%"  # 42 of 196,602 were "0.0%" (found in review)
        error = c.written_l1_error / c.trained_l1 if c.trained_l1 else 0.0
        return (f"{c.entries_rounded_away:,} of the {c.expert_entries:,} delta entries ({shown}) round away in the "
                f"output dtype (a delta under half its weight's step there){'; so do ' + routers if routers else ''}, "
                f"and the written change differs from the trained one by {error:.1%} (L1); {way}")  # fmt: skip

    def merge_layer(
        self,
        plan: ExpertLayerPlan,
        memory: dict[str, torch.Tensor],
        dtypes: dict[str, torch.dtype],
    ) -> dict[str, torch.Tensor]:
        """Add the deltas to one layer's fused tensors, round once to the output dtype, split to disk names.

        Args:
            plan: the layer's fused <-> on-disk plan.
            memory: in-memory name -> fused tensor in the memory layout, loaded or made for this call (so
                an fp32 one may take the deltas in place); replaced in this dict.
            dtypes: in-memory name -> the dtype the tensor has in the original (before --dtype).
        """
        for t in plan.tensors:
            w = memory[t.target]
            out_dtype = self.out_dtype(dtypes[t.target])
            if t.target in self.change.deltas:  # only fused weights (gate_up, down) have deltas
                indices, values = self.change.deltas[t.target]
                transposed = plan.layout.transposed
                at = _at(_stored(w, transposed), indices)
                before = _stored(w, transposed)[at].to(out_dtype)  # (m,), read before an fp32 w takes them in place
                merged = merge_delta(w, indices, values, transposed=transposed, owned=True)
                memory[t.target] = merged.to(out_dtype).contiguous()
                self._account(before, _stored(memory[t.target], transposed)[at], values)
                self.counts.expert_tensors_changed += 1
                self.counts.expert_entries += int(indices.numel())
                self.written[t.target] = out_dtype
            else:
                memory[t.target] = w.to(out_dtype).contiguous()
        return plan.split(memory)

    @abstractmethod
    def produce(self, unit: Unit) -> dict[str, torch.Tensor]:
        """The unit's output tensors: output name -> contiguous tensor owning its storage."""


class OriginalSource(ExportSource):
    """``--base``: the original checkpoint, with the trained layers' experts and routers replaced."""

    def __init__(
        self,
        base_dir: Path,
        spec: FamilySpec,
        change: TrainedChange,
        dtype: torch.dtype | None,
        infos: dict[str, TensorInfo],
        plan: MappingPlan,
        experts: ExpertDigests,
    ) -> None:
        super().__init__(spec, change, dtype)
        self.dir = Path(base_dir)
        self.infos = infos  # on-disk name -> header info
        self.plan = plan  # the original's on-disk <-> in-memory mapping
        self.experts = experts  # each layer's experts checked as read: the ones quantized, or refused
        if (note := experts.note([layer.layer for layer in plan.experts])) is not None:
            self.counts.notes.append(note)
        expert_sources = set(self.plan.disk_names) - set(self.plan.renamed)
        memory_of = dict(self.plan.renamed)  # on-disk -> in-memory, non-expert tensors
        trained = set(change.deltas)
        decoded = False
        for name, info in infos.items():
            if name in expert_sources:
                continue
            memory = memory_of.get(name)
            kind = self.kind_of(memory)
            self.units.append(Unit(_order(name), kind, (name,), self.nbytes(info.dtype, info.shape), source=memory))
        for layer in self.plan.experts:
            mxfp4 = any(t.op is ExpertOp.MXFP4 for t in layer.tensors)
            decoded |= mxfp4
            if mxfp4 or trained & set(layer.targets):
                names, size = self._split_sizes(layer)
                self.units.append(Unit(_order(names[0]), "experts", names, size, layer=layer.layer))
            else:  # untrained layer: its on-disk tensors as they are
                names = layer.source_names
                size = sum(self.nbytes(infos[n].dtype, infos[n].shape) for n in names)
                self.units.append(Unit(_order(names[0]), "copy", names, size, layer=layer.layer))
        expert_dtypes = [torch.bfloat16] if decoded else []  # MXFP4 decodes to bf16
        for layer in self.plan.experts:
            for t in layer.tensors:
                if t.role in ("gate_up", "down") and t.op is not ExpertOp.MXFP4:
                    expert_dtypes += [_DTYPES.get(infos[n].dtype) for n in t.source_names]
        self.expert_dtype = self.dtype or least_precise(expert_dtypes)
        if decoded:
            self.counts.notes.append(
                "the original's MXFP4 experts are written decoded (bf16): trained layers cannot be re-encoded "
                "without re-quantizing, and one checkpoint cannot mix MXFP4 and dense experts"
            )

    def _split_sizes(self, layer: ExpertLayerPlan) -> tuple[tuple[str, ...], int]:
        names, size = [], 0
        for t in layer.tensors:
            if t.op is ExpertOp.MXFP4:  # decoded to bf16 in the memory shape
                names.append(t.target)
                size += self.nbytes("BF16", t.shape)
            else:
                for n in t.source_names:
                    names.append(n)
                    size += self.nbytes(self.infos[n].dtype, self.infos[n].shape)
        return tuple(names), size

    def produce(self, unit: Unit) -> dict[str, torch.Tensor]:
        if unit.kind == "experts":
            layer = self.plan.expert_layer(unit.layer)
            on_disk = load_tensors(self.dir, layer.source_names, self.infos)
            self.experts.check(layer.layer, on_disk)
            memory = layer.fuse(on_disk)  # in-memory fused tensors
            del on_disk
            return self.merge_layer(layer, memory, {n: w.dtype for n, w in memory.items()})
        tensors = load_tensors(self.dir, unit.names, self.infos)
        if unit.layer is not None:  # an untrained layer's experts, copied as they are
            self.experts.check(unit.layer, tensors)
        if unit.kind == "router":
            (name,) = unit.names
            return {name: self.router(unit.source, tensors[name])}
        if unit.kind == "delta":
            (name,) = unit.names
            return {name: self.linear_delta(unit.source, tensors[name])}
        return {n: self.cast(t) for n, t in tensors.items()}


class QuantizedSource(ExportSource):
    """No ``--base``: the quantized model's stored weights and dequantized experts, canonical on-disk names."""

    def __init__(self, model_dir: Path, spec: FamilySpec, change: TrainedChange, dtype: torch.dtype | None) -> None:
        super().__init__(spec, change, dtype)
        self.dir = Path(model_dir)
        self.plan = build_mapping(spec, None)  # the family's canonical on-disk names (its save_pretrained's)
        weight_map = read_base_index(self.dir)
        self.base_infos: dict[str, TensorInfo] = {}
        for file in sorted(set(weight_map.values())):
            self.base_infos.update(read_header(self.dir / file))
        self.experts = load_torch(self.dir / EXPERTS_FILE, mmap=True, what="experts file")  # codes stay on disk
        in_layers = {t.target for layer in self.plan.experts for t in layer.tensors}
        for memory, info in self.base_infos.items():
            if memory in in_layers:
                continue  # expert biases (gpt-oss) go with their layer
            disk = spec.disk.to_disk(memory)
            kind = self.kind_of(memory)
            self.units.append(Unit(_order(disk), kind, (disk,), self.nbytes(info.dtype, info.shape), source=memory))
        dtypes = set()
        for layer in self.plan.experts:
            names, size = [], 0
            for t in layer.tensors:
                if t.role in ("gate_up", "down"):
                    q = self.experts[t.target]
                    dtypes.add(q["source_dtype"])
                    code = _CODES.get(getattr(torch, q["source_dtype"]), "F32")
                else:
                    code = self.base_infos[t.target].dtype
                for n in t.source_names:
                    names.append(n)
                size += self.nbytes(code, t.shape)
            self.units.append(Unit(_order(names[0]), "experts", tuple(names), size, layer=layer.layer))
        self.expert_dtype = self.dtype or least_precise(getattr(torch, d) for d in dtypes)

    def produce(self, unit: Unit) -> dict[str, torch.Tensor]:
        if unit.kind == "experts":
            layer = self.plan.expert_layer(unit.layer)
            memory, dtypes = {}, {}
            for t in layer.tensors:
                if t.role in ("gate_up", "down"):
                    q = QuantizedTensor.from_dict(self.experts[t.target], name=t.target)
                    stored = dequantize(q, dtype=torch.float32, memory_layout=False)  # (E, O, I) fp32
                    memory[t.target] = stored.transpose(1, 2) if q.transposed else stored  # the memory layout
                    dtypes[t.target] = getattr(torch, q.source_dtype)  # the original's: rounded to it once, later
                else:
                    memory[t.target] = self._base(t.target)
                    dtypes[t.target] = memory[t.target].dtype
            return self.merge_layer(layer, memory, dtypes)
        (name,) = unit.names
        memory = unit.source  # the in-memory name it is stored under in the base shards
        tensor = self._base(memory)
        if unit.kind == "router":
            return {name: self.router(memory, tensor)}
        if unit.kind == "delta":
            return {name: self.linear_delta(memory, tensor)}
        return {name: self.cast(tensor)}

    def _base(self, memory: str) -> torch.Tensor:
        return load_tensors(self.dir, [memory], self.base_infos)[memory]


def _order(name: str) -> tuple[int, str]:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1]), name
    return -1, name
