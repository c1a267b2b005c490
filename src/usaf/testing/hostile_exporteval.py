"""Hostile inputs of ``usaf export`` and ``usaf eval``: forged deltas, impossible flag combinations, a
``--base`` that is no model, held-out inputs with nothing to read.

A forged delta is a consistent one (its manifest re-signed, so only what it says is wrong, not its
hashes): a change for the bench's quantized model with a few entries in its top layer's ``gate_up``,
then one thing broken. Each case runs ``usaf export`` (or ``usaf eval``) through the real CLI and must
be refused in one line naming the input. The runs are cheap: the delta is refused before any tensor
is written or any model built.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from usaf.artifacts import ArtifactWriter, DeltaManifest, QuantizedModelManifest, current_environment, load_verified
from usaf.artifacts.delta import DeltaSummary, DeltaTensorRecord, write_delta_files
from usaf.artifacts.run import TrainedChange
from usaf.families import FamilySpec, load_model_config, resolve_family
from usaf.testing.hostile import Bench, Case

EXPORT_EVAL = "export and eval inputs"
READERS: tuple[str, ...] = (EXPORT_EVAL,)

Forgery = Callable[[TrainedChange, DeltaSummary, FamilySpec], tuple[TrainedChange, DeltaSummary]]


def _valid_delta(bench: Bench) -> tuple[TrainedChange, DeltaSummary, FamilySpec]:
    """Three entries in the top MoE layer's gate_up of the bench's quantized model, and their summary."""
    manifest = load_verified(bench.quantized, QuantizedModelManifest)
    spec = resolve_family(load_model_config(bench.quantized))
    layer = max(manifest.summary.moe_layers)
    (tensor,) = [t for t in manifest.summary.tensors if t.name == spec.gate_up_name(layer)]
    indices, values = torch.tensor([0, 5, 17]), torch.tensor([0.5, -0.25, 0.125])
    deltas = {tensor.name: (indices, values)}
    change = TrainedChange(bench.quantized, "f" * 64, manifest.fingerprint, [layer], deltas, {})
    source = manifest.summary.source
    summary = DeltaSummary(
        model_fingerprint=manifest.fingerprint,
        source_fingerprint=source.fingerprint,
        family=source.family,
        model_type=source.model_type,
        change_fingerprint=change.fingerprint,
        trainable_layers=[layer],
        tensors=[DeltaTensorRecord(name=tensor.name, shape=list(tensor.shape), entries=3)],
        expert_entries=3,
        router_tensors=0,
        router_params=0,
    )
    return change, summary, spec


def write_delta(bench: Bench, out: Path, forge: Forgery | None = None) -> Path:
    """A ``delta`` artifact at ``out`` for the bench's model, broken by ``forge`` (files and manifest agree)."""
    change, summary, spec = _valid_delta(bench)
    if forge is not None:
        change, summary = forge(change, summary, spec)
    with ArtifactWriter(out, kinds=(DeltaManifest.KIND,)) as art:
        write_delta_files(art.dir, change)
        art.commit(DeltaManifest, inputs=[], config={}, environment=current_environment(), summary=summary)
    return out


