"""``usaf score``'s learning-rate test: a few short probe runs that pick the lr ``usaf train`` will use.

No fixed lr transfers between domains (docs/ARCHITECTURE.md, "Defaults set by the evidence benchmark"): on the demo
model the best swept lr was 3e-3 for a small shift (standard-library network modules) and 10x that for a large one
(C++ headers). So score, which already holds the engine, the masks and a calibration sample, trains the plan's
masks briefly at each of a few log-spaced candidate lrs and scores every probe on a held-back part of the sample,
sequence by sequence. It takes the smallest lr whose held-back loss is within one standard error of the lowest
(:func:`choose_lr_within_noise`): a larger lr has to be better by more than the held-back sequences disagree.

Each probe is the real training machinery: the engine with the plan's masks as fresh (zero) deltas, the routers
as train has them (restored to their pretrained weights before each probe), :class:`SparseAdamW` with train's
clipping and router lr, the engine's loss, one microbatch per step. Nothing is left on the engine: the deltas are
removed, the routers restored, the gradients and expert-load counters cleared.

Every probe's first step is the same forward and backward (the base model, the routers' pretrained weights, the same
microbatch), so it runs once: the later probes start from a copy of its gradients and differ from there on, in their
optimizer step. The same bits as running it again (:class:`FirstStep`), a step fewer per probe after the first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from usaf.data.batches import Batch, collate
from usaf.data.tokens import scored_targets
from usaf.engine.optim import SparseAdamW
from usaf.engine.prefix import padded_states
from usaf.settings.train import DEFAULT_ROUTER_LR

# Log-spaced by ~3: the evidence benchmark's grid (3e-3, 1e-2, 3e-2) and its lower extension. Not 1e-1: every sweep
# preferred 3e-2 to 9e-2, while a 16-step probe sometimes preferred 1e-1 (a short run rewards a large lr).
CANDIDATES = (1e-3, 3e-3, 1e-2, 3e-2)
ROUTER_LR = DEFAULT_ROUTER_LR  # usaf train's --router-lr default: the probes train the routers as train will
CLIP = 1.0  # usaf train's --clip default
HOLD_BACK = 4  # every 4th source file of the calibration sample is held back to score the probes (see split)
RULE = "the smallest lr within one standard error of the lowest held-back loss, below any divergence"


@dataclass(frozen=True)
class HeldOut:
    """A probe's held-back score, per held-back sequence: summed cross-entropy and scored tokens, ``(n,)`` float64."""

    nll: torch.Tensor
    tokens: torch.Tensor

    @property
    def loss(self) -> float:
        """Token-weighted cross-entropy over every held-back sequence."""
        return float(self.nll.sum() / self.tokens.sum().clamp(min=1))


@dataclass(frozen=True)
class LrTestResult:
    """What the test measured and chose (``losses[i]``: held-back loss after the probe at ``candidates[i]``;
    ``gap_se[i]``: the standard error of its gap to the lowest; None where the probe diverged or is past a
    divergence)."""

    lr: float
    candidates: list[float]
    losses: list[float | None]
    gap_se: list[float | None]
    base_loss: float
    steps: int  # optimizer steps over the probes that ran
    seconds: float
    probes_run: int  # by ascending lr; the larger ones were past a divergence (:func:`run_probes`)


def choose_lr(base_loss: float, candidates: list[float], losses: list[float | None]) -> float:
    """The candidate whose probe ended with the lowest held-back loss (the smaller lr on a tie).

    The safeguard: no candidate at or above the first one that diverged (a non-finite loss, or a held-back loss
    above the untrained model's) is eligible, even if its probe happened to end low: past a divergence the
    probes measure luck. When nothing is eligible, the smallest candidate.
    """
    eligible = _eligible(base_loss, candidates, losses)
    return min((losses[i], candidates[i]) for i in eligible)[1] if eligible else min(candidates)


def choose_lr_within_noise(
    base_loss: float, candidates: list[float], heldout: list[HeldOut | None]
) -> tuple[float, list[float | None]]:
    """``(lr, gap_se)``: the smallest eligible candidate whose held-back loss is within one standard error of the
    lowest one's (:func:`choose_lr`'s choice), the one-standard-error rule of model selection.

    The gap's standard error is over the held-back sequences, paired (:func:`paired_gap`): the two probes scored
    on the same sequences. Why: a larger lr that ends lower by less than the sequences' own disagreement about
    which probe is better is a near tie that the calibration's batch order decides, and the smaller lr moves the
    model less (on the second evidence model a 0.002-nat tie on torch-cpp flipped to 3e-2, which forgot 78 PPL of
    the pretraining text instead of 58 for no in-domain gain: docs/BENCHMARKS.md, "The lr test's noise rule").
    ``gap_se[i]`` is None where the probe is not eligible.
    """
    losses = [None if h is None else h.loss for h in heldout]
    eligible = _eligible(base_loss, candidates, losses)
    if not eligible:
        return min(candidates), [None] * len(candidates)
    lowest = min(eligible, key=lambda i: (losses[i], candidates[i]))
    gap_se: list[float | None] = [None] * len(candidates)
    chosen = None
    for i in eligible:  # ascending lr
        gap, se = paired_gap(heldout[i], heldout[lowest])
        gap_se[i] = se
        if chosen is None and gap <= se:
            chosen = i
    return candidates[chosen if chosen is not None else lowest], gap_se


