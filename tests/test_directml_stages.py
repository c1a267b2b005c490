"""The stages around the engine with the device's index ops off, and every op DirectML rejects made to raise.

``usaf score`` (dense scores, mask selection, the prefix store of ``--cache``), ``usaf train`` (fp16 with loss
scaling, clipping, metrics, RigL reselections, a checkpoint, an interruption and the resume, the held-out
loss) and ``usaf eval`` run end to end in-process, on a tiny qwen3_moe, with the CPU backend declaring
``index_ops=False`` (what the DirectML backend declares) and a dispatch mode that raises on the aten ops
torch-directml rejects.

Everything runs on the CPU here, so the host-side work usaf moves off the device where index ops are
missing (score accumulators, reselection's index arithmetic, the frozen record, Adam state surgery) would
trip a naive guard. The guard therefore allows a rejected op only when the innermost Python frame outside
torch that issued it is one of the functions in ``HOST_SIDE``, each checked by reading the code to compute
on ``torch.device("cpu")`` when the device lacks index ops. A callee of an allowlisted function (usaf's or
anyone's) is judged by its own frame, so the list never covers more than the listed function bodies.

Not checked here: a DirectML GPU (none exists here), ops that a kernel issues internally (the guard sees the
dispatcher's top-level calls only), ``--stream-experts``, several processes.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import TRANSFORMERS_V5
from helpers import invoke
from usaf.testing import stdlib_dir

# aten ops torch-directml rejects ("partially modified dimensions"), by overload packet name; the same list
# as tests/test_directml.py
REJECTED = ("nonzero", "index_add", "scatter", "scatter_add", "scatter_reduce", "index_put", "_unsafe_index_put")
REJECTED += ("one_hot", "masked_scatter", "index_copy")

# Host-side functions allowed to run rejected ops: (module, qualname) of the frame that issues the op.
# Each was checked by reading it: with index_ops=False every tensor it indexes is on torch.device("cpu").
HOST_SIDE = {
    # index_put_ / scatter_reduce_ on the pool's segments: _adopt puts the pool on the CPU when
    # device_capabilities(grad.device).index_ops is False (scores.py ScoreAccumulator._adopt); `keep`,
    # `dropped` and the segment sizes are allocated on scores.device. (An add itself, _add_to_pool, issues no
    # rejected op: its nonzero is numpy's in host memory, engine/selection_ops.py.)
    ("usaf.engine.scores", "ScoreAccumulator._evict"),
    # nonzero on `scores`, `indices` of its caller: the pool (CPU, see above) from top(), and the reselection's
    # candidates and delta values, both at `where` (the CPU without index ops; reselect.py _reselect_tensor).
    ("usaf.engine.scores", "best_by_score"),
    # unique + index_add_ on the frozen record: `device = ... if self.index_ops ... else torch.device("cpu")`,
    # inputs moved there first (trainable.py TrainableTensor.fold).
    ("usaf.engine.trainable", "TrainableTensor.fold"),
    # without index ops: index_put_ into a host copy of one expert's (O, I) slice (`block`, made with
    # .to(device) where device is the CPU), copied back into the resident base whole with copy_ (no index op).
    ("usaf.engine.experts", "ExpertWeight._write_frozen"),
    # new_values[keep_dst] = ...: `where = ... if weight.index_ops else torch.device("cpu")`; old, values,
    # ranked are moved there (reselect.py _reselect_tensor). Its callees (fold, reindex, remap_state) are
    # judged by their own frames.
    ("usaf.engine.reselect", "_reselect_tensor"),
    # unique + index_add_ of frozen record and active delta: on the CPU when weight.index_ops is False
    # (fixed by this audit: it ran on the delta's device, at every checkpoint write).
    ("usaf.engine.reselect", "cumulative_delta"),
    # dst[keep_dst] = ...: `where = device if device_capabilities(device).index_ops else torch.device("cpu")`,
    # fresh state built there, moved to the device afterwards (optim.py SparseAdamW.remap_state).
    ("usaf.engine.optim", "SparseAdamW.remap_state"),
}
if not TRANSFORMERS_V5:  # where attention targets train index-free (see TARGETS below)
    # without index ops: index_put_ into a host copy of the linear target's weight (`edited`, made with
    # .to("cpu", copy=True)), copied back whole with copy_ (linear_target.py LinearTarget._write_frozen).
    HOST_SIDE.add(("usaf.engine.linear_target", "LinearTarget._write_frozen"))


class Forbidden(RuntimeError):
    pass


def _issuer() -> tuple[str, str, int]:
    """(module, qualname, line) of the innermost Python frame outside torch (and outside this guard)."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        inside_guard = module == __name__ and frame.f_code.co_qualname in _GUARD_FRAMES
        if not (module == "torch" or module.startswith("torch.") or inside_guard):
            return module, frame.f_code.co_qualname, frame.f_lineno
        frame = frame.f_back
    return "", "", 0  # only C++ frames: e.g. an autograd node run with no Python caller


