"""The weights an export must hold, built in memory without the writer's code, and their logits.

Both references start from a model transformers loaded (in fp32) and put into it, by usaf name, the
base the export was made from, then the change (deltas added by index in fp32, routers copied in), each
tensor rounded once to the dtype it is written in, as the writer does. Their logits are those the
reloaded export must have, bit for bit, whatever the dtype:

- :func:`dequantized_reference` (no ``--base``): every tensor of the loaded export is overwritten from
  the quantized model itself (its stored non-expert weights, its experts dequantized), so nothing of the
  written files is trusted; a tensor left unset is an error.
- :func:`original_reference` (``--base``): the original model as transformers itself loads it.

Both return the logits without and with the change: the first is "the same model exported without the
change", whose distance to the engine's base is what the export dtype's rounding alone does.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from usaf.artifacts.quantized import open_quantized
from usaf.artifacts.run import TrainedChange
from usaf.errors import UsafError
from usaf.families import FamilySpec, load_model_config, resolve_family
from usaf.families.modules import FusedView, transformers_config, usaf_state_dict
from usaf.quant import QuantizedTensor, dequantize


@torch.no_grad()
def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(input_ids=ids.to(device), use_cache=False).logits.float().cpu()  # (B, T, V)


def load_hf(path: Path, device: torch.device, what: str) -> torch.nn.Module:
    """``path`` as plain transformers loads it, in fp32; anything it reports missing or unexpected is refused."""
    hf_logging.disable_progress_bar()  # a per-tensor loading bar would bury the export's own progress

    config = transformers_config(path, resolve_family(load_model_config(path)))  # 4.x: renamed fields
    model, info = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float32, output_loading_info=True, trust_remote_code=False
    )
    problems = {k: sorted(v)[:4] for k, v in info.items() if k != "error_msgs" and v} | (
        {"errors": info["error_msgs"][:2]} if info.get("error_msgs") else {}
    )
    if problems:
        raise UsafError(
            f"verification failed: {what} {path} does not load cleanly with transformers: {problems}",
            "this is a bug in usaf export; pass --no-verify only to inspect the output",
        )
    return model.to(device).eval()


@torch.no_grad()
def add_change_in_memory(model: torch.nn.Module, spec: FamilySpec, change: TrainedChange) -> None:
    """Add the deltas to a transformers model's in-memory expert parameters and copy the routers in.

    Indices are unravelled into ``(e, o, i)`` of the stored orientation and written at ``[e, o, i]``,
    or at ``[e, i, o]`` for a transposed (gpt-oss) layout: no fusing or splitting code involved.
    """
    view = FusedView(model, spec)  # transformers 4.x: a fused copy of the per-expert weights, written back
    for name, (indices, values) in change.deltas.items():
        param = view.get(name)
        if param.dim() == 2:  # a linear target (attention, shared): (O, I), its own stored orientation
            flat = param.detach().reshape(-1)
            flat[indices.to(param.device)] += values.to(param.device).to(param.dtype)
            continue
        e, a, b = param.shape
        o, i = (b, a) if spec.layout.transposed else (a, b)  # stored (E, O, I)
        idx = indices.to(param.device)
        expert, rest = idx // (o * i), idx % (o * i)
        row, col = rest // i, rest % i
        at = (expert, col, row) if spec.layout.transposed else (expert, row, col)
        param[at] += values.to(param.device).to(param.dtype)
        view.set(name, param)
    for name, weight in change.routers.items():
        view.set(name, weight)


def _written_dtype(stored: torch.dtype, override: torch.dtype | None) -> torch.dtype:
    """What the writer rounds a tensor of dtype ``stored`` to: ``--dtype`` for floating tensors, else its own."""
    return override if override is not None and stored.is_floating_point else stored


@torch.no_grad()
def dequantized_reference(
    model: torch.nn.Module,
    model_dir: Path,
    spec: FamilySpec,
    change: TrainedChange,
    ids: torch.Tensor,
    override: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the quantized model's dequantized base without and with ``change``, rounded as exported.

    ``model`` (the loaded export, fp32) is only the skeleton: every tensor of it is overwritten. The
    experts are written in their original's dtype (``source_dtype``), the rest in its stored dtype, or
    all floating tensors in ``override`` (``--dtype``).
    """
    view = FusedView(model, spec)
    for tensor in model.state_dict().values():  # poison: a tensor the quantized model does not provide stays NaN
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
    files = open_quantized(model_dir)
    stored: dict[str, torch.dtype] = {}  # usaf name -> dtype of the base it is written from
    unrounded: dict[str, torch.Tensor] = {}  # linear targets' stored weights, before any --dtype
    for _, handle in files.shards("cpu"):
        for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
            tensor = handle.get_tensor(name)
            stored[name] = tensor.dtype
            if name in change.deltas:
                unrounded[name] = tensor
            view.set(name, tensor.to(_written_dtype(tensor.dtype, override)))
    raw = files.experts()  # memory-mapped codes: dequantized one tensor at a time
    for name, entry in raw.items():
        q = QuantizedTensor.from_dict(entry, name=name)
        stored[name] = getattr(torch, q.source_dtype)
        view.set(name, dequantize(q, dtype=torch.float32).to(_written_dtype(stored[name], override)))
    _check_every_tensor_set(model)
    before = logits_of(model, ids)
    for name in change.deltas:  # the unrounded base again: base + delta is summed in fp32, then rounded once
        base = unrounded[name] if name in unrounded else dequantize(QuantizedTensor.from_dict(raw[name], name=name))
        view.set(name, base.float())
    add_change_in_memory(model, spec, change)
    for name in [*change.deltas, *change.routers]:
        view.set(name, view.get(name).to(_written_dtype(stored[name], override)))
    return before, logits_of(model, ids)


def _check_every_tensor_set(model: torch.nn.Module) -> None:
    unset = [n for n, t in model.state_dict().items() if t.is_floating_point() and bool(t.isnan().any())]
    if unset:  # the reference would be meaningless: a bug in usaf (or a quantized model missing a tensor)
        raise RuntimeError(f"export verification: the quantized model provides no value for {unset[:3]}")


def original_reference(
    base_dir: Path,
    spec: FamilySpec,
    change: TrainedChange,
    ids: torch.Tensor,
    device: torch.device,
    written: dict[str, torch.dtype],
    override: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the original model as transformers loads it, without and with the change, rounded as written.

    ``written``: in-memory name -> dtype of every tensor the change was written into (the original's dtypes
    are not visible once transformers loaded it in fp32).
    """
    original = load_hf(base_dir, device, "--base")
    view = FusedView(original, spec)  # usaf's names on either transformers layout
    with torch.no_grad():
        if override is not None:  # --dtype cast every other floating tensor of the checkpoint
            for name, tensor in usaf_state_dict(original, spec).items():
                if tensor.is_floating_point() and name not in written:
                    view.set(name, tensor.to(override))
        before_change = {name: view.get(name).clone() for name in written}
        for name, dtype in written.items():  # the same model exported without the change
            view.set(name, before_change[name].to(dtype))
        before = logits_of(original, ids)
        for name, value in before_change.items():  # back to the unrounded original: + delta in fp32
            view.set(name, value)
    add_change_in_memory(original, spec, change)
    with torch.no_grad():
        for name, dtype in written.items():  # merged in fp32, then rounded once to the written dtype
            view.set(name, view.get(name).to(dtype))
    after = logits_of(original, ids)
    del original
    gc.collect()
    return before, after