def paired_gap(a: HeldOut, b: HeldOut) -> tuple[float, float]:
    """``(gap, se)``: ``a.loss - b.loss`` and its standard error over the sequences both scored.

    The gap is a token-weighted mean of per-sequence gaps ``d_i`` (weights ``w_i``: each sequence's share of the
    tokens); its standard error is ``sqrt(n / (n - 1) * sum(w_i^2 (d_i - gap)^2))``, 0 with fewer than two
    sequences (no estimate: the rule then takes the lowest loss).
    """
    d = (a.nll - b.nll) / a.tokens.clamp(min=1)  # (n,) per-token gap of each sequence
    w = a.tokens / a.tokens.sum().clamp(min=1)  # a sequence with no scored token weighs nothing
    gap = float((w * d).sum())
    n = d.numel()
    if n < 2:
        return gap, 0.0
    return gap, float(torch.sqrt(n / (n - 1) * (w.square() * (d - gap).square()).sum()))


def _eligible(base_loss: float, candidates: list[float], losses: list[float | None]) -> list[int]:
    """Indices of the candidates below the first divergence, by ascending lr."""
    eligible = []
    for i in sorted(range(len(candidates)), key=lambda i: candidates[i]):
        if divergence(base_loss, losses[i]) is not None:
            break
        eligible.append(i)
    return eligible


def divergence(base_loss: float, loss: float | None) -> str | None:
    """How a probe that ran with held-back ``loss`` diverged, in words, or None where it did not."""
    if loss is None or not math.isfinite(loss):
        return "its loss was not finite"
    if loss > base_loss:
        return "it ended above the untrained held-back loss"
    return None


def first_divergence(base_loss: float, candidates: list[float], losses: list[float | None]) -> str | None:
    """The smallest lr whose probe diverged and how (``"3e-3: it ended above ..."``), or None: why the test did
    not run the larger ones, in the words a user reads (a loss a little above the untrained one is a divergence by
    this test's rule, not a blow-up)."""
    for i in sorted(range(len(candidates)), key=lambda i: candidates[i]):
        how = divergence(base_loss, losses[i])
        if how is not None:
            return f"{candidates[i]:g}: {how}"
    return None


def run_lr_test(
    engine: Any,
    masks: dict[str, torch.Tensor],
    lines: list,
    *,
    microbatch: int,
    pad_id: int,
    steps: int,
    candidates: tuple[float, ...] = CANDIDATES,
    states: Mapping[int, torch.Tensor] | None = None,
    on_step: Callable[[float], None] | None = None,
    done: Sequence[HeldOut | None] = (),
    on_probe: Callable[[list[HeldOut | None]], None] | None = None,
) -> LrTestResult:
    """Probe ``steps`` optimizer steps at each candidate lr on the calibration ``lines`` less the held-back ones
    (:func:`split`), score each probe on those, sequence by sequence, and choose (:func:`choose_lr_within_noise`).
    The probes run by ascending lr and stop at the first that diverges (:func:`run_probes`).

    ``states``: the lines' frozen-prefix states ``(t, H)`` by line number (``TokenLine.line``), as score's
    calibration pass recorded them; a microbatch with a line missing there computes its own. ``on_step(lr)``:
    called after each probe step (score's progress bar; an exception it raises stops the test, the probe
    unfinished). ``done``: the first probes' held-back scores, by ascending lr, from an interrupted test (not run
    again: the same bits, as every probe starts from the base model); ``on_probe(scores)``: called after each probe
    that runs with every score so far, by ascending lr (score saves them).
    """
    start = time.perf_counter()
    train_lines, held_lines = split(lines)
    train = _with_prefix(engine, train_lines, microbatch, pad_id, states)
    held = _with_prefix(engine, held_lines, 1, pad_id, states)  # one sequence each: the rule's per-sequence gaps
    first = FirstStep()
    try:
        base = _heldout(engine, held).loss
        probe = lambda lr: _probe(engine, masks, train, held, lr, steps, first, on_step)  # noqa: E731
        heldout = run_probes(base, candidates, probe, done=done, on_probe=on_probe)
    finally:
        _restore(engine)
    lr, gap_se = choose_lr_within_noise(base, list(candidates), heldout)
    losses = [None if h is None else h.loss for h in heldout]
    ran = probes_run(base, candidates, losses)
    seconds = time.perf_counter() - start
    return LrTestResult(lr, list(candidates), losses, gap_se, base, steps * ran, seconds, ran)