class RejectedOpGuard(TorchDispatchMode):
    """Raise on every rejected aten op, unless the frame that issued it is in ``allowed``.

    Every violation is also recorded (the CLI turns the exception into an exit status and a message), and
    every allowed op with its issuer (to check that each allowlisted entry is needed).
    """

    def __init__(self, allowed=HOST_SIDE):
        super().__init__()
        self.allowed = frozenset(allowed)
        self.violations: list[str] = []
        self.used: dict[tuple[str, str], int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1].rstrip("_")
        if name in REJECTED or name.lstrip("_") in REJECTED:
            module, qualname, line = _issuer()
            if (module, qualname) in self.allowed:
                self.used[(module, qualname)] = self.used.get((module, qualname), 0) + 1
            else:
                node = torch._C._current_autograd_node()
                where = f"{module}:{qualname}:{line}" + (f" (backward of {node.name()})" if node is not None else "")
                self.violations.append(f"{func} from {where}")
                raise Forbidden(f"{func} from {where} (DirectML rejects it)")
        return func(*args, **(kwargs or {}))


_GUARD_FRAMES = ("RejectedOpGuard.__torch_dispatch__", "_issuer")


@pytest.fixture
def no_index_ops(monkeypatch):
    """The CPU backend declares index_ops=False (and DirectML's transfer flags), wherever capabilities are looked up.

    Lookups: the backend's ``capabilities`` (resolve_backend -> cpu.create -> cpu.capabilities()) and
    ``usaf.backends.transfer.device_capabilities`` (imported by name into engine.loading, engine.optim,
    engine.scores), whose cache calls cpu.capabilities(): patching that one function and clearing the
    cache changes all of them. LayerExperts.set_index_ops is spied on to show what the loader applied.
    """
    from usaf.backends import cpu, resolve_backend, transfer
    from usaf.engine.experts import LayerExperts

    real = cpu.capabilities
    # DirectML's other flags too: .to(device, dtype) in two calls, safetensors read on the host
    directml_like = {"index_ops": False, "to_device_and_dtype": False, "direct_load": False}
    monkeypatch.setattr(cpu, "capabilities", lambda: dataclasses.replace(real(), **directml_like))
    applied = []
    real_set = LayerExperts.set_index_ops
    monkeypatch.setattr(LayerExperts, "set_index_ops", lambda self, a: (applied.append(a), real_set(self, a))[1])
    transfer.clear_cache()
    assert not resolve_backend("cpu").capabilities.index_ops and not transfer.device_capabilities("cpu").index_ops
    yield applied
    transfer.clear_cache()


# transformers >= 5 routes with its own code, where topk's backward is a scatter whenever the router's input
# needs a gradient: router training off and only the last MoE layer trainable there. The DirectML
# configuration runs transformers 4.x, where usaf's block forward routes without a scatter: routers train
# and layers 1-2 train (gradients flow through layer 2's routing into layer 1).
TRAIN_FROM = 2 if TRANSFORMERS_V5 else 1
ROUTER = ["--no-router"] if TRANSFORMERS_V5 else ["--router"]
# and on 4.x the attention trains too (on 5.x its gradient would reach the MoE block's routing: the scatter above,
# so the experts alone, not the default experts + attention)
TARGETS = ["--targets", "experts"] if TRANSFORMERS_V5 else ["--targets", "experts,attention"]


