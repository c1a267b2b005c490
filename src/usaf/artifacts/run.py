"""The ``run`` artifact written by ``usaf train``: checkpoints, metrics and the final sparse delta.

Unlike the other artifacts, a run directory exists while training (its checkpoints must survive a
crash): ``checkpoints/step-NNNNNNN/`` are each written atomically, ``metrics.jsonl`` grows line by
line, and ``manifest.json`` is written last, when the run completes. A directory without a manifest
is an interrupted run, which ``usaf train`` resumes.

A checkpoint is one :class:`Checkpoint`, written by :func:`write_checkpoint` and read by
:func:`read_checkpoint` (the trainer's resume, and every reader of what a run trained): the file names and
the key scheme of its deltas are spelled here only, and every read goes through :mod:`usaf.artifacts.safety`.
A read refuses, naming the file: a NaN or Inf in a delta or router (it would become NaN weights), a step
that is not a whole number from 0 to the run's steps, and a ``step-N`` directory whose name is not a step
or disagrees with its ``state.json`` (:func:`checkpoint_dirs` lists a run's checkpoints by step number), and a
file whose bytes are not those its ``checksums.json`` recorded when it was written (:mod:`usaf.artifacts.checksums`;
a checkpoint of a usaf from before those records is read without).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from usaf.artifacts.checksums import unmatched, write_record
from usaf.artifacts.delta import DeltaManifest, read_delta
from usaf.artifacts.disk import check_free_space, removed_on_failure
from usaf.artifacts.hashing import combine, sha256_file
from usaf.artifacts.loader import holds_artifacts, load_verified, read_manifest_json, run_of_checkpoint
from usaf.artifacts.manifest import Manifest, Record, register
from usaf.artifacts.safety import load_safetensors, load_torch
from usaf.artifacts.writer import write_text_atomic
from usaf.errors import UsafError, not_a

if TYPE_CHECKING:  # torch stays out of the CLI's import time
    import torch

CHECKPOINTS_DIR = "checkpoints"
FINAL_DIR = "final"
METRICS_FILE = "metrics.jsonl"
SETTINGS_FILE = "run-settings.json"
# in run-settings.json: the sha256 of the rest of it, so an edit is seen (an lr edited there was trained with on
# resume, and recorded as the whole run's; found in review)
SETTINGS_SHA256 = "settings_sha256"
PREFIX_SPILL = "prefix-cache.bin"  # train's prefix states beyond --prefix-cache-gib, until the run finishes
PREFIX_SPILL_RANK = "prefix-cache-rank{}.bin"  # rank r's, under torchrun
PLAN_DIR = "plan"  # the plan usaf train scored on the fly, when it was given none and found none
DELTAS_FILE = "deltas.safetensors"  # "<name>.<part>_indices"/"<name>.<part>_values", see _DELTA_KEYS
ROUTERS_FILE = "routers.safetensors"  # in-memory router name -> fp32 master weight
OPTIMIZER_FILE = "optimizer.pt"  # optimizer, schedule, RNG, loss scale, partial grow scores (weights_only)
STATE_FILE = "state.json"  # the trainer's counters and histories
SUMS_FILE = "checksums.json"  # the sha256 of the four above, written last (usaf.artifacts.checksums)
# in state.json: this checkpoint was written with its checksums.json, so one without it lost it (a usaf from before
# the records wrote none, and its checkpoints are read unchecked)
CHECKSUMMED = "checksummed"
CHECKPOINT_FILES = (DELTAS_FILE, ROUTERS_FILE, OPTIMIZER_FILE, STATE_FILE, SUMS_FILE)  # a checkpoint directory's, all


class ReselectionRecord(Record):
    step: int
    fraction: float
    kept: int
    dropped: int
    grown: int
    turnover: float


class RunSummary(Record):
    model_fingerprint: str
    plan_fingerprint: str
    data_fingerprint: str
    trainable_layers: list[int]
    steps: int
    tokens: int
    skipped_steps: int = Field(description="steps skipped for a non-finite loss or gradient")
    first_loss: float = Field(description="the first finite step's training loss (one microbatch: noisy)")
    final_loss: float = Field(description="the last finite step's training loss (one microbatch: noisy)")
    loss_window: int | None = Field(
        None, description="steps averaged at each end of the run for the two means below: a quarter of the steps, "
        "at most 50 (None: a run of an older usaf)"
    )
    first_losses_mean: float | None = Field(None, description="mean training loss of the first loss_window steps")
    last_losses_mean: float | None = Field(None, description="mean training loss of the last loss_window steps")
    eval_losses: list[list[float | None]] = Field(
        description="[step, held-out loss] pairs; a loss None: not a number (a diverged run's NaN, which JSON writes "
        "as null: a manifest holding one was refused as edited or truncated; found in review)"
    )
    expert_entries: int
    router_params: int
    frozen_entries: int = Field(description="dropped-by-reselection entries kept in the cumulative delta")
    changed_entries: int | None = Field(
        None, description="weights the change touches in all: the active and the dropped-and-kept entries' union "
        "(some were dropped, then regrown), what export applies (None: an older usaf's run)",
    )  # fmt: skip
    reselections: list[ReselectionRecord]
    routing_warnings: list[str] = Field(default_factory=list, description="trainable layers whose routing collapsed")
    prefix_cache_hits: int | None = Field(None, description="sequences whose frozen-prefix state was cached")
    prefix_cache_misses: int | None = Field(None, description="sequences whose prefix state had to be computed")
    world_size: int = Field(1, ge=1, description="data-parallel processes (torchrun) of the run's last start")
    lr: float | None = Field(None, description="the deltas' peak lr the run used (None: a run of an older usaf)")
    lr_source: str | None = Field(None, description="where that lr came from: --lr, USAF_LR, the plan's lr test, ...")
    seconds: float = Field(description="wall time of the run's last start (a resumed run: since its resume)")
    resumed_at_step: int | None = Field(
        None, description="the step the run's last start resumed at: seconds, session_tokens and the prefix-cache "
        "counts are from there on; None: trained from step 0 in one start",
    )  # fmt: skip
    session_tokens: int | None = Field(None, description="tokens trained in seconds (None: a run of an older usaf)")
    checkpoints: int | None = Field(None, description="checkpoints/step-N kept at the end (None: an older usaf's run)")
    checkpoint_bytes: int | None = Field(None, description="their size on disk")


@register
class RunManifest(Manifest):
    KIND = "run"
    SCHEMA_VERSION = 1
    DESCRIPTION = "a finished training run: final sparse delta + routers, checkpoints, metrics"

    summary: RunSummary


# -- the checkpoint --------------------------------------------------------------------------------------

Pair = tuple["torch.Tensor", "torch.Tensor"]  # (indices (m,) int64 sorted flat into the stored (E, O, I), values (m,))
_DELTA_KEYS = {"active": ("indices", "values"), "frozen": ("frozen_indices", "frozen_values"),
               "cumulative": ("cumulative_indices", "cumulative_values")}  # fmt: skip
_NO_ROUTERS = "_none"  # safetensors cannot store an empty file: the placeholder of a run without routers


@dataclass
class DeltaRecord:
    """One trained expert tensor's sparse deltas.

    ``active``: the entries the optimizer trains now (None once none are); ``frozen``: entries a reselection
    dropped, kept in the weight; ``cumulative``: frozen ∪ active, what the run changed (what eval, export and
    generate apply). A checkpoint read for its change only may lack the first two.
    """

    active: Pair | None
    frozen: Pair | None
    cumulative: Pair


@dataclass
class Checkpoint:
    """Everything a resumed run needs to continue exactly (the data order is a pure function of seed and step).

    ``optimizer``/``schedule``/``rng`` are None when only the change was read (:func:`read_checkpoint` with
    ``full=False``); ``scores`` holds the grow scores collected inside a scoring window (rank 0's, and with
    data parallelism ``scores_by_rank`` every rank's).
    """

    deltas: dict[str, DeltaRecord]
    routers: dict[str, torch.Tensor]
    state: dict[str, Any]
    optimizer: dict | None = None
    schedule: dict | None = None
    rng: torch.Tensor | None = None
    scores: dict | None = None
    scores_by_rank: list | None = None
    loss_scale: dict | None = None


def write_checkpoint(directory: Path, checkpoint: Checkpoint) -> None:
    """Write ``checkpoint`` atomically: into ``<directory>.tmp``, renamed over ``directory`` when complete.

    A disk without room for it refuses before anything is written; one that fills anyway leaves no
    ``.tmp`` behind. Either way the previous checkpoint is untouched, so a rerun resumes from it.
    """
    # lazy: torch and safetensors stay out of usaf.artifacts' import time (manifests are read without them)
    import torch

    from usaf.artifacts.tensor_file import save_tensors  # lazy: it imports torch and safetensors

    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tensors = {}
    for name, record in checkpoint.deltas.items():
        for part, (ikey, vkey) in _DELTA_KEYS.items():
            pair = getattr(record, part)
            if pair is not None:
                tensors[f"{name}.{ikey}"], tensors[f"{name}.{vkey}"] = (t.contiguous() for t in pair)
    routers = {n: p.contiguous() for n, p in checkpoint.routers.items()} or {_NO_ROUTERS: torch.zeros(0)}
    extra: dict[str, Any] = {"optimizer": checkpoint.optimizer, "schedule": checkpoint.schedule, "rng": checkpoint.rng}
    for key in ("scores", "scores_by_rank", "loss_scale"):
        if getattr(checkpoint, key) is not None:
            extra[key] = getattr(checkpoint, key)
    needed = tensor_bytes([tensors, routers, extra]) + 2**16  # + the headers, the state and the pickle's records
    check_free_space(directory, needed, flag=None, what="the checkpoint")
    with removed_on_failure(tmp, needed=needed):
        tmp.mkdir(parents=True)
        save_tensors(tensors, str(tmp / DELTAS_FILE))
        save_tensors(routers, str(tmp / ROUTERS_FILE))
        torch.save(extra, tmp / OPTIMIZER_FILE)
        (tmp / STATE_FILE).write_text(json.dumps({**checkpoint.state, CHECKSUMMED: True}, indent=1))
        write_record(tmp / SUMS_FILE, {name: tmp / name for name in CHECKPOINT_FILES if name != SUMS_FILE})
    if directory.exists():  # a step written again after a resume: what else is in it is a user's, and stays
        for entry in directory.iterdir():
            if entry.name not in CHECKPOINT_FILES:
                os.replace(entry, tmp / entry.name)
        shutil.rmtree(directory)
    os.replace(tmp, directory)


def tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor in ``obj`` (nested dicts, lists, tuples): what writing it costs on disk."""
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):
        return int(obj.element_size() * obj.numel())
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def read_checkpoint(
    directory: Path,
    *,
    flag: str = "--resume",
    full: bool = True,
    hint: str = "resume from an earlier checkpoint",
    max_step: int | None = None,
) -> Checkpoint:
    """Read a checkpoint through the safe readers; any damage is one UsafError naming ``flag``, never a half-load.

    ``full=False`` reads the deltas and routers only (what a run changed), not the optimizer's state.
    ``max_step``: the run's steps, when known; a checkpoint beyond them is another run's or edited.
    """
    try:
        tensors = load_safetensors(directory / DELTAS_FILE)
        routers = load_safetensors(directory / ROUTERS_FILE)
        extra = load_torch(directory / OPTIMIZER_FILE, what="checkpoint") if full else {}
        state = json.loads((directory / STATE_FILE).read_text(encoding="utf-8"))
    except (UsafError, OSError, ValueError) as e:
        raise UsafError(f"{flag} {directory}: unreadable checkpoint ({getattr(e, 'message', e)})", hint) from None
    routers.pop(_NO_ROUTERS, None)
    deltas = _delta_records(tensors, directory, flag=flag, hint=hint)
    check_finite(directory / DELTAS_FILE, tensors, flag=flag, hint=hint)
    check_finite(directory / ROUTERS_FILE, routers, flag=flag, hint=hint)
    _check_step(directory, state, max_step, flag=flag, hint=hint)
    # last: the checks above name what is wrong with a file; this one catches an edit they cannot see
    if lost_checksums(directory, state):  # it was read unchecked, as from a usaf before the records (review)
        raise UsafError(f"{flag} {directory / SUMS_FILE}: missing, so its files cannot be checked (usaf wrote it "
                        "with the checkpoint)", hint)  # fmt: skip
    if isinstance(state, dict):  # a fact about the files, not the training's state (resume refuses unknown keys)
        state.pop(CHECKSUMMED, None)
    read = (DELTAS_FILE, ROUTERS_FILE, STATE_FILE, *((OPTIMIZER_FILE,) if full else ()))
    if changed := unmatched(directory, read, directory / SUMS_FILE):
        also = f" (and {', '.join(changed[1:])})" if len(changed) > 1 else ""
        raise UsafError(
            f"{flag} {directory / changed[0]}: changed since usaf wrote it{also}: its sha256 is not the one "
            f"{SUMS_FILE} records",
            hint,
        )
    if full and not (isinstance(extra, dict) and all(key in extra for key in ("optimizer", "schedule", "rng"))):
        raise UsafError(
            f"{flag} {directory / OPTIMIZER_FILE}: unreadable checkpoint (not the optimizer state usaf writes: "
            "a dict of optimizer, schedule and rng)",
            hint,
        )
    return Checkpoint(
        deltas, dict(routers), state, extra.get("optimizer"), extra.get("schedule"), extra.get("rng"),
        extra.get("scores"), extra.get("scores_by_rank"), extra.get("loss_scale"),
    )  # fmt: skip


