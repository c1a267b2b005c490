"""Data parallelism over ``torch.distributed``, launched by ``torchrun`` (one process per device).

Every rank holds the whole frozen 4-bit model and the same sparse index sets; a training step shards the
global batch by rank, and the gradients of the sparse values and routers are summed over ranks as **one
flat buffer** (bytes ∝ trainable parameters, never the model's size). Everything else that must agree —
scored token counts, losses, expert loads, grow scores before a reselection, a stop request — is reduced
or gathered explicitly through :class:`World`, so every rank makes the same decisions from the same
numbers. Rank 0 alone writes files; the others read what it wrote after a barrier.

A single process is a :class:`World` of size 1 whose collectives are no-ops, so the stages call the same
methods either way. ``torch.distributed`` is initialised only when ``WORLD_SIZE`` > 1 (torchrun sets it).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from usaf.backends.ranks import bind_device, rank_device
from usaf.engine.scores import ScoreAccumulator, merge
from usaf.errors import StopSignal, UsafError

BACKENDS = ("auto", "gloo", "nccl")
# How long a rank waits in a collective for the others: rank 0 alone writes the prefix store and
# checkpoints while the others wait at a barrier, which can take long on a real model.
DEFAULT_TIMEOUT_MIN = 60
# The remedy of World.refuse_unless_same for the stages' inputs.
SAME_INPUTS = "give every process the same --model, --data and --plan, or the same workspace"
TIMEOUT_ENV = "USAF_DIST_TIMEOUT_MIN"


T = TypeVar("T")


class PeerLost(UsafError):
    """A collective failed: another rank died or the network broke (the message says which call)."""


@dataclass(frozen=True)
class World:
    """This process's place among the ranks; size 1 (the default) is a plain single process."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None  # "gloo" | "nccl" once initialised
    wire: str = "cpu"  # where small collective buffers live: nccl reduces device tensors only

    @property
    def active(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- collectives (no-ops in a single process) ---------------------------------------------------

    def barrier(self, what: str = "barrier") -> None:
        if self.active:
            self._call(what, torch.distributed.barrier)

    def sum_(self, tensor: torch.Tensor, what: str = "all-reduce") -> torch.Tensor:
        """Sum ``tensor`` over ranks in place (and return it)."""
        if self.active:
            self._call(what, torch.distributed.all_reduce, tensor)
        return tensor

    def sum_floats(self, values: Sequence[float], what: str = "all-reduce") -> list[float]:
        """Sum a few Python numbers over ranks (fp64, so token counts and losses stay exact)."""
        if not self.active:
            return list(values)
        return self.sum_(torch.tensor(list(values), dtype=torch.float64, device=self.wire), what).tolist()

    def any(self, flag: bool, what: str = "stop check") -> bool:
        """True on every rank when it is true on any."""
        return self.sum_floats([1.0 if flag else 0.0], what)[0] > 0

    def gather_objects(self, obj: Any, what: str = "all-gather") -> list[Any]:
        """``obj`` of every rank, in rank order, on every rank (pickled: only our own processes' objects)."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.size
        self._call(what, torch.distributed.all_gather_object, out, obj)
        return out

    def refuse_unless_same(self, resolved: dict[str, Any], remedy: str) -> None:
        """Every rank resolved the same ``resolved`` values (flag or name -> value), else one refusal on every rank.
        Each rank resolves --model, --data and --plan (or the workspace's) on its own: ranks that differed (a workspace
        per node, a tokenize finished between their lookups) trained rank 0's record on mixed data, or hung in a
        collective when their step counts differed (found in review)."""
        if not self.active:
            return
        seen = self.gather_objects(resolved, "the inputs every rank resolved")  # the same list on every rank
        for rank, theirs in enumerate(seen[1:], start=1):
            if differing := [name for name in resolved if theirs[name] != seen[0][name]]:
                raise UsafError(f"rank {rank} resolved other inputs than rank 0 ({', '.join(differing)})", remedy)

    def decided_by_main(self, decide: Callable[[], T], what: str) -> T:
        """``decide()`` run by rank 0 alone, its result on every rank. A :class:`UsafError` or a stop request
        (:class:`StopSignal`) it raises is raised on every rank, so none goes on to wait in a collective rank 0
        never reaches."""
        if not self.active:
            return decide()
        outcome: tuple[str, Any] | None = None
        if self.is_main:
            try:
                outcome = ("decided", decide())
            except UsafError as e:
                self.gather_objects(("refused", (e.message, e.hint)), what)
                raise
            except StopSignal as e:
                self.gather_objects(("stopped", e.signum), what)
                raise
        kind, value = self.gather_objects(outcome, what)[0]
        if kind == "refused":
            raise UsafError(*value)
        if kind == "stopped":
            raise StopSignal(value)
        return value

    def sum_gradients(self, tensors: Sequence[torch.Tensor]) -> int:
        """Sum every tensor's ``.grad`` over ranks as one flat fp32 buffer; returns the buffer's bytes.

        A tensor no rank produced a gradient for keeps ``grad = None`` (the optimizer then leaves it
        alone, as in one process); one that some ranks lack gets zeros from them. The buffer is
        ``[grad_0 | grad_1 | ... | present flags]``: (Σ numel + len(tensors),) fp32.
        """
        if not self.active or not tensors:
            return 0
        parts = [t.grad.reshape(-1).float() if t.grad is not None else t.new_zeros(t.numel(), dtype=torch.float32)
                 for t in tensors]  # fmt: skip
        present = torch.tensor([t.grad is not None for t in tensors], dtype=torch.float32, device=parts[0].device)
        flat = torch.cat([*parts, present])
        self.sum_(flat, "gradient all-reduce")
        offset = 0
        for tensor, has in zip(tensors, flat[-len(tensors) :].tolist()):
            n = tensor.numel()
            if has > 0:
                summed = flat[offset : offset + n].view_as(tensor).to(tensor.dtype)
                if tensor.grad is None:
                    tensor.grad = summed.clone()
                else:
                    tensor.grad.copy_(summed)
            offset += n
        return flat.numel() * flat.element_size()

    def _call(self, what: str, fn, *args) -> Any:
        try:
            return fn(*args)
        except RuntimeError as e:  # DistBackendError / DistNetworkError / gloo's "Connection closed"
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise PeerLost(
                f"rank {self.rank}: {what} failed: another process of the run stopped or the network broke ({first})",
                "see the other ranks' output for the cause; rerun the same command to resume from the last checkpoint",
            ) from None


_WORLD = World()


def world() -> World:
    """The current process's :class:`World` (size 1 until :func:`init` ran under torchrun)."""
    return _WORLD


def launched(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process was started as one of several ranks (torchrun's ``WORLD_SIZE`` > 1)."""
    env = os.environ if env is None else env
    return int(env.get("WORLD_SIZE", "1") or 1) > 1


def choose_backend(requested: str | None, device_type: str) -> str:
    """``nccl`` for CUDA devices, ``gloo`` otherwise, unless ``--dist-backend`` says which."""
    requested = requested or "auto"
    if requested not in BACKENDS:
        raise UsafError(f"--dist-backend {requested}: unknown", f"use one of {', '.join(BACKENDS)}")
    if requested != "auto":
        return requested
    return "nccl" if device_type == "cuda" else "gloo"


def device_for_rank(spec: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """Under torchrun, ``auto``/``cuda`` means this rank's own GPU (``cuda:LOCAL_RANK``)."""
    env = os.environ if env is None else env
    if not launched(env) or spec not in (None, "", "auto", "cuda"):
        return spec
    return rank_device(int(env.get("LOCAL_RANK", "0"))) or spec


def stop_with_launcher() -> None:
    """Have this rank sent SIGTERM when its launcher dies (Linux: ``prctl(PR_SET_PDEATHSIG)``), which stops it as
    Ctrl-C does: a checkpoint, then exit. ``kill -9`` of ``usaf train --nproc 2`` left both ranks training unseen,
    holding the run's lock, and a rerun was refused (found in review). Elsewhere nothing is done."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl here: the old behaviour
        return
    if os.getppid() == 1:  # the launcher died before the request was made: as if it had been
        os.kill(os.getpid(), signal.SIGTERM)


def init(backend: str | None, device: torch.device, env: Mapping[str, str] | None = None) -> World:
    """Join the process group when launched by torchrun (idempotent); a single process stays size 1.

    Args:
        backend: ``auto`` | ``gloo`` | ``nccl`` (``--dist-backend``).
        device: this rank's compute device (decides ``auto``; CUDA ranks bind to it).
    """
    global _WORLD
    env = os.environ if env is None else env
    if not launched(env):
        return _WORLD
    if _WORLD.active:
        return _WORLD
    stop_with_launcher()
    if not dist.is_available():
        raise UsafError("WORLD_SIZE > 1 but this torch build has no torch.distributed", "install a full torch build")
    name = choose_backend(backend, device.type)
    if name == "nccl" and not dist.is_nccl_available():
        raise UsafError("--dist-backend nccl: this torch build has no NCCL", "use --dist-backend gloo")
    bind_device(device)
    minutes = _timeout_minutes(env)
    try:
        dist.init_process_group(name, timeout=datetime.timedelta(minutes=minutes))
    except (RuntimeError, ValueError) as e:
        raise UsafError(
            f"could not join the distributed run ({name}): {e}",
            "launch with torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or check the rendezvous",
        ) from None
    _WORLD = World(
        rank=dist.get_rank(),
        size=dist.get_world_size(),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        backend=name,
        wire=str(device) if name == "nccl" else "cpu",
    )
    return _WORLD


def _timeout_minutes(env: Mapping[str, str]) -> float:
    """``USAF_DIST_TIMEOUT_MIN``: a positive number of minutes (a bad value was a traceback, or a timeout of 0 ms
    named as a failure to join; found in review)."""
    raw = env.get(TIMEOUT_ENV, "")
    if raw == "":
        return DEFAULT_TIMEOUT_MIN
    try:
        minutes = float(raw)
    except ValueError:
        minutes = math.nan
    if not (math.isfinite(minutes) and minutes > 0):
        raise UsafError(f"{TIMEOUT_ENV}={raw!r}: not a positive number of minutes",
                        f"set a number above 0 (the default is {DEFAULT_TIMEOUT_MIN:g}), or unset it")  # fmt: skip
    return minutes


def shutdown(*, clean: bool = True) -> None:
    """Leave the process group (end of a command); a no-op in a single process.

    ``clean``: the command ended without an error here, so every rank meets at a barrier before any tears its
    transport down. Without it a rank could leave while another was still finishing its last exchange, and gloo
    aborts that one ("terminate called without an active exception", exit -6, after a run that had finished; seen
    in tests/test_distributed.py). Not after an error: the others may never arrive (torchrun stops them when this
    rank exits).
    """
    global _WORLD
    if _WORLD.active and torch.distributed.is_initialized():
        if clean:
            with contextlib.suppress(PeerLost):  # a peer gone at the very end: nothing left to wait for
                _WORLD.barrier("the end of the command")
        torch.distributed.destroy_process_group()
    _WORLD = World()


def shard(items: Sequence[Any], w: World) -> list[Any]:
    """This rank's share of a list: items ``rank, rank + size, ...`` (all of them in one process)."""
    return list(items[w.rank :: w.size])


def sum_expert_loads(engine: Any, w: World) -> None:
    """Every MoE layer's tokens-per-expert counters summed over ranks, in place (before they are read)."""
    if not w.active:
        return
    states = list(engine.loaded.experts.values())
    stacked = torch.stack([s.tokens_per_expert for s in states]).to(w.wire)  # (layers, E) int64
    w.sum_(stacked, "expert-load all-reduce")
    for state, summed in zip(states, stacked):
        state.tokens_per_expert.copy_(summed)


def merge_scores(accumulators: Mapping[str, Any], w: World) -> dict[str, Any]:
    """Every rank's grow-score accumulators merged (same result on every rank; see ``scores.merge``).

    Pooled accumulators send their pools (``pool_factor × candidates`` (index, score) pairs per tensor),
    not dense maps; exact (dense) accumulators send ``4·E·O·I`` bytes each, which is why exact mode is
    for tests and tiny models.
    """
    if not w.active:
        return dict(accumulators)
    states = w.gather_objects({name: acc.state_dict() for name, acc in accumulators.items()}, "grow-score gather")
    merged = {}
    for name, acc in accumulators.items():
        parts = [ScoreAccumulator.from_state_dict(s[name], device=acc.device) for s in states]
        merged[name] = merge(parts)
    return merged


def describe(env: Mapping[str, str], device: torch.device, backend: str | None = None) -> dict[str, Any]:
    """``usaf doctor``'s distributed section: what torch.distributed offers here and, under torchrun,
    the launch environment plus a live check (join the group, all-reduce, gather every rank's host and
    device). Run by every rank; the caller prints rank 0's."""
    available = dist.is_available()
    info: dict[str, Any] = {
        "available": available,
        "gloo": available and dist.is_gloo_available(),
        "nccl": available and dist.is_nccl_available(),
        "launched": launched(env),
        "backend": choose_backend(backend, device.type),
    }
    if not info["launched"]:
        return info
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    info["environment"] = {k: env.get(k) for k in keys}
    w = init(backend, device, env)
    start = time.perf_counter()
    total = w.sum_floats([1.0], "doctor all-reduce")[0]
    info["check"] = {"all_reduce_sum": total, "expected": w.size, "ok": total == w.size,
                     "seconds": round(time.perf_counter() - start, 4)}  # fmt: skip
    info["ranks"] = w.gather_objects({"rank": w.rank, "host": socket.gethostname(), "device": str(device)})
    return info