@pytest.fixture(scope="module")
def inputs(quantized, tmp_path_factory):
    root = tmp_path_factory.mktemp("dml-stages")
    qdir = quantized("qwen3_moe", num_layers=3, tokenizer=True)
    tokens = root / "tokens"
    result = invoke("tokenize", stdlib_dir() / "textwrap.py", stdlib_dir() / "shlex.py", "--model", qdir,
                    "--seq-len", 32, "--held-out", "shlex.py", "--out", tokens)  # fmt: skip
    assert result.exit_code == 0, result.output
    return qdir, tokens


def score(qdir, tokens, out, *extra):
    args = ["--frac", 0.05, "--calib-samples", 8, "--train-from", TRAIN_FROM, *ROUTER, *TARGETS, "--no-stability"]
    return invoke("score", "--model", qdir, "--data", tokens, *args, "--out", out, "--device", "cpu", *extra)


def train(qdir, tokens, plan, out, *extra):
    args = ["--lr", 0.05, *ROUTER, *([] if TRANSFORMERS_V5 else ["--router-lr", 0.01]), "--dtype", "float16"]
    args += ["--steps", 12, "--reselect-every", 4, "--reselect-fraction", 0.3, "--save-every", 4]
    args += ["--eval-data", tokens, "--eval-every", 6]
    return invoke("train", "--model", qdir, "--data", tokens, "--plan", plan, "--out", out, "--device", "cpu",
                  *args, *extra)  # fmt: skip


def evaluate(qdir, tokens, run, out):
    return invoke("eval", "--model", qdir, "--checkpoint", run, "--data", tokens, "--held-out", tokens,
                  "--workspace", out.parent / "ws", "--out", out, "--no-plots", "--device", "cpu")  # fmt: skip


def guarded(call, *args, status: int = 0):
    """Run a stage under the guard; the guard (its ``used``) and the CLI's result."""
    guard = RejectedOpGuard()
    with guard:
        result = call(*args)
    assert not guard.violations, "\n".join(guard.violations)
    assert result.exit_code == status, result.output
    return guard, result


def test_score_train_reselect_checkpoint_resume_and_eval_avoid_rejected_ops(
    inputs, no_index_ops, tmp_path, monkeypatch
):
    from usaf.artifacts import RunManifest, load_verified
    from usaf.stages.train import trainer

    qdir, tokens = inputs
    used: set[tuple[str, str]] = set()
    plan = tmp_path / "plan"
    guard, _ = guarded(score, qdir, tokens, plan, "--cache")  # dense scores, mask selection, the prefix store
    used |= set(guard.used)
    assert no_index_ops and not any(no_index_ops)  # the loader applied the device's flag to every layer

    # train (fp16: loss scaling): interrupted inside the scoring window of the reselection at step 8, so its
    # checkpoint carries the collected scores; then resumed by the same command
    real_step = trainer.Trainer.step

    def interrupt(self):
        if self.state.step == 7:
            raise KeyboardInterrupt
        return real_step(self)

    run = tmp_path / "run"
    monkeypatch.setattr(trainer.Trainer, "step", interrupt)
    guard, _ = guarded(train, qdir, tokens, plan, run, status=130)
    used |= set(guard.used)
    assert (run / "checkpoints" / "step-0000007").is_dir()
    monkeypatch.setattr(trainer.Trainer, "step", real_step)
    guard, result = guarded(train, qdir, tokens, plan, run)
    used |= set(guard.used)
    assert "resuming from" in result.stderr and "prefix states" in result.stderr
    manifest = load_verified(run, RunManifest)
    s = manifest.summary
    assert manifest.environment.dtype == "float16" and len(s.reselections) == 2 and s.frozen_entries > 0
    assert all(r.grown > 0 for r in s.reselections) and [step for step, _ in s.eval_losses] == [0, 6, 12]

    report = tmp_path / "report"
    guard, _ = guarded(evaluate, qdir, tokens, run, report)
    used |= set(guard.used)
    assert json.loads((report / "report.json").read_text())["rows"]
    assert set(used) == HOST_SIDE, sorted(HOST_SIDE - used)  # every allowlisted function was needed


# -- controls ----------------------------------------------------------------------------------------------


