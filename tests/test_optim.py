"""SparseAdamW and WarmupCosine: equivalence with torch's AdamW, anchors, skips, clipping, state surgery, resume."""

from __future__ import annotations

import math

import pytest
import torch

from usaf.engine.optim import SparseAdamW, StepReport
from usaf.engine.schedule import WarmupCosine

BETAS = (0.9, 0.99)
EPS = 1e-8


def _grads(n_steps: int, shapes: list[tuple[int, ...]], seed: int = 0) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(n_steps)]


def _params(shapes: list[tuple[int, ...]], seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_() for s in shapes]


def _set_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()


def _snapshot(opt: SparseAdamW, params: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in params]
    for p in params:
        out += [t.clone() for t in opt.state_for(p).values()]
    return out


def _bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------------------ torch equivalence


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_adamw(weight_decay):
    shapes = [(37,), (5, 7)]
    ours, ref = _params(shapes), _params(shapes)
    opt = SparseAdamW([{"params": ours, "lr": 1e-2, "weight_decay": weight_decay}], betas=BETAS, eps=EPS)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, betas=BETAS, eps=EPS, weight_decay=weight_decay, foreach=False)
    for grads in _grads(10, shapes):
        _set_grads(ours, grads)
        _set_grads(ref, grads)
        report = opt.step()
        torch_opt.step()
        assert report.applied and not report.clipped and not report.skipped_nonfinite
    for a, b, start in zip(ours, ref, _params(shapes)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        # Same operations in the same order: on CPU it is exact, not merely close.
        assert torch.equal(a, b)
        assert not torch.equal(a, start)  # negative control: it did move


def test_groups_keep_their_own_lr_and_decay():
    shapes = [(20,)]
    delta, router = _params(shapes, seed=1)[0], _params(shapes, seed=2)[0]
    ref_delta, ref_router = _params(shapes, seed=1)[0], _params(shapes, seed=2)[0]
    opt = SparseAdamW(
        [
            {"params": [delta], "lr": 1e-2, "weight_decay": 0.1, "name": "deltas"},
            {"params": [router], "lr": 1e-3, "weight_decay": 0.0, "name": "routers"},
        ],
        betas=BETAS,
        eps=EPS,
    )
    torch_opt = torch.optim.AdamW(
        [
            {"params": [ref_delta], "lr": 1e-2, "weight_decay": 0.1},
            {"params": [ref_router], "lr": 1e-3, "weight_decay": 0},
        ],
        betas=BETAS,
        eps=EPS,
        foreach=False,
    )
    for grads in _grads(5, [(20,), (20,)]):
        _set_grads([delta, router], grads)
        _set_grads([ref_delta, ref_router], grads)
        opt.step()
        torch_opt.step()
    assert torch.equal(delta, ref_delta) and torch.equal(router, ref_router)


# ------------------------------------------------------------------------------ anchored decay


def test_anchor_decay_pulls_toward_anchor_not_zero():
    anchor = torch.full((8,), 3.0)
    router = (anchor + 1.0).requires_grad_()
    control = (anchor + 1.0).requires_grad_()
    opt = SparseAdamW(
        [
            {"params": [router], "lr": 0.1, "weight_decay": 1.0, "anchor": [anchor.clone()]},
            {"params": [control], "lr": 0.1, "weight_decay": 1.0, "anchor": None},
        ]
    )
    for _ in range(20):
        # Zero gradients: only the decay moves anything.
        router.grad, control.grad = torch.zeros(8), torch.zeros(8)
        opt.step()
    # p - anchor shrinks by (1 - lr*wd) per step: 1.0 * 0.9**20 above the anchor.
    torch.testing.assert_close(router.detach(), anchor + 0.9**20)
    torch.testing.assert_close(control.detach(), torch.full((8,), 4.0 * 0.9**20))  # control: toward zero


def test_entry_at_its_anchor_stays_bit_identical():
    anchor = torch.randn(16)
    router = anchor.clone().requires_grad_()
    opt = SparseAdamW([{"params": [router], "lr": 0.05, "weight_decay": 0.3, "anchor": [anchor.clone()]}])
    for _ in range(5):
        router.grad = torch.zeros(16)
        opt.step()
    assert torch.equal(router.detach(), anchor)


def test_anchor_must_be_a_copy():
    w = torch.randn(4, requires_grad=True)
    with pytest.raises(ValueError, match="frozen copy"):
        SparseAdamW([{"params": [w], "lr": 0.1, "anchor": [w]}])


def test_untouched_zero_delta_never_moves():
    values = torch.zeros(50, requires_grad=True)
    opt = SparseAdamW([{"params": [values], "lr": 0.1, "weight_decay": 0.5}])
    mask = torch.zeros(50, dtype=torch.bool)
    mask[::5] = True
    for g in _grads(10, [(50,)]):
        values.grad = torch.where(mask, g[0], torch.zeros(()))
        opt.step()
    assert torch.equal(values.detach()[~mask], torch.zeros(40))
    assert (values.detach()[mask] != 0).all()  # negative control: the entries with gradient did move


# ------------------------------------------------------------------------------ skipping and clipping


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gradient_skips_the_whole_step(bad):
    shapes = [(10,), (3, 4)]
    params = _params(shapes)
    opt = SparseAdamW([{"params": params, "lr": 1e-2, "weight_decay": 0.1}], max_grad_norm=1.0)
    grads = _grads(3, shapes)
    _set_grads(params, grads[0])
    opt.step()
    before = _snapshot(opt, params)

    poisoned = [g.clone() for g in grads[1]]
    poisoned[1][2, 3] = bad
    _set_grads(params, poisoned)
    report = opt.step()
    assert report == StepReport(applied=False, grad_norm=report.grad_norm, clipped=False, skipped_nonfinite=True)
    assert not math.isfinite(report.grad_norm)
    assert _bit_equal(_snapshot(opt, params), before)
    assert opt.skipped_steps == 1 and opt.applied_steps == 1

    _set_grads(params, grads[2])
    report = opt.step()
    assert report.applied and not report.skipped_nonfinite
    assert not _bit_equal(_snapshot(opt, params), before)


def test_params_without_grad_are_left_alone():
    a, b = _params([(6,), (6,)])
    opt = SparseAdamW([{"params": [a, b], "lr": 0.1, "weight_decay": 0.1}])
    b_before = b.detach().clone()
    a.grad = torch.ones(6)
    assert opt.step().applied
    assert torch.equal(b.detach(), b_before)
    assert torch.equal(opt.state_for(b)["step"], torch.zeros(6, dtype=torch.int32))
    opt.zero_grad()
    assert opt.step() == StepReport(applied=False, grad_norm=0.0, clipped=False, skipped_nonfinite=False)


def test_clipping_matches_clip_grad_norm_then_adamw():
    shapes = [(30,), (4, 5)]
    ours, ref = _params(shapes), _params(shapes)
    unclipped = _params(shapes)
    opt = SparseAdamW([{"params": ours, "lr": 1e-2, "weight_decay": 0.1}], betas=BETAS, eps=EPS, max_grad_norm=0.5)
    control = SparseAdamW([{"params": unclipped, "lr": 1e-2, "weight_decay": 0.1}], betas=BETAS, eps=EPS)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, betas=BETAS, eps=EPS, weight_decay=0.1, foreach=False)
    for k, grads in enumerate(_grads(6, shapes)):
        grads = [g * (1 + 2 * k) for g in grads]  # norms well above 0.5, and clip factors that vary
        _set_grads(ours, grads)
        _set_grads(ref, grads)
        _set_grads(unclipped, grads)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref, 0.5)
        report = opt.step()
        torch_opt.step()
        control.step()
        assert report.clipped and report.grad_norm == ref_norm.item()
        assert all(torch.equal(p.grad, g) for p, g in zip(ours, grads))  # the caller's grads are not rescaled
    for a, b, c in zip(ours, ref, unclipped):
        assert torch.equal(a, b)
        assert not torch.allclose(a, c)  # negative control: clipping changed the trajectory


