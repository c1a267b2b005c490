"""``usaf export --base``: making sure the original given is the model that was quantized.

The quantized manifest records the source's fingerprint: config.json's hash plus every shard's name,
size and header hash. That is cheap for a 60 GB checkpoint but blind to the weights themselves: a
fine-tune of the same architecture, saved the same way, has the same fingerprint. So the tensors the
quantized model holds byte-for-byte copies of are compared too, where that is cheap and telling: every
router, every small tensor (norms, biases), and every non-expert tensor of the trained layers. The experts,
which the quantized model holds no copy of, are checked as the export reads them: each MoE layer's on-disk
expert tensors against the digest quantize recorded of the same tensors (:class:`ExpertDigests`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from usaf.artifacts import QuantizedModelManifest
from usaf.artifacts.hashing import sha256_tensors
from usaf.artifacts.quantized import read_base_index
from usaf.artifacts.run import TrainedChange
from usaf.data.hub import resolve_model_dir
from usaf.errors import UsafError
from usaf.families import (
    FamilySpec,
    MappingPlan,
    TensorInfo,
    load_model_config,
    load_tensors,
    map_checkpoint,
    read_checkpoint,
    resolve_family,
)
from usaf.families.checkpoint import read_header
from usaf.stages.quantize_parts import source_record

SMALL_NUMEL = 1 << 20  # tensors up to this many elements are always compared (norms, biases, routers)


@dataclass(frozen=True)
class Base:
    dir: Path
    infos: dict[str, TensorInfo]
    plan: MappingPlan
    fingerprint: str
    experts: ExpertDigests


@dataclass(frozen=True)
class ExpertDigests:
    """The sha256 of each MoE layer's on-disk expert tensors that quantize read (``expert_digests``), checked
    against the original's as the export reads them: a base differing only in its experts (another sparse
    fine-tune of the same model, saved the same way) passed every other check (found in review)."""

    base: str  # --base as given
    recorded: dict[int, str]  # MoE layer -> sha256; empty for a model quantized before they were recorded

    def check(self, layer: int, tensors: dict[str, torch.Tensor]) -> None:
        """Refuse ``layer``'s on-disk expert tensors (name -> tensor, as read) unless they are those quantized."""
        expected = self.recorded.get(layer)
        if expected is not None and sha256_tensors(tensors) != expected:
            raise UsafError(
                f"--base {self.base}: its experts of layer {layer} differ from those the quantized model was made "
                "from; same architecture, fingerprint and shared tensors, other expert weights (another fine-tune "
                "of the same model?)",
                "pass the exact checkpoint that was quantized, or export without --base",
            )

    def note(self, layers: list[int]) -> str | None:
        """What the export says where some of ``layers`` have no recorded digest (their experts are not compared)."""
        unrecorded = [layer for layer in layers if layer not in self.recorded]
        if not unrecorded:
            return None
        return (
            f"--base: the original's experts of {len(unrecorded)} of {len(layers)} MoE layer(s) were not compared "
            "with those quantized: the quantized model records no digest of them (quantized by an earlier usaf); "
            "quantize the model again to have them checked"
        )


def resolve_base(
    base: str, spec: FamilySpec, qmanifest: QuantizedModelManifest, model_dir: Path, change: TrainedChange
) -> Base:
    """The --base directory, its headers, mapping and fingerprint, checked against the quantized model.

    A hub id is read from the local cache alone, never downloaded (a newer revision fetched would be refused for
    its fingerprint, when the one quantized may still be cached); the very id the model was quantized from is the
    snapshot directory it was quantized from, while that is there."""
    expected = qmanifest.summary.source
    recorded = Path(expected.path)
    if base == expected.model and not Path(base).expanduser().is_dir() and recorded.is_dir():
        base_dir = recorded
    else:
        base_dir = resolve_model_dir(base, flag="--base", cache_only=True)
    if not (base_dir / "config.json").is_file():
        raise UsafError(f"--base {base}: no config.json there", "pass the original Hugging Face model directory")
    infos = read_checkpoint(base_dir)
    record = source_record(base, base_dir, resolve_family(load_model_config(base_dir)), infos)
    if record.fingerprint != expected.fingerprint:
        raise UsafError(
            f"--base {base}: not the model --model {model_dir} was quantized from: its fingerprint is "
            f"{record.fingerprint[:16]}…, the quantized model records {expected.fingerprint[:16]}… ({expected.model})",
            f"pass --base {expected.model}, or export without --base (the dequantized weights)",
        )
    plan = map_checkpoint(base_dir, spec)
    _compare_copies(base, base_dir, infos, plan, spec, model_dir, change)
    return Base(base_dir, infos, plan, record.fingerprint, ExpertDigests(base, dict(qmanifest.summary.expert_digests)))


def _compare_copies(
    base: str,
    base_dir: Path,
    infos: dict[str, TensorInfo],
    plan: MappingPlan,
    spec: FamilySpec,
    model_dir: Path,
    change: TrainedChange,
) -> None:
    weight_map = read_base_index(model_dir)
    stored: dict[str, TensorInfo] = {}
    for file in sorted(set(weight_map.values())):
        stored.update(read_header(model_dir / file))
    routers = {n for layer in spec.moe_layers for n in spec.router_names(layer)}
    trained = tuple(f"{spec.layer_prefix(layer)}." for layer in change.trainable_layers)
    pairs = [
        (disk, memory)
        for disk, memory in sorted(plan.renamed.items())
        if memory in stored and (memory in routers or memory.startswith(trained) or infos[disk].numel <= SMALL_NUMEL)
    ]
    for disk, memory in pairs:
        original = load_tensors(base_dir, [disk], infos)[disk]
        copy = load_tensors(model_dir, [memory], stored)[memory]
        if original.dtype != copy.dtype or not torch.equal(original, copy):
            raise UsafError(
                f"--base {base}: its {disk} differs from the copy the quantized model {model_dir} holds; "
                "same architecture and fingerprint, other weights (another fine-tune of the same model?)",
                "pass the exact checkpoint that was quantized, or export without --base",
            )