def test_with_index_ops_on_the_same_stages_trip_the_guard(inputs, tmp_path):
    """Negative control: the CPU's own flags (index_ops=True) take the default paths, which the guard stops."""
    from usaf.backends import transfer

    transfer.clear_cache()
    assert transfer.device_capabilities("cpu").index_ops
    qdir, tokens = inputs
    plan, run = tmp_path / "plan", tmp_path / "run"
    assert score(qdir, tokens, plan).exit_code == 0  # unguarded: the inputs of the guarded train and eval
    short = ("--steps", 4, "--reselect-every", 2, "--save-every", 0, "--eval-every", 0)  # one reselection, at step 2
    assert train(qdir, tokens, plan, run, *short).exit_code == 0
    stages = {
        "score": (score, qdir, tokens, tmp_path / "plan2"),
        "train": (train, qdir, tokens, plan, tmp_path / "run2", *short),
        "eval": (evaluate, qdir, tokens, run, tmp_path / "report"),
    }
    for stage, (call, *args) in stages.items():
        guard = RejectedOpGuard()
        with guard:
            result = call(*args)
        assert guard.violations and result.exit_code != 0, stage
        assert isinstance(result.exception, Forbidden) or "DirectML rejects it" in result.output, (stage, result)


def test_an_allowlisted_function_hides_no_op_outside_it(monkeypatch):
    from usaf.engine import scores as scores_module
    from usaf.engine.scores import ScoreAccumulator

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(3, 4, generator=g) for _ in range(6)]
    # an op outside every allowlisted function
    with pytest.raises(Forbidden), RejectedOpGuard():
        torch.zeros(3).index_add_(0, torch.tensor([0]), torch.ones(1))
    # the allowlisted pool bookkeeping itself (on CPU tensors) is allowed
    acc = ScoreAccumulator((2, 3, 4), 3)
    guard = RejectedOpGuard()
    with guard:
        for i, grad in enumerate(grads):
            acc.add(i % 2, grad)
    assert guard.used.get(("usaf.engine.scores", "ScoreAccumulator._evict")) and not guard.violations
    # a callee of an allowlisted function is judged by its own frame: not covered by the caller's entry
    real_kth = scores_module.kth_smallest

    def kth_smallest(values, k):
        torch.zeros(1).index_add_(0, torch.tensor([0]), torch.ones(1))
        return real_kth(values, k)

    monkeypatch.setattr(scores_module, "kth_smallest", kth_smallest)
    acc = ScoreAccumulator((2, 3, 4), 3)
    guard = RejectedOpGuard()
    with pytest.raises(Forbidden), guard:
        for i, grad in enumerate(grads):
            acc.add(i % 2, grad)
    # the op is charged to the callee's frame, though _evict (allowlisted) called it
    assert len(guard.violations) == 1 and "kth_smallest" in guard.violations[0], guard.violations


def test_host_side_entries_name_existing_functions():
    for module, qualname in HOST_SIDE:
        target = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
        assert callable(target) and target.__qualname__ == qualname, (module, qualname)


def test_cumulative_delta_without_index_ops_equals_the_default(quantized):
    """The fix found by this audit: checkpoints' cumulative delta is summed on the host without index ops,
    bit for bit what the default path sums (frozen record and active delta overlapping)."""
    from helpers_engine import make_engine, random_selection
    from usaf.engine.reselect import cumulative_delta

    engine = make_engine(quantized, "qwen3_moe")
    engine.set_deltas(random_selection(engine, frac=0.05))
    g = torch.Generator().manual_seed(1)
    for weight in engine.weights.values():
        with torch.no_grad():
            weight.delta.values.copy_(torch.randn(weight.delta.values.shape, generator=g))
        active = weight.delta.indices
        dropped = torch.randperm(weight.shape[0] * weight.shape[1] * weight.shape[2], generator=g)[:40]
        weight.fold(torch.cat([active[:10], dropped]), torch.randn(50, generator=g))  # 10 overlap the active set
        default = cumulative_delta(weight)
        weight.index_ops = False
        with RejectedOpGuard(allowed={("usaf.engine.reselect", "cumulative_delta")}):
            host = cumulative_delta(weight)
        weight.index_ops = True
        assert host[0].device == host[1].device == torch.device("cpu")
        assert torch.equal(host[0], default[0]) and torch.equal(host[1], default[1])
        assert default[0].numel() == active.numel() + 40 - int(torch.isin(dropped, active).sum())