def run_probes(
    base_loss: float,
    candidates: tuple[float, ...],
    probe: Callable[[float], HeldOut | None],
    *,
    done: Sequence[HeldOut | None] = (),
    on_probe: Callable[[list[HeldOut | None]], None] | None = None,
) -> list[HeldOut | None]:
    """``probe(lr)`` of each candidate by ascending lr, up to the first that diverges (None, or a held-back loss
    above the untrained model's ``base_loss``); None for the candidates after it, which are not run. The first
    ``len(done)`` (by ascending lr) are ``done``'s, not run again; ``on_probe`` sees the scores after each probe run.

    Nothing at or above a divergence is eligible (:func:`choose_lr`), so their probes could not change the choice:
    skipping them gives the same lr, and saves a quarter of the test per candidate skipped.
    """
    heldout: list[HeldOut | None] = [None] * len(candidates)
    ascending = sorted(range(len(candidates)), key=lambda i: candidates[i])
    if len(done) > len(ascending):
        raise ValueError(f"{len(done)} probes done, of {len(ascending)} candidates")
    for rank, i in enumerate(ascending):
        if rank < len(done):
            heldout[i] = done[rank]
        else:
            heldout[i] = probe(candidates[i])
            if on_probe is not None:
                on_probe([heldout[j] for j in ascending[: rank + 1]])
        if divergence(base_loss, None if heldout[i] is None else heldout[i].loss) is not None:
            break
    return heldout


def probes_run(base_loss: float, candidates: list[float] | tuple[float, ...], losses: list[float | None]) -> int:
    """How many probes :func:`run_probes` ran, by ascending lr: those up to and including the first divergence."""
    return min(len(_eligible(base_loss, list(candidates), losses)) + 1, len(candidates))


def cannot_measure(lines: list) -> str | None:
    """Why the test would choose from nothing it measured on these calibration lines, or None: the held-back lines
    are the probes' own (too few lines or sources to hold any back), or hold no token to score (found in review: a
    sweep then picked an lr by memorization, or among equal zero losses, and train used it as measured)."""
    train, held = split(lines)
    if train is held:
        return f"{len(lines)} calibration line{'s' if len(lines) != 1 else ''} of one source: none to hold back"
    if not any(scored_targets(line.labels) for line in held):
        return "the held-back lines hold no token to score (every label -100)"
    return None


def measured(result: LrTestResult) -> bool:
    """Whether some probe ran below divergence: else the test's lr is the smallest candidate, a fallback."""
    return bool(_eligible(result.base_loss, result.candidates, result.losses))


def recorded_measured(record: Any) -> bool:
    """:func:`measured` of a plan's :class:`usaf.artifacts.plan.LrTestRecord`."""
    return bool(_eligible(record.base_loss, record.candidates, record.heldout_losses))


def split(lines: list) -> tuple[list, list]:
    """(probe lines, held-back lines): every ``HOLD_BACK``-th *source* of the sample held back, so the held-back
    loss rewards what transfers to other files of the domain, not what memorizes the probed files' own names (a
    long run at a large lr does the latter: on the evidence benchmark it kept lowering the training sources' loss
    while the held-out sources' rose). With fewer than two sources, every ``HOLD_BACK``-th line; one line is both."""
    sources = list(dict.fromkeys(line.source for line in lines))  # in order of first appearance: deterministic
    if len(sources) >= 2:
        held_sources = set(sources[HOLD_BACK - 1 :: HOLD_BACK]) or {sources[-1]}
        held = [line for line in lines if line.source in held_sources]
        return [line for line in lines if line.source not in held_sources], held
    held = [line for i, line in enumerate(lines) if i % HOLD_BACK == HOLD_BACK - 1]
    train = [line for i, line in enumerate(lines) if i % HOLD_BACK != HOLD_BACK - 1]
    return train or held, held or train


Prefix = torch.Tensor | list[torch.Tensor] | None  # a microbatch's states (B, T, H), or its lines' (t_i, H) to pad


