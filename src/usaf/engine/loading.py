"""Building a transformers model from a usaf quantized-model directory.

The model is built on the meta device from the directory's own ``config.json`` with
``experts_implementation="usaf"`` (on transformers 4.x, each MoE block is adapted instead:
:mod:`usaf.engine.legacy`); non-expert tensors are read from the ``base-*.safetensors`` shards
(already under their in-memory names) straight into place; each MoE layer's fused expert parameters
are removed and replaced by usaf's :class:`~usaf.engine.experts.LayerExperts` (4-bit codes, memory-mapped
from ``experts_q4.pt``). Nothing is allocated at the full size of the experts. The files are opened by
:class:`usaf.artifacts.quantized.QuantizedFiles`, which the stages hand in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from usaf.artifacts import QuantizedModelManifest
from usaf.artifacts.quantized import EXPERTS_FILE, QuantizedFiles, open_quantized
from usaf.backends.transfer import check_allocation, device_capabilities, move
from usaf.engine.experts import IMPLEMENTATION, ExpertWeight, LayerExperts, count_real_tokens, register
from usaf.engine.legacy import adapt_block
from usaf.errors import UsafError
from usaf.families import FamilySpec, load_model_config, resolve_family
from usaf.families.modules import ModuleLayout, module_layout, transformers_config
from usaf.quant import QuantizedTensor


@dataclass
class LoadedModel:
    model: nn.Module
    spec: FamilySpec
    experts: dict[int, LayerExperts]  # MoE layer index -> usaf's state for it
    manifest: QuantizedModelManifest
    path: Path


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)
    elif attr in module._buffers:
        module._buffers[attr] = value
    else:
        raise UsafError(f"{name}: in the base weights but not in the model", "the quantized directory is inconsistent")


def _rebuild_meta_buffers(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary inv_freq) are computed at construction, so meta ones are rebuilt."""
    for name, module in model.named_modules():
        if not any(b is not None and b.is_meta for b in module._buffers.values()):
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise UsafError(f"{name}: has computed buffers usaf cannot rebuild", "report this model type")
        with torch.device(device):
            fresh = type(module)(config=config)
        for key, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[key] = fresh._buffers[key]


def tensor_count(files: QuantizedFiles) -> int:
    """How many times :func:`load_quantized_model` calls its ``on_tensor``: the base tensors and two expert tensors
    per MoE layer."""
    return len(files.weight_map) + 2 * len(resolve_family(load_model_config(files.path)).moe_layers)


