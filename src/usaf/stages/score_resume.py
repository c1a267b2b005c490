"""What an interrupted ``usaf score`` keeps, so that the same command goes on from there.

Score's work is the calibration pass (one forward and backward per microbatch), the lr test (up to four probe runs)
and, with ``--cache``, the store of every training sequence's prefix states. A stop request (Ctrl-C, SIGTERM, SIGHUP:
:class:`usaf.stages.stop.StopRequest`) ends the pass after a whole microbatch, the test between two probe steps (the
probe cut short is run again: it is a few percent of the test) and the store where no batch is pending. What is done
is saved in the run's partial directory (``.OUT.usaf-partial``, :class:`usaf.artifacts.ArtifactWriter`'s resumable
mode), and so is the end of the pass and of each probe, and the store every minute, so a kill, which leaves no time
to save, loses at most the pass, a probe or a minute of the store. The same command resumes, and its plan is
byte-identical to an uninterrupted run's.

- ``score-settings.json``: what the saved work depends on: the inputs' fingerprints, every setting but the paths
  (which may name the same inputs differently), the device and dtype, usaf's, torch's and transformers' versions
  (an upgrade changes the kernels the pass summed with; records from before the versions were kept compare
  without them). A rerun with others is refused, naming them, unless ``--overwrite`` discards the saved work.
- ``score-calibration.pt``: after ``batches`` microbatches, every accumulator's state (the sample's and the stability
  halves', :mod:`usaf.engine.score_state`), each MoE layer's tokens per expert (the plan's routing statistics) and
  the prefix states the pass recorded (for the lr test and the plan's store). Under torchrun each rank saves its own
  share of the pass (its microbatches, its accumulators before the merge): rank 0 this file, rank r
  ``score-calibration.rank<r>.pt``.
- ``score-probes.pt``: the lr test's finished probes, their held-back scores by ascending lr.
- ``score-store.json``: with ``--cache``, how far the store of every sequence's prefix states got (lines of the data
  done, the index so far, the bytes of the states file to keep), saved every minute and at a stop request.

A run killed after its plan's manifest was written, with the bookkeeping gone and only the rename left, leaves a
finished plan there: the same command verifies it and moves it into place (:func:`finished_plan`), where it was
scored again before.

Tensors and plain values only, read back with ``torch.load(weights_only=True)``. Under torchrun the number of
processes is part of the identity (each rank resumes its own share of the pass); rank 0 alone writes the settings,
and runs the lr test and writes the store alone, so their files are its own.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from usaf._version import __version__
from usaf.artifacts.checksums import SIDECAR_SUFFIX, doubt, seal
from usaf.artifacts.disk import cause_of
from usaf.artifacts.loader import load_manifest, load_verified
from usaf.artifacts.manifest import MANIFEST_NAME
from usaf.artifacts.outputs import SCORE_PARTIAL_MARKER
from usaf.artifacts.plan import PlanManifest
from usaf.artifacts.prefix_store import STATES_FILE
from usaf.artifacts.writer import write_text_atomic
from usaf.backends.cpu import thread_count
from usaf.engine.score_state import restore_accumulator
from usaf.engine.scores import ScoreAccumulator
from usaf.errors import UsafError
from usaf.quant.ptfile import StreamingTorchSave
from usaf.stages.lr_test import HeldOut
from usaf.stages.progress import Progress
from usaf.stages.stop import rerun_to_resume

SETTINGS = SCORE_PARTIAL_MARKER  # "score-settings.json", written first
CALIBRATION = "score-calibration.pt"
PROBES = "score-probes.pt"
STORE = "score-store.json"
THREADS_KEY = "torch_threads"  # in SETTINGS beside the identity, not part of it
VERSIONS_KEY = "versions"  # torch's and transformers', in the identity since 2026-12-06 (found in review)
RANK_CALIBRATION = "score-calibration.rank{}.pt"  # rank r > 0's share of the pass, under torchrun
# top level of the partial directory, never part of the plan: the two saved tensor files' checksums too
BOOKKEEPING = (SETTINGS, CALIBRATION, PROBES, STORE, *(name + SIDECAR_SUFFIX for name in (CALIBRATION, PROBES)))
# Config fields the saved work does not depend on: where the inputs and the plan are (the inputs count by their
# fingerprints), the device as asked (the one used is recorded), and the launcher's settings.
NOT_RECORDED = frozenset({"model", "data", "out", "workspace", "overwrite", "device", "dist_backend"})


def run_identity(
    config: Any, *, model_fingerprint: str, data_fingerprint: str, backend: Any, processes: int = 1
) -> dict[str, Any]:
    """What a saved score's work depends on (``score-settings.json``). ``processes``: torchrun's ranks, each of which
    saves its own share of the pass (recorded above one only, so one process's record is what it always was)."""
    settings = {k: v for k, v in config.model_dump(mode="json").items() if k not in NOT_RECORDED}
    device = backend.recorded(backend.compute_dtype(config.dtype))
    identity = {
        "usaf": __version__,
        "model_fingerprint": model_fingerprint,
        "data_fingerprint": data_fingerprint,
        "device": device["device"],
        "dtype": device["dtype"],
        "settings": settings,
        VERSIONS_KEY: {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    if processes > 1:
        identity["processes"] = processes
    return identity


@dataclass
class SavedCalibration:
    """The calibration pass after its first ``batches`` microbatches."""

    batches: int
    sample: dict[str, ScoreAccumulator]
    halves: list[dict[str, ScoreAccumulator]]  # [] without stability
    expert_tokens: dict[int, torch.Tensor]  # MoE layer -> tokens per expert (E,) int64
    states: list[torch.Tensor]  # the prefix tap's (B, T, H) per batch done; [] where nothing was tapped
    seconds: float  # the pass's time so far


@dataclass
class SavedProbes:
    done: list[HeldOut | None]  # by ascending lr
    seconds: float


class ScoreProgress:
    """The saved work of an interrupted score in ``directory`` (None: nothing is saved or read), as rank ``rank``
    sees it: its own share of the calibration pass, and what rank 0 writes for all (settings, probes, store)."""

    def __init__(self, directory: Path | None, progress: Progress, rank: int = 0) -> None:
        self.directory = directory
        self.progress = progress
        self.rank = rank
        self.calibration_file = CALIBRATION if rank == 0 else RANK_CALIBRATION.format(rank)
        self.rerun = rerun_to_resume()  # how a stop's note says to go on (open: without --overwrite where given)

    @classmethod
    def open(
        cls,
        directory: Path | None,
        identity: dict[str, Any],
        *,
        out: Path,
        discard: bool,
        progress: Progress,
        threads: int | None = None,
        run: Path | None = None,
    ) -> ScoreProgress:
        """The work saved in ``directory`` by a run with this ``identity``; another run's is refused, or deleted
        with ``discard`` (--overwrite). Records the identity for the next run, with ``threads`` (torch's intra-op
        threads on the CPU, which a resume runs at again: :meth:`recorded_threads`). ``run``: the train run whose
        plan this is (``out`` is its ``RUN/plan``), named in the refusal in train's words."""
        saved = cls(directory, progress)
        saved.rerun = rerun_to_resume("--overwrite" if discard else None)
        if directory is None:
            return saved
        recorded = saved.recorded_identity()
        same = recorded is not None and same_run(recorded, identity)
        if recorded is not None and not same and saved.holds_work() and not discard:
            if run is not None:  # train scoring its plan: the user gave train's flags, and --out RUN, not RUN/plan
                raise UsafError(
                    f"--out {run}: the run was stopped while scoring its plan with other settings or inputs (kept in "
                    f"{directory}: {_differences(recorded, identity, for_train=True)})",
                    "rerun with the settings it started with to resume it, or pass --overwrite to start the run over",
                )
            raise UsafError(
                f"--out {out}: an interrupted usaf score with other settings or inputs left its work in "
                f"{directory} ({_differences(recorded, identity)})",
                "rerun with its settings to resume it, or pass --overwrite to discard it",
            )
        if discard and saved.holds_work():  # its own settings too: --overwrite starts over, as inspect says (it
            why = "its settings" if same else "other settings"  # resumed: found in review)
            progress.note(f"discarding the interrupted score's work in {directory} (--overwrite; {why})")
        if not same or discard:
            saved._clear()
            record = {**identity, THREADS_KEY: threads}  # beside the identity: a resume at another count is taken
            write_text_atomic(directory / SETTINGS, json.dumps(record, indent=1, sort_keys=True))
        return saved

    def holds_work(self) -> bool:
        """Whether any saved work is here (any rank's)."""
        names = (name for name in self.bookkeeping() if name != SETTINGS and not name.endswith(SIDECAR_SUFFIX))
        return self.directory is not None and any((self.directory / name).is_file() for name in names)

    def bookkeeping(self) -> tuple[str, ...]:
        """The names of the bookkeeping files at the top of the directory (every rank's), present or not: never part
        of the plan."""
        if self.directory is None or not self.directory.is_dir():
            return BOOKKEEPING
        ranks = sorted(p.name for p in self.directory.glob(RANK_CALIBRATION.format("*")) if p.is_file())
        return (*BOOKKEEPING, *ranks, *(name + SIDECAR_SUFFIX for name in ranks))

    # -- the calibration pass -----------------------------------------------------------------------------

    def calibration(
        self,
        sample: dict[str, ScoreAccumulator],
        halves: list[dict[str, ScoreAccumulator]],
        *,
        batches: int,
        expert_tokens: dict[int, torch.Tensor],
    ) -> SavedCalibration | None:
        """The saved pass restored into ``sample`` and ``halves`` (empty accumulators of this run's settings; a pass
        of ``batches`` microbatches; ``expert_tokens``: the engine's counters, for their layers and shapes), or None:
        nothing saved, or a file that does not fit (a note; the accumulators may then be part-restored: use new
        ones)."""
        state = self._load(self.calibration_file, "the calibration pass")
        if state is None:
            return None
        try:
            done = int(state["batches"])
            if not 0 <= done <= batches:
                raise ValueError(f"{done} batches done of {batches}")
            tokens = {int(layer): counts for layer, counts in state["expert_tokens"].items()}
            if {k: v.shape for k, v in tokens.items()} != {k: v.shape for k, v in expert_tokens.items()}:
                raise ValueError("its tokens per expert are of other layers or shapes")
            for part, mine in zip(("sample", "half0", "half1"), (sample, *halves)):
                theirs = {key.partition("/")[2]: v for key, v in state.items() if key.partition("/")[0] == part}
                if mine.keys() != theirs.keys():
                    raise ValueError(f"{part}: tensors {sorted(theirs)} saved, {sorted(mine)} scored")
                for name, acc in mine.items():
                    restore_accumulator(acc, theirs[name])
            return SavedCalibration(done, sample, halves, tokens, list(state["states"]), float(state["seconds"]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            self.progress.note(f"the saved calibration pass in {self.directory} does not fit ({e}): starting it over")
            return None

    def save_calibration(self, saved: SavedCalibration) -> bool:
        """Save the pass so far; False (with a note) where the disk refused: a rerun then starts it over. One
        accumulator's state at a time: the pools of all of them (3 sets) are never copied at once."""

        def entries() -> Iterator[tuple[str, Any]]:
            yield "batches", saved.batches
            yield "seconds", saved.seconds
            yield "expert_tokens", {str(layer): counts.cpu() for layer, counts in saved.expert_tokens.items()}
            yield "states", saved.states
            for part, accumulators in zip(("sample", "half0", "half1"), (saved.sample, *saved.halves)):
                for name, acc in accumulators.items():
                    yield f"{part}/{name}", acc.state_dict()

        return self._save(self.calibration_file, entries(), "the calibration pass")

    # -- the lr test --------------------------------------------------------------------------------------

    def probes(self) -> SavedProbes:
        state = self._load(PROBES, "the lr test's probes")
        if state is None:
            return SavedProbes([], 0.0)
        try:
            done = [None if p is None else HeldOut(p["nll"], p["tokens"]) for p in state["done"]]
            return SavedProbes(done, float(state["seconds"]))
        except (KeyError, TypeError) as e:
            self.progress.note(f"the saved lr-test probes in {self.directory} do not fit ({e}): running them again")
            return SavedProbes([], 0.0)

    def save_probes(self, saved: SavedProbes) -> bool:
        done = [None if h is None else {"nll": h.nll, "tokens": h.tokens} for h in saved.done]
        return self._save(PROBES, iter([("done", done), ("seconds", saved.seconds)]), "the lr test's probes")

    # -- --cache's prefix store ----------------------------------------------------------------------------

    def store(self) -> dict[str, Any] | None:
        """Where an interrupted run's ``--cache`` store stood (:func:`usaf.stages.prefix_cache.write_store`), or
        None: not begun, or its record or states file does not fit (then the store starts over, with a note)."""
        if self.directory is None or not (self.directory / STORE).is_file():
            return None
        try:
            state = json.loads((self.directory / STORE).read_text(encoding="utf-8"))
            written = (self.directory / STATES_FILE).stat().st_size
            if not 0 <= int(state["store"]["bytes"]) <= written or int(state["lines"]) < 0:
                raise ValueError(f"{state['store']['bytes']} bytes recorded, {written} in the states file")
            return state
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.progress.note(f"the saved prefix store in {self.directory} does not fit ({e}): starting it over")
            return None

    def save_store(self, state: dict[str, Any]) -> bool:
        return self._guarded(lambda: write_text_atomic(self.directory / STORE, json.dumps(state)),
                             "the prefix store's progress")  # fmt: skip

    # -- files --------------------------------------------------------------------------------------------

    def clear_outputs(self) -> None:
        """Delete everything but the bookkeeping (and the states of a prefix store to resume): plan files a failed
        earlier run was writing (written again)."""
        if self.directory is None:
            return
        keep = {*self.bookkeeping(), STATES_FILE} if self.store() is not None else set(self.bookkeeping())
        for entry in self.directory.iterdir():
            if entry.name in keep:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()

    def recorded_identity(self) -> dict[str, Any] | None:
        recorded = self._recorded()
        if recorded is not None:
            recorded.pop(THREADS_KEY, None)
        return recorded

    def recorded_threads(self) -> int | None:
        """The torch threads the interrupted run computed at on the CPU (None: another device, or an older usaf)."""
        return thread_count((self._recorded() or {}).get(THREADS_KEY))

    def _recorded(self) -> dict[str, Any] | None:
        try:
            recorded = json.loads((self.directory / SETTINGS).read_text(encoding="utf-8"))
        except (OSError, ValueError):  # absent, or cut short by a kill: the work (if any) cannot be vouched for
            return None
        return recorded if isinstance(recorded, dict) else None

    def _clear(self) -> None:
        for name in self.bookkeeping():
            (self.directory / name).unlink(missing_ok=True)

    def _load(self, name: str, what: str) -> dict[str, Any] | None:
        if self.directory is None or not (self.directory / name).is_file():
            return None
        if why := doubt(self.directory / name):  # a changed byte that still loads would be taken (found in review)
            self.progress.note(f"{self.directory / name}: not as usaf wrote it ({why}): {what} starts over")
            return None
        try:
            return torch.load(self.directory / name, weights_only=True)
        except Exception as e:  # noqa: BLE001 (any unreadable file: the work is redone, never trusted)
            self.progress.note(f"{self.directory / name}: unreadable ({type(e).__name__}): {what} starts over")
            return None

    def _save(self, name: str, entries: Iterator[tuple[str, Any]], what: str) -> bool:
        """Write ``entries`` to ``name`` one at a time (:class:`StreamingTorchSave`: a temporary renamed into place,
        so the file is whole or absent). False, with a note, where the disk refused: the work is done again."""

        def write() -> None:
            path = self.directory / name
            with StreamingTorchSave(path, before_rename=lambda tmp: seal(path, written_at=tmp)) as archive:
                for key, entry in entries:
                    archive.add(key, entry)

        return self._guarded(write, what)

    def _guarded(self, write: Callable[[], None], what: str) -> bool:
        """``write()``; False (with a note) where there is no directory or the disk refused: the work is done again."""
        if self.directory is None:
            return False
        try:
            write()
        except Exception as e:
            if cause_of(e) is None:
                raise
            self.progress.note(f"{self.directory}: {what} not saved ({cause_of(e)}): a rerun does it again")
            return False
        return True


def same_run(recorded: dict[str, Any] | None, identity: dict[str, Any]) -> bool:
    """Whether saved work recorded with the identity ``recorded`` (None: none readable) is this run's: the versions
    compared where recorded."""
    if recorded is None:
        return False
    if VERSIONS_KEY not in recorded:  # saved before the versions were recorded: resumes as it did then
        identity = {key: value for key, value in identity.items() if key != VERSIONS_KEY}
    return recorded == identity


def finished_plan(
    directory: Path, identity: dict[str, Any], *, out: Path, discard: bool, progress: Progress
) -> PlanManifest | None:
    """The plan a run with this ``identity`` finished in its partial ``directory`` (manifest written, killed before
    the rename), verified: None where there is none, or its files do not match its manifest (the manifest goes: the
    plan is written again), or ``discard`` (--overwrite starts over). A finished plan of other settings or inputs is
    refused as their saved work is (:meth:`ScoreProgress.open`)."""
    if not (directory / MANIFEST_NAME).is_file():
        return None
    try:
        manifest = load_verified(directory, PlanManifest, flag="--out")
    except UsafError:  # killed while the manifest was written, or files changed since: not a finished plan
        (directory / MANIFEST_NAME).unlink()
        return None
    recorded, asked = plan_identity(manifest), as_a_plan_records(identity)
    if discard:  # its manifest goes now: kept, a stop of this run left it to be taken (or refused) by the next
        (directory / MANIFEST_NAME).unlink()  # (found in review); the plan's files are cleared before the new ones
        progress.note(f"discarding the finished plan of an interrupted score in {directory} (--overwrite)")
        return None
    if not same_run(recorded, asked):
        raise UsafError(
            f"--out {out}: an interrupted usaf score with other settings or inputs finished its plan in {directory} "
            f"and was stopped before moving it into place ({_differences(recorded, asked)})",
            "rerun with its settings to finish it, or pass --overwrite to discard it",
        )
    return manifest


def finished_there(directory: Path, identity: dict[str, Any]) -> bool:
    """Whether the partial ``directory`` holds a plan's manifest written by a run with this ``identity`` (read, not
    verified: :func:`finished_plan` verifies it when the run takes it)."""
    try:
        manifest = load_manifest(directory, PlanManifest)
    except (UsafError, ValueError):  # none, unreadable, or another kind
        return False
    return same_run(plan_identity(manifest), as_a_plan_records(identity))


def as_a_plan_records(identity: dict[str, Any]) -> dict[str, Any]:
    """``identity`` as :func:`plan_identity` can compare it: without torchrun's processes, which a plan does not
    record (a finished plan is taken whatever number of processes scored it)."""
    return {key: value for key, value in identity.items() if key != "processes"}


def plan_identity(manifest: PlanManifest) -> dict[str, Any]:
    """The :func:`run_identity` (processes left out) of the run that wrote ``manifest``: what its manifest records
    of its settings, inputs, device and versions."""
    fingerprints = {record.role: record.fingerprint for record in manifest.inputs}
    environment = manifest.environment
    return {
        "usaf": manifest.usaf_version,
        "model_fingerprint": fingerprints.get("model"),
        "data_fingerprint": fingerprints.get("data"),
        "device": environment.device,
        "dtype": environment.dtype,
        "settings": {key: value for key, value in manifest.config.items() if key not in NOT_RECORDED},
        VERSIONS_KEY: {"torch": environment.torch, "transformers": environment.transformers},
    }


def _differences(recorded: dict[str, Any], identity: dict[str, Any], *, for_train: bool = False) -> str:
    """The recorded values that differ, in a user's words (``--frac 0.01 there, 0.02 now``; a switch as its flag,
    ``--no-stability there, --stability now``: "--stability True there, False now" was found in review).
    ``for_train``: train's score, whose lr test follows train's ``--lr`` (the user gave no ``--lr-test``)."""

    def shown(key: str, value: Any) -> str:
        flag = f"--{key.replace('_', '-')}"
        if isinstance(value, bool):
            return flag if value else f"--no-{flag[2:]}"
        return f"{flag} not given" if value is None else f"{flag} {value}"

    parts = []
    theirs, mine = recorded.get("settings", {}), identity["settings"]
    for key in sorted(set(theirs) | set(mine)):
        if theirs.get(key) == mine.get(key):
            continue
        if for_train and key == "lr_test":  # train runs the lr test unless --lr is given
            parts.append("no --lr there (the lr test ran), --lr given now" if theirs.get(key) else
                         "--lr given there, none now (the lr test would run)")  # fmt: skip
        elif isinstance(theirs.get(key), bool) or isinstance(mine.get(key), bool):
            parts.append(f"{shown(key, theirs.get(key))} there, {shown(key, mine.get(key))} now")
        else:
            value = "not given" if mine.get(key) is None else mine.get(key)
            parts.append(f"{shown(key, theirs.get(key))} there, {value} now")
    for key in ("model_fingerprint", "data_fingerprint", "device", "dtype", "usaf"):
        if recorded.get(key) != identity[key]:
            parts.append(f"{key.replace('_', ' ')} {recorded.get(key)} there, {identity[key]} now")
    now = identity[VERSIONS_KEY]
    there = recorded.get(VERSIONS_KEY, now)  # not recorded: not compared
    parts += [f"{name} {there.get(name)} there, {version} now" for name, version in now.items()
              if there.get(name) != version]  # fmt: skip
    if recorded.get("processes", 1) != identity.get("processes", 1):  # torchrun's ranks: each saved its share
        parts.append(f"{recorded.get('processes', 1)} processes there, {identity.get('processes', 1)} now")
    return "; ".join(parts) or "unreadable settings"