def test_clipping_at_the_threshold_matches_torch():
    # A norm a hair under max_norm: torch still scales by max_norm / (norm + 1e-6) < 1.
    (p,) = _params([(4,)])
    (ref,) = _params([(4,)])
    grad = torch.tensor([0.6, 0.8, 0.0, 0.0])  # norm 1.0
    p.grad, ref.grad = grad.clone(), grad.clone()
    opt = SparseAdamW([{"params": [p], "lr": 1.0}], max_grad_norm=1.0 + 5e-7, betas=BETAS, eps=1.0)
    torch.nn.utils.clip_grad_norm_([ref], 1.0 + 5e-7)
    torch_opt = torch.optim.AdamW([ref], lr=1.0, betas=BETAS, eps=1.0, weight_decay=0.0, foreach=False)
    report = opt.step()
    torch_opt.step()
    assert report.clipped
    assert torch.equal(p, ref)


def test_no_clipping_below_the_threshold():
    (p,) = _params([(10,)])
    opt = SparseAdamW([{"params": [p], "lr": 1e-2}], max_grad_norm=100.0)
    p.grad = torch.full((10,), 0.1)
    report = opt.step()
    assert not report.clipped
    assert report.grad_norm == pytest.approx(0.1 * math.sqrt(10), rel=1e-6)


