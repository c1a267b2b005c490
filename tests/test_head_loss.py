"""The chunked next-token loss: equal to cross-entropy on the whole logits, without ever holding them."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from helpers import LargestAllocation
from usaf.engine.head_loss import HeadInput, next_token_loss

VOCAB, WIDTH = 300, 16


def _case(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(WIDTH, VOCAB, bias=True).to(dtype).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB, WIDTH, generator=g))
        head.bias.copy_(torch.randn(VOCAB, generator=g))
    hidden = torch.randn(3, 11, WIDTH, generator=g).to(dtype).requires_grad_(True)
    labels = torch.randint(0, VOCAB, (3, 11), generator=g)
    labels[0, :4] = -100  # unscored positions, as prompts and padding are
    labels[2, 7:] = -100
    return head, hidden, labels


def _reference(head, hidden, labels):
    """What the engine computed before: the whole (B, T-1, V) fp32 logits and F.cross_entropy."""
    logits = head(hidden)[:, :-1].float()
    targets = labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("chunk_rows", [1, 7, 30, 1000])  # 30 positions in all: one row, uneven, exact, one chunk
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_and_hidden_gradient_equal_cross_entropy_on_the_whole_logits(chunk_rows, dtype):
    head, hidden, labels = _case(dtype)
    expected = _reference(head, hidden, labels)
    (expected_grad,) = torch.autograd.grad(expected * 0.37, hidden)  # an upstream factor, as 1/tokens is
    summed, tokens = next_token_loss(hidden, labels, head, chunk_bytes=chunk_rows * 4 * VOCAB)
    (grad,) = torch.autograd.grad(summed * 0.37, hidden)
    assert tokens == int((labels[:, 1:] != -100).sum()) == 30 - 3 - 4
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(summed, expected.float(), rtol=1e-6 if dtype == torch.float32 else 1e-5, atol=1e-4)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, expected_grad, **tol)
    assert grad[0, :3].abs().sum() == 0 and grad[:, -1].abs().sum() == 0  # unscored and last positions: no gradient
    assert grad[0, 3:].abs().sum() > 0


def test_without_gradients_the_loss_is_the_same_and_nothing_is_kept():
    head, hidden, labels = _case(torch.float32)
    with_grad, _ = next_token_loss(hidden, labels, head)
    with torch.no_grad():
        without, _ = next_token_loss(hidden, labels, head)
    assert without.grad_fn is None and with_grad.grad_fn is not None
    assert torch.equal(without, with_grad.detach())


def test_no_tensor_of_the_whole_logits_exists():
    head, hidden, labels = _case(torch.float32)
    rows = 4
    with LargestAllocation() as chunked:
        summed, _ = next_token_loss(hidden, labels, head, chunk_bytes=rows * 4 * VOCAB)
        summed.backward()
    assert chunked.largest <= rows * VOCAB * 4  # one chunk's fp32 logits
    with LargestAllocation() as whole:  # negative control: the whole-logits loss makes (B, T, V) tensors
        _reference(head, hidden, labels).backward()
    assert whole.largest >= 3 * 10 * VOCAB * 4


def test_head_input_captures_inside_and_computes_logits_outside():
    head, hidden, _ = _case(torch.float32)
    interceptor = HeadInput(head)
    real = head(hidden)
    assert real.shape == (3, 11, VOCAB) and real.abs().sum() > 0
    with interceptor.capture() as captured:
        with pytest.raises(RuntimeError, match="never reached"):
            captured()
        stand_in = head(hidden)
        assert captured() is hidden
    assert stand_in.shape == real.shape and stand_in.stride() == (0, 0, 0) and not stand_in.any()
    torch.testing.assert_close(head(hidden), real)  # outside the block: the real projection again


def test_a_trainable_head_is_refused():
    head, hidden, labels = _case(torch.float32)
    head.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="trains no output projection"):
        next_token_loss(hidden, labels, head)
    with torch.no_grad():  # without gradients there is nothing to miss
        next_token_loss(hidden, labels, head)


def test_the_planner_sizes_the_same_chunks():
    from usaf.engine import head_loss
    from usaf.memory_plan import activations

    assert activations.CHUNK_LOGIT_BYTES == head_loss.CHUNK_LOGIT_BYTES


def test_chunks_follow_the_devices_allocation_limit(monkeypatch):
    """A device that fails single allocations above a limit (DirectML) gets chunks whose logits fit under it."""
    import dataclasses

    from usaf.backends import transfer

    head, hidden, labels = _case(torch.float32)
    limit = 5 * VOCAB * 4  # five positions' fp32 logits
    caps = dataclasses.replace(transfer.device_capabilities("cpu"), max_allocation_bytes=limit)
    monkeypatch.setattr(transfer, "_capabilities", lambda kind, index: caps)
    with LargestAllocation() as limited:
        summed, _ = next_token_loss(hidden, labels, head)
        summed.backward()
    assert limited.largest <= limit
    torch.testing.assert_close(summed, _reference(head, hidden, labels), rtol=1e-6, atol=1e-4)
    monkeypatch.undo()  # negative control: without the limit, one chunk holds all 30 positions' logits
    with LargestAllocation() as unlimited:
        next_token_loss(hidden, labels, head)[0].backward()
    assert unlimited.largest >= 30 * VOCAB * 4