def _deltas(mutate: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> Forgery:
    """Replace every tensor's (indices, values), keeping the summary's entry counts true."""

    def forge(change: TrainedChange, summary: DeltaSummary, spec: FamilySpec):
        deltas = {name: mutate(i, v) for name, (i, v) in change.deltas.items()}
        tensors = [t.model_copy(update={"entries": int(deltas[t.name][0].numel())}) for t in summary.tensors]
        return TrainedChange(**{**vars(change), "deltas": deltas}), summary.model_copy(update={"tensors": tensors})

    return forge


def _foreign_tensor() -> Forgery:
    """The delta's entries under the gate_up name of a layer the model does not have."""

    def forge(change: TrainedChange, summary: DeltaSummary, spec: FamilySpec):
        (pair,) = change.deltas.values()
        name = spec.gate_up_name(spec.num_layers + 5)
        deltas = {name: pair}
        tensors = [t.model_copy(update={"name": name}) for t in summary.tensors]
        return TrainedChange(**{**vars(change), "deltas": deltas}), summary.model_copy(update={"tensors": tensors})

    return forge


def _layers(layers: list[int]) -> Forgery:
    def forge(change: TrainedChange, summary: DeltaSummary, spec: FamilySpec):
        return TrainedChange(**{**vars(change), "trainable_layers": layers}), summary.model_copy(
            update={"trainable_layers": layers}
        )

    return forge


def _routers(shape_of: Callable[[int, int], tuple[int, ...]], *, layer_below: bool = False) -> Forgery:
    """A trained router of shape ``shape_of(E, H)`` for the delta's layer (``layer_below``: for the layer
    under it, which the delta does not train)."""

    def forge(change: TrainedChange, summary: DeltaSummary, spec: FamilySpec):
        experts, hidden = summary.tensors[0].shape[0], summary.tensors[0].shape[2]
        router = spec.router_names(change.trainable_layers[0] - int(layer_below))[0]
        routers = {router: torch.zeros(shape_of(experts, hidden))}
        count = {"router_tensors": 1, "router_params": int(routers[router].numel())}
        return TrainedChange(**{**vars(change), "routers": routers}), summary.model_copy(update=count)

    return forge


def _nan_router() -> Forgery:
    """A trained router for the delta's layer, of the right shape, one weight infinite."""
    right_shape = _routers(lambda e, h: (e, h))

    def forge(change: TrainedChange, summary: DeltaSummary, spec: FamilySpec):
        change, summary = right_shape(change, summary, spec)
        for router in change.routers.values():
            router[0, 0] = float("inf")
        return change, summary

    return forge


def _export_delta(name: str, forge: Forgery) -> Case:
    """``usaf export --checkpoint`` a forged delta (the directory is the needle: the message must name it)."""
    directory = name.replace(" ", "-").replace("'", "")

    def build(bench: Bench, case_dir: Path) -> list[str]:
        delta = write_delta(bench, case_dir / directory, forge)
        return ["export", "--model", str(bench.quantized), "--checkpoint", str(delta), "--out", str(case_dir / "out")]

    return Case(EXPORT_EVAL, f"export: a delta with {name}", build, directory)


def _eval_delta(name: str, forge: Forgery) -> Case:
    """``usaf eval --checkpoint`` a forged delta: eval checks a change as export and generate do."""
    directory = "eval-" + name.replace(" ", "-")

    def build(bench: Bench, case_dir: Path) -> list[str]:
        delta = write_delta(bench, case_dir / directory, forge)
        return ["eval", "--model", str(bench.quantized), "--checkpoint", str(delta), "--held-out", str(bench.tokens),
                "--no-plots", "--no-base-cache", "--workspace", str(case_dir / "ws"),
                "--out", str(case_dir / "out")]  # fmt: skip

    return Case(EXPORT_EVAL, f"eval: a delta with {name}", build, directory)


def _flags(name: str, needle: str, *flags: str, delta: bool = False) -> Case:
    """``usaf export`` with flags that cannot go together (or a value out of its set)."""

    def build(bench: Bench, case_dir: Path) -> list[str]:
        change = ["--checkpoint", str(write_delta(bench, case_dir / "delta"))] if delta else []
        return ["export", "--model", str(bench.quantized), *change, *flags, "--out", str(case_dir / "out")]

    return Case(EXPORT_EVAL, f"export: {name}", build, needle)


def _base_without_config() -> Case:
    def build(bench: Bench, case_dir: Path) -> list[str]:
        base = case_dir / "not-a-model"
        base.mkdir()
        (base / "model.safetensors").write_bytes((bench.model / "model.safetensors").read_bytes())
        delta = write_delta(bench, case_dir / "delta")
        return ["export", "--model", str(bench.quantized), "--checkpoint", str(delta), "--base", str(base),
                "--out", str(case_dir / "out")]  # fmt: skip

    return Case(EXPORT_EVAL, "export: a --base directory without config.json", build, "not-a-model")


def _held_out_binary_only() -> Case:
    def build(bench: Bench, case_dir: Path) -> list[str]:
        held = case_dir / "binaries"
        held.mkdir()
        (held / "blob.bin").write_bytes(bytes(range(256)) * 8)
        return ["eval", "--model", str(bench.quantized), "--held-out", str(held), "--no-plots", "--no-base-cache",
                "--workspace", str(case_dir / "ws"), "--out", str(case_dir / "out")]  # fmt: skip

    return Case(EXPORT_EVAL, "eval: a --held-out directory of binary files only", build, "binaries")


def cases() -> list[Case]:
    return [
        _export_delta("indices past its tensor's end", _deltas(lambda i, v: (i + 10**9, v))),
        _export_delta("unsorted indices", _deltas(lambda i, v: (i.flip(0), v))),
        _export_delta("a NaN value", _deltas(lambda i, v: (i, v.index_fill(0, torch.tensor([1]), float("nan"))))),
        _eval_delta("an infinite router weight", _nan_router()),
        _export_delta("values shorter than its indices", _deltas(lambda i, v: (i, v[:-1]))),
        _export_delta("a tensor the model does not have", _foreign_tensor()),
        _export_delta("a layer that is not a MoE layer", _layers([7])),
        _export_delta("a router of the wrong shape", _routers(lambda e, h: (e + 1, h))),
        _export_delta("a router of a layer it does not train", _routers(lambda e, h: (e, h), layer_below=True)),
        _eval_delta("a router of the wrong shape", _routers(lambda e, h: (e, h + 1))),
        _flags("--no-checkpoint with --format delta", "--no-checkpoint", "--no-checkpoint", "--format", "delta"),
        _flags("--dtype int8", "--dtype", "--dtype", "int8", delta=True),
        _base_without_config(),
        _held_out_binary_only(),
    ]