def _kernel_ops_of_a_step(n_params: int) -> int:
    """The operators other than views that one clipped, decayed step dispatches over ``n_params`` deltas and an
    anchored router: on a GPU each is at least one kernel launch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += not func.is_view
            return func(*args, **(kwargs or {}))

    deltas, (router,) = _params([(5 + k,) for k in range(n_params)]), _params([(3, 4)])
    opt = SparseAdamW(
        [{"params": deltas, "lr": 1e-3, "weight_decay": 0.1},
         {"params": [router], "lr": 1e-3, "weight_decay": 0.1, "anchor": [router.detach().clone()]}],
        max_grad_norm=1e-3,
    )  # fmt: skip
    for step_grads in _grads(2, [p.shape for p in [*deltas, router]]):
        _set_grads([*deltas, router], step_grads)
        if opt.applied_steps:
            with Count() as counter:
                report = opt.step()
        else:
            report = opt.step()
        assert report.applied and report.clipped
    return counter.ops


def test_a_step_dispatches_as_many_operators_for_many_parameters_as_for_few():
    # A GPU step launches each operator from the host: multi-tensor ops keep the optimizer's share of a step
    # fixed, where one update per parameter dispatched about eleven per parameter (154 for 14 parameters).
    few, many = _kernel_ops_of_a_step(2), _kernel_ops_of_a_step(20)
    assert few == many
    assert few > 10  # the counter sees the step (a vacuous count would be 0 for both)


# ------------------------------------------------------------------------------ per-element steps


def test_reset_entries_take_a_fresh_first_step_while_others_continue():
    n = 24
    shapes = [(n,)]
    (values,), (ref,) = _params(shapes), _params(shapes)
    opt = SparseAdamW([{"params": [values], "lr": 1e-2}], betas=BETAS, eps=EPS)
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, betas=BETAS, eps=EPS, weight_decay=0.0, foreach=False)
    grads = _grads(5, shapes)
    for g in grads[:4]:
        _set_grads([values], g)
        _set_grads([ref], g)
        opt.step()
        torch_opt.step()

    grown = torch.tensor([1, 7, 8, 20])
    opt.reset_state(values, grown)
    state = opt.state_for(values)
    assert torch.equal(state["step"][grown], torch.zeros(4, dtype=torch.int32))
    assert (state["exp_avg"][grown] == 0).all() and (state["exp_avg_sq"][grown] == 0).all()

    # A fresh Adam on the grown entries alone, starting from their current values.
    fresh = values.detach()[grown].clone().requires_grad_()
    fresh_opt = torch.optim.AdamW([fresh], lr=1e-2, betas=BETAS, eps=EPS, weight_decay=0.0, foreach=False)
    _set_grads([values], grads[4])
    _set_grads([ref], grads[4])
    fresh.grad = grads[4][0][grown].clone()
    opt.step()
    torch_opt.step()
    fresh_opt.step()

    kept = torch.ones(n, dtype=torch.bool)
    kept[grown] = False
    assert torch.equal(values.detach()[grown], fresh.detach())
    assert torch.equal(values.detach()[kept], ref.detach()[kept])
    assert not torch.equal(values.detach()[grown], ref.detach()[grown])  # negative control
    assert opt.state_for(values)["step"].tolist() == [1 if i in grown.tolist() else 5 for i in range(n)]


def test_reset_state_accepts_a_mask():
    (p,) = _params([(3, 4)])
    opt = SparseAdamW([{"params": [p], "lr": 1e-2}])
    p.grad = torch.ones(3, 4)
    opt.step()
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[1, 2] = True
    opt.reset_state(p, mask)
    assert opt.state_for(p)["step"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 1], [1, 1, 1, 1]]


def test_remap_state_carries_kept_entries_to_new_positions():
    (old,) = _params([(10,)])
    opt = SparseAdamW([{"params": [old], "lr": 1e-2}])
    for k, g in enumerate(_grads(5, [(10,)])):
        if k == 3:
            opt.reset_state(old, torch.tensor([4]))  # so positions differ in step count too
        _set_grads([old], g)
        opt.step()
    before = {k: v.clone() for k, v in opt.state_for(old).items()}
    assert before["step"][4] == 2 and before["step"][0] == 5

    keep_src = torch.tensor([0, 4, 9])
    keep_dst = torch.tensor([2, 0, 5])
    new = torch.zeros(6, requires_grad=True)
    with pytest.raises(ValueError, match="remap_state"):
        opt.replace_param(old, new)
    opt.remap_state(old, keep_src, keep_dst, new.numel())
    opt.replace_param(old, new)
    after = opt.state_for(new)
    fresh = torch.ones(6, dtype=torch.bool)
    fresh[keep_dst] = False
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert after[key].shape == (6,)
        assert torch.equal(after[key][keep_dst], before[key][keep_src])
        assert (after[key][fresh] == 0).all()
    with pytest.raises(KeyError):
        opt.state_for(old)

    new.grad = torch.ones(6)
    opt.step()
    assert opt.state_for(new)["step"].tolist() == [3, 1, 6, 1, 1, 6]


def test_remap_state_in_place_resize():
    values = torch.nn.Parameter(torch.randn(5))
    opt = SparseAdamW([{"params": [values], "lr": 1e-2}])
    values.grad = torch.ones(5)
    opt.step()
    values.data = torch.zeros(8)
    values.grad = torch.ones(8)
    with pytest.raises(RuntimeError, match="remap_state"):
        opt.step()
    opt.remap_state(values, torch.tensor([1, 2]), torch.tensor([6, 7]), 8)
    assert opt.step().applied
    assert opt.state_for(values)["step"].tolist() == [1, 1, 1, 1, 1, 1, 2, 2]


def test_remap_state_rejects_bad_indices():
    (p,) = _params([(4,)])
    opt = SparseAdamW([{"params": [p], "lr": 1e-2}])
    with pytest.raises(ValueError, match="repeated"):
        opt.remap_state(p, torch.tensor([0, 1]), torch.tensor([2, 2]), 3)
    with pytest.raises(ValueError, match="keep_src out of range"):
        opt.remap_state(p, torch.tensor([4]), torch.tensor([0]), 3)
    with pytest.raises(ValueError, match="keep_dst out of range"):
        opt.remap_state(p, torch.tensor([0]), torch.tensor([3]), 3)


# ------------------------------------------------------------------------------ persistence


def _make(params, router, anchor):
    return SparseAdamW(
        [
            {"params": params, "lr": 1e-2, "weight_decay": 0.1, "name": "deltas"},
            {"params": [router], "lr": 1e-3, "weight_decay": 0.2, "anchor": [anchor], "name": "routers"},
        ],
        betas=BETAS,
        eps=EPS,
        max_grad_norm=1.0,
    )


def test_resume_is_bit_identical(tmp_path):
    shapes = [(40,), (12,)]
    all_grads = _grads(10, shapes + [(3, 4)], seed=5)
    anchor = torch.randn(3, 4)

    def fresh():
        return _params(shapes, seed=3), (anchor + 0.5).requires_grad_()

    def run(opt, params, router, grads, schedule, start):
        for k, g in enumerate(grads, start=start):
            schedule.apply(opt, k)
            _set_grads([*params, router], g)
            opt.step()

    # Uninterrupted.
    params, router = fresh()
    opt, sched = _make(params, router, anchor.clone()), WarmupCosine(3, 10)
    run(opt, params, router, all_grads, sched, 0)

    # Interrupted after 4 steps, with a reselection-style reset so step counts are not uniform.
    p2, r2 = fresh()
    opt2, sched2 = _make(p2, r2, anchor.clone()), WarmupCosine(3, 10)
    run(opt2, p2, r2, all_grads[:2], sched2, 0)
    opt2.reset_state(p2[0], torch.tensor([3, 5, 30]))
    opt.state_dict()  # no side effects
    run(opt2, p2, r2, all_grads[2:4], sched2, 2)
    torch.save(
        {"opt": opt2.state_dict(), "sched": sched2.state_dict(), "params": [t.detach() for t in (*p2, r2)]},
        tmp_path / "ckpt.pt",
    )
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)

    p3, r3 = fresh()
    with torch.no_grad():
        for t, saved in zip((*p3, r3), ckpt["params"]):
            t.copy_(saved)
    opt3, sched3 = _make(p3, r3, anchor.clone()), WarmupCosine(1, 2)
    opt3.load_state_dict(ckpt["opt"])
    sched3.load_state_dict(ckpt["sched"])
    assert sched3.last_step == 3
    run(opt3, p3, r3, all_grads[4:], sched3, 4)

    # Reference for the resumed run: the same interrupted history without the save/load.
    run(opt2, p2, r2, all_grads[4:], sched2, 4)
    assert _bit_equal(_snapshot(opt3, [*p3, r3]), _snapshot(opt2, [*p2, r2]))
    assert [g["lr"] for g in opt3.param_groups] == [g["lr"] for g in opt2.param_groups]
    assert opt3.applied_steps == opt2.applied_steps == 10
    # Negative control: the reset changed the trajectory, so the check above could fail.
    assert not torch.equal(p2[0], params[0])

    # And with no reset, resume equals the uninterrupted run.
    p4, r4 = fresh()
    opt4, sched4 = _make(p4, r4, anchor.clone()), WarmupCosine(3, 10)
    run(opt4, p4, r4, all_grads[:4], sched4, 0)
    blob = torch.load(_save(tmp_path / "b.pt", opt4.state_dict()), weights_only=True)
    p5 = [t.detach().clone().requires_grad_() for t in p4]
    r5 = r4.detach().clone().requires_grad_()
    opt5 = _make(p5, r5, anchor.clone())
    opt5.load_state_dict(blob)
    run(opt5, p5, r5, all_grads[4:], sched4, 4)
    assert _bit_equal(_snapshot(opt5, [*p5, r5]), _snapshot(opt, [*params, router]))


def _save(path, obj):
    torch.save(obj, path)
    return path


def test_load_state_dict_rejects_mismatches_without_changing_anything():
    (p,) = _params([(6,)])
    opt = SparseAdamW([{"params": [p], "lr": 1e-2, "name": "deltas"}])
    p.grad = torch.ones(6)
    opt.step()
    saved = opt.state_dict()

    (q,) = _params([(5,)])
    other = SparseAdamW([{"params": [q], "lr": 1e-2, "name": "deltas"}])
    before = _snapshot(other, [q])
    with pytest.raises(ValueError, match="5"):
        other.load_state_dict(saved)
    renamed = SparseAdamW([{"params": [torch.zeros(6, requires_grad=True)], "lr": 1e-2, "name": "routers"}])
    with pytest.raises(ValueError, match="do not match"):
        renamed.load_state_dict(saved)
    assert _bit_equal(_snapshot(other, [q]), before) and other.applied_steps == 0


def test_state_bytes():
    params = _params([(100,), (10, 10)])
    anchor = torch.zeros(7)
    router = torch.ones(7, requires_grad=True)
    opt = SparseAdamW([{"params": params, "lr": 1e-2}, {"params": [router], "lr": 1e-3, "anchor": [anchor]}])
    assert opt.state_bytes() == 207 * (4 + 4 + 4)
    assert opt.state_bytes(include_anchors=True) == 207 * 12 + 7 * 4


# ------------------------------------------------------------------------------ schedule


def test_warmup_cosine_values():
    s = WarmupCosine(warmup_steps=10, total_steps=110, min_lr_ratio=0.1, peak_lr=2e-4)
    assert s.lr_at(0) == 0.0
    assert s.lr_at(5) == pytest.approx(1e-4)
    assert s.lr_at(10) == pytest.approx(2e-4)
    assert s.lr_at(60) == pytest.approx(2e-4 * (0.1 + 0.9 * 0.5))  # halfway through the cosine
    assert s.lr_at(110) == pytest.approx(2e-5)
    assert s.lr_at(500) == pytest.approx(2e-5)
    assert WarmupCosine(0, 10).factor(0) == 1.0
    with pytest.raises(ValueError):
        WarmupCosine(20, 10)


def test_warmup_cosine_apply_keeps_each_groups_peak():
    a, b = _params([(3,), (3,)])
    opt = SparseAdamW([{"params": [a], "lr": 1e-3}, {"params": [b], "lr": 1e-5}])
    sched = WarmupCosine(4, 20, min_lr_ratio=0.0)
    assert sched.apply(opt, 2) == 0.5
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-4, 5e-6])
    sched.apply(opt, 4)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-3, 1e-5])
    sched.apply(opt, 20)
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    # A plain torch optimizer records its lr as the peak on first use.
    torch_opt = torch.optim.SGD([a], lr=0.2)
    sched.apply(torch_opt, 2)
    sched.apply(torch_opt, 4)
    assert torch_opt.param_groups[0]["lr"] == pytest.approx(0.2)