def _with_prefix(
    engine: Any, lines: list, microbatch: int, pad_id: int, states: Mapping[int, torch.Tensor] | None
) -> list[tuple[Batch, Prefix]]:
    """Each microbatch of ``lines`` on the engine's device, with its frozen-prefix states: ``states``' lines where it
    has every line of the microbatch (padded at each use: a padded copy held for the whole test doubled the sample's
    states in memory, which score's memory plan counts once), else ``(B, T, H)`` computed once here (the prefix is
    frozen: every probe would recompute the same states). They are kept in host memory, as train's prefix cache
    keeps them (the sample's states at a large model's width would otherwise hold device memory)."""
    device = engine.device
    out = []
    for first in range(0, len(lines), microbatch):
        group = lines[first : first + microbatch]
        b = collate(group, pad_id)
        b = Batch(b.input_ids.to(device), b.labels.to(device), b.attention_mask.to(device))
        prefix: Prefix = None
        if engine.prefix is not None and states is not None and all(line.line in states for line in group):
            prefix = [states[line.line] for line in group]  # references: no copy
        elif engine.prefix is not None:
            prefix = engine.prefix_states(b.input_ids, b.attention_mask).cpu()
        out.append((b, prefix))
    return out


def _on_device(prefix: Prefix, batch: Batch) -> torch.Tensor | None:
    """A microbatch's states ``(B, T, H)`` on its device, padded here where they are its lines'."""
    if isinstance(prefix, list):
        prefix = padded_states(prefix, batch.input_ids.shape[1])
    return None if prefix is None else prefix.to(batch.input_ids.device)


@dataclass
class FirstStep:
    """The probes' common first step: its gradients by parameter (the order of ``engine.parameter_groups``), once
    a probe has computed them, and whether its loss was finite.

    Why sharing is exact: a probe starts from the state :func:`_restore` leaves (no deltas, the routers' pretrained
    weights, no gradients, no load counts) plus zero deltas on the same masks, and takes the same first microbatch,
    so its first forward and backward give every probe the same gradients. Nothing of the step but the gradients
    reaches the optimizer, and the optimizer does not write into them (clipping scales copies); they are copied in
    all the same.
    """

    taken: bool = False  # a probe has run the step
    finite: bool = True
    grads: list[torch.Tensor | None] | None = None  # None where the loss was not finite


def _probe(
    engine: Any,
    masks: dict,
    train: list,
    held: list,
    lr: float,
    steps: int,
    first: FirstStep | None = None,
    on_step: Callable[[float], None] | None = None,
) -> HeldOut | None:
    """Train fresh deltas (and the routers, from their pretrained weights) ``steps`` steps at ``lr``; the
    held-back score after, or None when a step's loss (or the held-back loss) was not finite. ``first``: the
    first step's gradients, shared between the probes of one test (filled by the first probe that runs)."""
    _restore(engine)
    engine.set_deltas(masks)  # zero values: the probe starts from the base model, as a run does
    groups = engine.parameter_groups(lr=lr, router_lr=ROUTER_LR, weight_decay=0.0)
    params = [p for group in groups for p in group["params"]]
    optimizer = SparseAdamW(groups, max_grad_norm=CLIP)
    for step in range(steps):
        optimizer.zero_grad()
        if step == 0 and first is not None and first.taken:
            if not first.finite:
                return None
            for p, grad in zip(params, first.grads, strict=True):
                p.grad = None if grad is None else grad.clone()
        else:
            batch, prefix = train[step % len(train)]
            states = _on_device(prefix, batch)
            parts = engine.loss(batch.input_ids, batch.labels, batch.attention_mask, prefix_states=states)
            finite = bool(torch.isfinite(parts.loss.detach()))
            if step == 0 and first is not None:
                first.taken, first.finite = True, finite
            if not finite:
                return None
            parts.loss.backward()
            if step == 0 and first is not None:
                first.grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
        optimizer.step()  # skips a step with a non-finite gradient, as train does
        if on_step is not None:
            on_step(lr)
    scored = _heldout(engine, held)
    return scored if math.isfinite(scored.loss) else None


@torch.no_grad()
def _heldout(engine: Any, held: list) -> HeldOut:
    """The engine's cross-entropy on each held-back microbatch (one sequence each), summed over its tokens."""
    nll, tokens = [], []
    for batch, prefix in held:
        states = _on_device(prefix, batch)
        parts = engine.loss(batch.input_ids, batch.labels, batch.attention_mask, prefix_states=states)
        nll.append(float(parts.ce) * parts.tokens)
        tokens.append(float(parts.tokens))
    return HeldOut(torch.tensor(nll, dtype=torch.float64), torch.tensor(tokens, dtype=torch.float64))


@torch.no_grad()
def _restore(engine: Any) -> None:
    """The engine as score built it: no deltas, the routers' pretrained weights, no gradients, no load counts."""
    engine.set_deltas({})
    for name, master in engine.routers.items():
        master.copy_(engine.router_anchors[name])
        master.grad = None
    engine.model.zero_grad(set_to_none=True)
    engine.load_stats(reset=True)