def lost_checksums(directory: Path, state: Any = None) -> bool:
    """A checkpoint without its ``checksums.json`` that had one: its ``state.json`` (``state``, read when not
    given) says it was written with one, or another checkpoint of its run has its own. Only one from a usaf before
    the records is read unchecked."""
    if (directory / SUMS_FILE).exists():
        return False
    if state is None:
        try:
            state = json.loads((directory / STATE_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            state = None
    if isinstance(state, dict) and state.get(CHECKSUMMED) is True:
        return True
    run = run_of_checkpoint(directory) or directory.parent
    others = [d for d in (run / CHECKPOINTS_DIR).glob("step-*") if not d.name.endswith(".tmp")] + [run / FINAL_DIR]
    return any(other.resolve() != directory.resolve() and (other / SUMS_FILE).is_file() for other in others)


def run_settings_text(record: dict) -> str:
    """``run-settings.json``'s text: ``record`` and the sha256 of its contents (:func:`read_run_settings`)."""
    body = {key: value for key, value in record.items() if key != SETTINGS_SHA256}  # one read back and rewritten
    return json.dumps({**body, SETTINGS_SHA256: _settings_sha256(body)}, indent=1)


def read_run_settings(path: Path) -> Any:
    """A run's settings record as :func:`run_settings_text` wrote it, its sha256 checked and taken out; None where
    it does not read (no file, not JSON). One without the sha256 (a usaf before it) reads as it is. Refused where
    the sha256 is not that of what it holds: the run's checkpoints were trained with what it held before."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or SETTINGS_SHA256 not in record:
        return record
    recorded = record.pop(SETTINGS_SHA256)
    if recorded != _settings_sha256(record):
        raise UsafError(
            f"{path}: changed since usaf wrote it (its {SETTINGS_SHA256} is not the sha256 of what it holds): the "
            "run's checkpoints were trained with the settings it held",
            "put back what was edited: a run goes on with the settings it started with (to train with others, start "
            "another run: another --out, or --overwrite)",
        )
    return record


def _settings_sha256(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def newest_intact_checkpoint(run_dir: Path) -> Path | None:
    """The newest ``checkpoints/step-N`` of ``run_dir`` whose files match its checksums, or None: what a finished run
    whose ``final/`` is damaged still offers (its last one holds the same change as ``final/``)."""
    try:
        done = checkpoint_dirs(run_dir, flag="--checkpoint")
    except UsafError:  # a step-N name that is none
        return None
    return next((d for d in reversed(done) if changed_checkpoint_files(d) == []), None)


def check_finite(path: Path, tensors: dict, *, flag: str, hint: str) -> None:
    """Refuse a NaN or Inf in any floating tensor of a checkpoint's or delta's file: applied, it makes NaN weights."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(tensor.isfinite().all()):
            raise UsafError(f"{flag} {path}: {name} holds NaN or Inf values", hint)


_STEP_DIR = re.compile(r"step-(\d+)")


def _check_step(directory: Path, state: Any, max_step: int | None, *, flag: str, hint: str) -> None:
    """The recorded step: a whole number from 0 to the run's steps, the one a ``step-N`` name says."""
    path = directory / STATE_FILE
    step = state.get("step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise UsafError(f"{flag} {path}: step {step!r} is not a step (a whole number from 0)", hint)
    if max_step is not None and step > max_step:
        raise UsafError(f"{flag} {path}: step {step} is beyond the run's {max_step} steps", hint)
    if directory.parent.name == CHECKPOINTS_DIR:
        named = step_of(directory, flag=flag)
        if named != step:
            raise UsafError(f"{flag} {directory}: its name says step {named}, its {STATE_FILE} says step {step}", hint)


def step_of(directory: Path, *, flag: str) -> int:
    """The step a ``checkpoints/step-N`` directory's name records; refused when it records none."""
    match = _STEP_DIR.fullmatch(directory.name)
    if match is None:
        raise UsafError(
            f"{flag} {directory}: not a checkpoint name (step-N, N the step)",
            "rename it back, or remove it: usaf names checkpoints step-0000050",
        )
    return int(match.group(1))


def checkpoint_dirs(run_dir: Path, *, flag: str) -> list[Path]:
    """A run's complete checkpoints (their state file is written last), oldest first by step number.

    A complete ``step-*`` directory whose name is not a step is refused, not skipped or sorted as text: it
    would decide which checkpoint is the newest.
    """
    directory = Path(run_dir) / CHECKPOINTS_DIR
    if not directory.is_dir():
        return []
    complete = [p for p in directory.glob("step-*") if not p.name.endswith(".tmp") and (p / STATE_FILE).is_file()]
    return sorted(complete, key=lambda p: step_of(p, flag=flag))


def changed_checkpoint_files(directory: Path) -> list[str] | None:
    """A checkpoint's files whose bytes are not those its ``checksums.json`` records (``usaf inspect --verify``), or
    None: a checkpoint of a usaf from before those records."""
    return unmatched(directory, [name for name in CHECKPOINT_FILES if name != SUMS_FILE], directory / SUMS_FILE)


def _delta_records(tensors: dict, directory: Path, *, flag: str, hint: str) -> dict[str, DeltaRecord]:
    # lazy: torch and safetensors stay out of usaf.artifacts' import time (manifests are read without them)
    import torch

    suffix = "." + _DELTA_KEYS["cumulative"][0]
    records = {}
    for key in tensors:
        if not key.endswith(suffix):
            continue
        name = key[: -len(suffix)]
        pairs = {}
        for part, (ikey, vkey) in _DELTA_KEYS.items():
            indices, values = tensors.get(f"{name}.{ikey}"), tensors.get(f"{name}.{vkey}")
            if indices is None and values is None and part != "cumulative":
                pairs[part] = None
                continue
            wrong_dtype = part == "cumulative" and indices is not None and indices.dtype != torch.int64
            if indices is None or values is None or values.shape != indices.shape or wrong_dtype:
                raise UsafError(f"{flag} {directory}: malformed delta for {name}", hint)
            pairs[part] = (indices, values)
        records[name] = DeltaRecord(**pairs)
    return records


# -- reading what a run trained ------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainedChange:
    """Everything a run changed in its quantized model, ready to apply (``SparseEngine.apply_change``).

    ``deltas[name] = (indices (m,) int64, values (m,) fp32)``: sorted flat indices into the stored
    ``(E, O, I)`` expert tensor and the cumulative delta there (frozen-by-reselection ∪ active), so the
    trained weight is ``dequantize(q) + delta``. ``routers[name]``: the trained router weights (fp32).
    """

    source: Path
    fingerprint: str  # identifies the change: the run manifest's fingerprint, or the checkpoint's content
    model_fingerprint: str
    trainable_layers: list[int]
    deltas: dict[str, tuple[torch.Tensor, torch.Tensor]]
    routers: dict[str, torch.Tensor]

    @property
    def expert_entries(self) -> int:
        return sum(int(i.numel()) for i, _ in self.deltas.values())


def load_trained_change(path: Path, *, flag: str = "--checkpoint") -> TrainedChange:
    """Read a finished run (its ``final/``), an unfinished run (its newest checkpoint), one checkpoint,
    or a delta exported by ``usaf export --format delta``.

    Raises UsafError naming ``flag`` when the directory is none of these or its files are damaged.
    """
    path = Path(os.path.abspath(path))  # the change's source, named in reports: a relative one (or with ..; review)
    if not path.is_dir():
        raise UsafError(f"{flag} {path}: {not_a(path, 'directory')}", "pass a run directory written by usaf train")
    if path.name == FINAL_DIR and (path.parent / "manifest.json").is_file():  # RUN/final: the finished run itself
        path = path.parent  # (its checkpoint's run was looked for two levels up; found in review)
    if (path / "manifest.json").is_file():
        if read_manifest_json(path, flag=flag)["kind"] == DeltaManifest.KIND:
            return read_delta(path, load_verified(path, DeltaManifest, flag=flag), flag=flag)
        try:
            manifest = load_verified(path, RunManifest, flag=flag)
        except UsafError as e:  # "re-run the stage" needs --overwrite, which discards every checkpoint (review)
            intact = newest_intact_checkpoint(path)
            if intact is None:
                raise
            raise UsafError(e.message, f"its newest checkpoint is intact: pass {flag} {intact} (step "
                            f"{step_of(intact, flag=flag)})") from None  # fmt: skip
        return _read_checkpoint(
            path / FINAL_DIR,
            flag=flag,
            source=path,
            fingerprint=manifest.fingerprint,
            model_fingerprint=manifest.summary.model_fingerprint,
            layers=manifest.summary.trainable_layers,
            max_step=manifest.summary.steps,
        )
    checkpoint, run_dir = path, path.parent.parent
    if not (path / STATE_FILE).is_file():  # an unfinished run directory: its newest complete checkpoint
        run_dir = path
        done = checkpoint_dirs(path, flag=flag)
        if not done:
            if (path / SETTINGS_FILE).is_file():  # it was called "not a usaf run" (found in review)
                raise UsafError(
                    f"{flag} {path}: an unfinished usaf run with no checkpoint yet",
                    "wait for its first checkpoint (--save-every), or resume it with the same usaf train command",
                )
            if (inside := holds_artifacts(path, flag, ("run", "delta"))) is not None:  # a workspace's run/ (review)
                raise inside
            raise UsafError(
                f"{flag} {path}: not a usaf run (no manifest.json, no checkpoint)",
                "pass the --out directory of usaf train, or one of its checkpoints/step-N",
            )
        checkpoint = done[-1]
    settings = run_dir / SETTINGS_FILE
    try:
        record = read_run_settings(settings)
        model_fingerprint = record["model_fingerprint"]
        steps = record.get("steps")  # None for a run of --epochs
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # None, or no dict: a TypeError
        raise UsafError(
            f"{flag} {checkpoint}: its run's {SETTINGS_FILE} is missing or unreadable",
            "pass the run directory written by usaf train",
        ) from None
    return _read_checkpoint(
        checkpoint,
        flag=flag,
        source=checkpoint,
        fingerprint=None,
        model_fingerprint=model_fingerprint,
        layers=None,
        max_step=steps if isinstance(steps, int) else None,
    )


def checkpoint_fingerprint(directory: Path, model_fingerprint: str) -> str:
    """What a checkpoint changes, by content: its deltas and routers over its model.

    Not its name: every run of a model has a ``step-0000050``, and eval keys the fine-tuned pass it keeps on this
    (two runs' checkpoints of one name took each other's kept pass when the name was the identity).
    """
    files = ((name, sha256_file(directory / name)) for name in (DELTAS_FILE, ROUTERS_FILE))
    return combine([("model", model_fingerprint), *files])


def _read_checkpoint(
    directory: Path,
    *,
    flag: str,
    source: Path,
    fingerprint: str | None,
    model_fingerprint: str,
    layers: list[int] | None,
    max_step: int | None,
) -> TrainedChange:
    """``fingerprint``: the run manifest's; None: the checkpoint's own, by content (once its files read as intact)."""
    checkpoint = read_checkpoint(
        directory, flag=flag, full=False, hint="pass an intact run or checkpoint", max_step=max_step
    )
    if fingerprint is None:
        fingerprint = checkpoint_fingerprint(directory, model_fingerprint)
    deltas = {name: (r.cumulative[0], r.cumulative[1].float()) for name, r in checkpoint.deltas.items()}
    if not deltas:
        raise UsafError(f"{flag} {directory}: the checkpoint holds no deltas", "pass an intact run or checkpoint")
    if layers is None:
        layers = sorted({int(m.group(1)) for n in deltas if (m := re.search(r"layers\.(\d+)\.", n))})
    return TrainedChange(source, fingerprint, model_fingerprint, list(layers), deltas, checkpoint.routers)


def read_metrics(path: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """``(step, loss)`` of training steps and ``(step, eval_loss)`` from a run's ``metrics.jsonl``.

    Lines that are not step or eval records (reselections), not JSON (a line cut by a crash) or whose step or loss
    is not a number (an edited line: a traceback after the whole run before; found in review) are skipped: the plot
    shows what the run logged.
    """
    train, held = [], []
    for raw in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(record, dict) or not _is_int(record.get("step")):
            continue
        if _is_number(record.get("eval_loss")):
            held.append((record["step"], float(record["eval_loss"])))
        elif _is_number(record.get("loss")) and not record.get("skipped", False):
            train.append((record["step"], float(record["loss"])))
    return train, held


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def trim_metrics(run_dir: Path, step: int) -> int:
    """Drop ``metrics.jsonl`` records of steps after ``step`` (a resumed run logs them again); returns how many.

    A run killed after its last checkpoint logged steps the resumed run repeats from that checkpoint;
    kept, they would appear twice in the loss curve of ``usaf eval``.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
        if not line.endswith("\n"):  # the last line, cut short by the kill
            dropped += 1
            continue
        try:
            record = json.loads(line)
            at = record["step"] if "step" in record else record["reselection"]["step"]
        except (ValueError, KeyError, TypeError):
            at = None  # not a step record: kept
        if _is_int(at) and at > step:  # an edited step of another type is no step record either (found in review)
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        write_text_atomic(path, "".join(kept))
    return dropped
