"""Engine helpers shared by the engine, reselection and DirectML tests: a tiny engine, batches, selections, a step."""

from __future__ import annotations

import torch

from usaf.engine.engine import IGNORE_INDEX, SparseEngine
from usaf.engine.loading import load_quantized_model
from usaf.families.modules import FusedView

FAMILY_LAYERS = 3  # a frozen prefix below the trainable top layer for every family (deepseek: layer 0 dense)


def batch(seed: int = 0, size: tuple[int, int] = (2, 20)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 512, size, generator=g)
    labels = ids.clone()
    labels[0, :3] = IGNORE_INDEX  # some unscored positions
    return ids, labels


def random_selection(engine: SparseEngine, frac: float = 0.1, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    selection = {}
    for name, weight in engine.weights.items():
        numel = weight.shape[0] * weight.shape[1] * weight.shape[2]
        selection[name] = torch.randperm(numel, generator=g)[: max(1, int(frac * numel))].sort().values
    return selection


def every_target(spec) -> tuple[str, ...]:
    """Every target the family has: experts, attention, and shared where it has shared experts."""
    return ("experts", "attention", "shared") if spec.shared is not None else ("experts", "attention")


def make_engine(quantized, family, **kwargs):
    """The family's tiny engine, its top layer trainable; ``targets="all"``: :func:`every_target`."""
    loaded = load_quantized_model(quantized(family, num_layers=FAMILY_LAYERS))
    top = loaded.spec.moe_layers[-1]
    if kwargs.get("targets") == "all":
        kwargs["targets"] = every_target(loaded.spec)
    return SparseEngine(loaded, trainable_layers=[top], **kwargs)


def train_step(engine, optimizer, ids, labels) -> float:
    engine.model.zero_grad(set_to_none=True)
    for delta in engine.deltas().values():
        delta.values.grad = None
    parts = engine.loss(ids, labels)
    parts.loss.backward()
    assert optimizer.step().applied
    return parts.loss.item()


def reference_loss(model, ids, labels):
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    targets = labels[:, 1:]
    tokens = (targets != IGNORE_INDEX).sum()
    return (
        torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        / tokens
    )


def view_of(reference, engine: SparseEngine) -> FusedView:
    """usaf's names on the reference model (transformers 4.x: per-expert weights seen fused)."""
    return FusedView(reference, engine.spec)


def stored_grad(view: FusedView, name: str, transposed: bool) -> torch.Tensor:
    """The dense gradient of a fused expert parameter in usaf's stored (E, O, I) orientation, flattened."""
    grad = view.get(name, grad=True)
    return (grad.transpose(1, 2) if transposed else grad).reshape(-1)


def backward_with_random_deltas(engine: SparseEngine):
    """Random masks (``random_selection``) with random values 0.05 × N(0, 1) installed, then one loss and backward
    on :func:`batch`: ``(selection, values, ids, labels, loss)``."""
    selection = random_selection(engine)
    g = torch.Generator().manual_seed(5)
    values = {n: 0.05 * torch.randn(i.numel(), generator=g) for n, i in selection.items()}
    engine.set_deltas(selection, values)
    ids, labels = batch()
    loss = engine.loss(ids, labels).loss
    loss.backward()
    return selection, values, ids, labels, loss


def hold_deltas(view: FusedView, engine: SparseEngine, selection, values) -> None:
    """Write every trainable tensor's base + delta into the reference model seen through ``view`` as plain dense
    weights, and make them require grad (fused experts in their in-memory orientation, linear targets as they are)."""
    from usaf.engine.linear_target import LinearTarget

    with torch.no_grad():
        for name, weight in engine.weights.items():
            transposed = not isinstance(weight, LinearTarget) and weight.q.transposed
            dense = view.get(name).detach().float()
            stored = (dense.transpose(1, 2) if transposed else dense).contiguous()  # (E, O, I) or (O, I)
            stored.view(-1)[selection[name]] += values[name]
            view.set(name, stored.transpose(1, 2) if transposed else stored)
    for name in engine.weights:
        view.requires_grad_(name)


def assert_gradients_equal_dense_autograd(engine: SparseEngine, selection, source, ids, labels) -> None:
    """The delta values' and routers' gradients (after ``engine``'s backward on ``ids``) equal dense autograd's on
    transformers' model of ``source`` at the selected entries. Negative control: one column over does not match."""
    from helpers import reference_model

    reference = reference_model(source, engine.loaded)
    view = view_of(reference, engine)
    for name in engine.weights:
        view.requires_grad_(name)
    reference_loss(reference, ids, labels).backward()
    for name, weight in engine.weights.items():
        dense = stored_grad(view, name, weight.q.transposed)
        got = weight.delta.values.grad
        torch.testing.assert_close(got, dense[selection[name]], rtol=1e-4, atol=1e-6)
        shifted = (selection[name] + 1) % dense.numel()
        assert not torch.allclose(got, dense[shifted], rtol=1e-3, atol=1e-6), name
    assert engine.routers, "routers must be trainable"
    for name, master in engine.routers.items():
        torch.testing.assert_close(master.grad, view.get(name, grad=True), rtol=1e-4, atol=1e-6)


def loss_and_grads(engine: SparseEngine, ids, labels) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One loss and backward from cleared gradients: the loss and every delta's and router's gradient."""
    engine.model.zero_grad(set_to_none=True)
    for delta in engine.deltas().values():
        delta.values.grad = None
    loss = engine.loss(ids, labels).loss
    loss.backward()
    grads = {n: d.values.grad.clone() for n, d in engine.deltas().items()}
    return loss.detach(), grads | {n: p.grad.clone() for n, p in engine.routers.items()}