def load_quantized_model(
    source: QuantizedFiles | Path,
    *,
    device: torch.device | str = "cpu",
    compute_dtype: torch.dtype = torch.float32,
    flag: str = "--model",
    experts_device: torch.device | str | None = None,
    on_tensor: Callable[[], None] | None = None,
) -> LoadedModel:
    """Build the model of a ``usaf quantize`` output on ``device``.

    Args:
        source: the opened quantized model (:func:`usaf.artifacts.quantized.open_quantized`); a directory
            is opened here (for tests and tools).
        device: where non-expert weights and expert codes live.
        experts_device: where the 4-bit expert codes live instead (``"cpu"`` for streaming them).
        compute_dtype: dtype of non-expert weights and of dequantized expert bases.
        flag: the flag ``path`` came from, for messages.
        on_tensor: called as each tensor is in place: every base tensor, then each layer's two expert tensors
            (:func:`tensor_count` of them; a stage's progress, as a large model takes a minute onto a GPU).
    """
    # lazy: transformers (seconds to import) only when a model is built; usaf.engine imports without it
    from transformers import AutoModelForCausalLM

    files = source if isinstance(source, QuantizedFiles) else open_quantized(source, flag=flag)
    path, manifest = files.path, files.manifest
    device = torch.device(device)
    spec = resolve_family(load_model_config(path))
    _check_config_matches(path, spec, manifest)
    config = transformers_config(path, spec)  # 4.x: fields transformers 5 renamed, under their old names
    layout = module_layout(spec)
    if layout is ModuleLayout.FUSED:  # transformers >= 5: usaf's experts through the registry
        register()
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, experts_implementation=IMPLEMENTATION, dtype=compute_dtype)
    else:  # transformers 4.x: usaf's experts module replaces each block's experts (usaf.engine.legacy)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=compute_dtype)
        for layer in spec.moe_layers:
            adapt_block(model, spec, layer)

    caps = device_capabilities(device)
    read_on = device if caps.direct_load else torch.device("cpu")  # DirectML: read on the host, then move
    for where, f in files.shards(str(read_on)):
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            current = _model_tensor(model, name, where)
            _check_base_tensor(where, name, f.get_slice(name), current)  # before reading it
            target_dtype = current.dtype if current.is_floating_point() else None
            tensor = f.get_tensor(name)
            check_allocation(tensor.numel() * current.element_size(), device, f"{where}: {name}")
            _set_tensor(model, name, move(tensor, device, target_dtype))
            if on_tensor is not None:
                on_tensor()

    raw = files.experts()
    recorded = {t.name: list(t.shape) for t in manifest.summary.tensors}  # in-memory shapes, as quantized
    experts: dict[int, LayerExperts] = {}
    for layer in spec.moe_layers:
        module = model.get_submodule(spec.experts_prefix(layer))
        weights = []
        for name in (spec.gate_up_name(layer), spec.down_name(layer)):
            if name not in raw:
                raise UsafError(f"{path / EXPERTS_FILE}: no entry {name}", "re-run usaf quantize")
            try:
                q = QuantizedTensor.from_dict(raw[name], name=name)
            except ValueError as e:  # wrong keys, dtypes, shapes or non-finite scales: a damaged or foreign file
                raise UsafError(f"{path / EXPERTS_FILE}: {e}", "re-run usaf quantize") from None
            if list(q.memory_shape) != recorded.get(name, list(q.memory_shape)):
                raise UsafError(
                    f"{path / EXPERTS_FILE}: {name} has shape {list(q.memory_shape)}, the manifest records "
                    f"{recorded[name]} (edited after usaf quantize?)",
                    "re-run usaf quantize",
                )
            attr = name.rsplit(".", 1)[1]
            fused = getattr(module, attr, None)  # the meta parameter it replaces (v5, gpt-oss 4.x); absent in 4.x
            if fused is not None and tuple(q.memory_shape) != tuple(fused.shape):
                raise UsafError(
                    f"{path / EXPERTS_FILE}: {name} has shape {list(q.memory_shape)}, the model's config says "
                    f"{list(fused.shape)}",
                    "re-run usaf quantize",
                )
            where = experts_device or device
            check_allocation(q.nbytes, where, f"{path / EXPERTS_FILE}: {name}")
            weights.append(ExpertWeight(q, compute_dtype=compute_dtype, device=where))
            if on_tensor is not None:
                on_tensor()
            if fused is not None:  # usaf computes instead
                delattr(module, attr)
        module.usaf_experts = LayerExperts(layer, *weights)
        module.usaf_experts.set_capabilities(caps)  # index ops (nonzero/index_add_/scatter), grouped matmul
        experts[layer] = module.usaf_experts

    _rebuild_meta_buffers(model, device)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise UsafError(
            f"{path}: {len(left)} model tensors have no value (e.g. {left[0]})",
            "the quantized directory is incomplete; re-run usaf quantize",
        )
    model.requires_grad_(False)
    model.eval()
    count_real_tokens(model, experts)  # padding out of the experts' load statistics
    return LoadedModel(model, spec, experts, manifest, path)


def _check_config_matches(path: Path, spec: FamilySpec, manifest: QuantizedModelManifest) -> None:
    """Refuse a ``config.json`` that no longer describes the model the manifest says was quantized (an edited
    config would build another model around these weights)."""
    source = manifest.summary.source
    made = (source.model_type, list(manifest.summary.moe_layers))
    now = (spec.model_type, list(spec.moe_layers))
    if made != now:
        raise UsafError(
            f"{path / 'config.json'}: describes a {now[0]} model with MoE layers {now[1]}, the manifest records "
            f"a {made[0]} model with MoE layers {made[1]} (edited after usaf quantize?)",
            "restore the config.json usaf quantize wrote, or re-run usaf quantize",
        )


def _check_base_tensor(where: str, name: str, stored, current: torch.Tensor) -> None:
    """A base tensor (``stored``: its safetensors slice) of the model's shape, and floating point where the
    model's is (an integer router would be cast silently)."""
    shape, dtype = list(stored.get_shape()), stored.get_dtype()  # safetensors codes: F32, BF16, I64, BOOL, ...
    if shape != list(current.shape):
        raise UsafError(
            f"{where}: {name} has shape {shape}, the model's config says {list(current.shape)}",
            "the quantized directory is inconsistent; re-run usaf quantize",
        )
    if current.is_floating_point() and not dtype.startswith(("F", "BF")):
        raise UsafError(
            f"{where}: {name} is stored as {dtype}, the model's is floating point",
            "the quantized directory is inconsistent; re-run usaf quantize",
        )


def _model_tensor(model: nn.Module, name: str, where: str) -> torch.Tensor:
    """The model's (meta) parameter or buffer ``name``; a base tensor the model does not have is refused."""
    try:
        return model.get_parameter(name) if _is_parameter(model, name) else model.get_buffer(name)
    except AttributeError:
        raise UsafError(
            f"{where}: holds {name}, which is no tensor of the model its config describes",
            "the quantized directory is inconsistent; re-run usaf quantize",
        ) from None


def _is_parameter(model: nn.Module, name: str) -> bool:
    module_name, _, attr = name.rpartition(".")
    return attr in model.get_submodule(module_name)._parameters
