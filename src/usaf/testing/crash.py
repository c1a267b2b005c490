"""Crash safety: SIGKILL ``usaf quantize`` and ``usaf train`` at random moments, rerun, and compare.

For each stage, an uninterrupted *reference* run (in a child process, with its writes numbered by
:mod:`usaf.testing.crash_child`) gives the number of write events ``N`` and the wall time ``T``.
Then each *trial* runs the same command into a fresh output and kills it:

- ``event``: at a random write event ``1..N`` (a random fraction of a file written, a rename not
  done, a tree half removed; checkpoint writes included), the child sends itself SIGKILL;
- ``time``: the harness sends SIGKILL after a random delay counted from the process's first write, up to
  the reference's time from its first write to its last.

After the kill it checks that no corrupted artifact is visible (the output is absent or verifies;
every visible train checkpoint loads), reruns the *same command* to completion, and checks that the
result equals the reference (byte-identical files) and that nothing finished before the kill was
redone or lost: the rerun of ``train`` resumes from the newest checkpoint on disk (that is, the
last one whose rename the events log shows completed), the rerun of ``quantize`` does not
quantize again a layer whose file was complete.
"""

from __future__ import annotations

import abc
import json
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from typer.testing import CliRunner

from usaf.artifacts import QuantizedModelManifest, RunManifest, load_manifest, load_verified
from usaf.artifacts.run import read_checkpoint
from usaf.cli.app import app
from usaf.errors import UsafError
from usaf.stages.quantize import QuantizeConfig
from usaf.stages.quantize import run as quantize
from usaf.stages.train.resume import latest_checkpoint
from usaf.testing import build_tiny_model

STEP_DIR = re.compile(r"checkpoints/step-(\d+)$")
DISK_FULL = "disk-full"
WRITE_KINDS = ("save_file", "torch.save", "write_text", "ptfile.add")  # where a disk can fill (disk-full mode)
LAYER_TMP = re.compile(r"layers/(layer-\d+)\.tmp$")


@dataclass
class Trial:
    stage: str
    mode: str  # "event" or "time"
    kill_at: int = 0  # the event number (event mode)
    fraction: float = 0.0  # of the torn file (event mode)
    delay_s: float = 0.0  # time mode
    killed: bool = False
    event: str = ""  # the write the kill landed on: "kind path" (event mode), the last logged one (time mode)
    torn: bool = False  # a file was left partly written at the kill (negative control: a kill mid-write)
    torn_bytes: int = -1  # that file's size on disk right after the kill
    visible_after_kill: str = ""  # what a consumer would see: "nothing", "complete artifact", ...
    resumed_from: int | None = None  # train: the step the rerun resumed from
    last_checkpoint: int | None = None  # train: the newest checkpoint complete on disk after the kill
    complete_layers: list[str] = field(default_factory=list)  # quantize: layer files complete after the kill
    redone: list[str] = field(default_factory=list)  # quantize: complete layers quantized again
    equal_to_reference: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def survived(self) -> bool:
        return self.killed and not self.problems


def _events(path: Path) -> list[tuple[int, str, str]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        n, kind, target = line.split("\t", 2)
        out.append((int(n), kind, target))
    return out


def _child(events: Path, kill_at: int | str, fraction: float, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "usaf.testing.crash_child", str(events), str(kill_at), str(fraction), "--", *args]


class Stage(abc.ABC):
    """One command under test: how to run it into an output, check what is visible, compare results."""

    name = ""

    @abc.abstractmethod
    def args(self, out: Path) -> list[str]: ...

    def output(self, out: Path) -> Path:
        return out

    @abc.abstractmethod
    def check_visible(self, out: Path) -> tuple[str, list[str]]: ...

    @abc.abstractmethod
    def compare(self, out: Path, reference: Path) -> list[str]: ...

    def check_rerun(self, trial: Trial, out: Path, before: list, rerun_events: list, stderr: str) -> list[str]:
        return []


def _verified(path: Path, manifest_cls) -> list[str]:
    try:
        load_verified(path, manifest_cls, flag="--out")
    except UsafError as e:
        return [f"a visible artifact does not verify: {e.message}"]
    return []


def _same_files(a: Path, b: Path, names: list[str]) -> list[str]:
    problems = []
    for name in names:
        if not (a / name).is_file():
            problems.append(f"{name}: missing")
        elif (a / name).read_bytes() != (b / name).read_bytes():
            problems.append(f"{name}: differs from the uninterrupted run")
    return problems


def same_artifact(out: Path, reference: Path, manifest_cls) -> list[str]:
    """The rerun's artifact verifies and equals the uninterrupted run's: the same files, byte for byte, and
    the same fingerprint."""
    problems = _verified(out, manifest_cls)
    if problems:
        return problems
    mine, ref = load_manifest(out, manifest_cls), load_manifest(reference, manifest_cls)
    if [f.path for f in mine.files] != [f.path for f in ref.files]:
        problems.append(f"other files than the uninterrupted run: {[f.path for f in mine.files]}")
    problems += _same_files(out, reference, [f.path for f in ref.files])
    if mine.fingerprint != ref.fingerprint:
        problems.append("fingerprint differs from the uninterrupted run")
    return problems


class QuantizeStage(Stage):
    name = "quantize"

    def __init__(self, model: Path) -> None:
        self.model = model

    def args(self, out: Path) -> list[str]:
        return ["quantize", str(self.model), "--out", str(out), "--method", "rtn", "--group-size", "8"]

    def check_visible(self, out: Path) -> tuple[str, list[str]]:
        if not out.exists():
            return "nothing (a hidden partial directory to resume)", []
        return "a complete artifact", _verified(out, QuantizedModelManifest)

    def compare(self, out: Path, reference: Path) -> list[str]:
        problems = same_artifact(out, reference, QuantizedModelManifest)
        partial = out.parent / f".{out.name}.usaf-partial"
        if partial.exists():
            problems.append(f"{partial.name} left after the rerun")
        return problems

    def check_rerun(self, trial: Trial, out: Path, before: list, rerun_events: list, stderr: str) -> list[str]:
        # layers whose file was complete when the process died must not be quantized again
        saved = {m.group(1) for _, kind, path in rerun_events if kind == "torch.save" and (m := LAYER_TMP.search(path))}
        trial.redone = sorted(saved & set(trial.complete_layers))
        return [f"complete layers quantized again: {trial.redone}"] if trial.redone else []


class TrainStage(Stage):
    name = "train"

    def __init__(self, quantized: Path, tokens: Path, plan: Path, steps: int = 8, save_every: int = 2) -> None:
        self.quantized, self.tokens, self.plan = quantized, tokens, plan
        self.steps, self.save_every = steps, save_every

    def args(self, out: Path) -> list[str]:
        return [
            "train", "--model", str(self.quantized), "--data", str(self.tokens), "--plan", str(self.plan),
            "--out", str(out), "--steps", str(self.steps), "--save-every", str(self.save_every),
            "--reselect-every", str(self.steps // 2), "--lr", "0.01", "--router-lr", "0.001", "--seed", "3",
        ]  # fmt: skip

    def check_visible(self, out: Path) -> tuple[str, list[str]]:
        if not out.exists():
            return "nothing", []
        problems = []
        if (out / "manifest.json").exists():
            problems += _verified(out, RunManifest)
            seen = "a complete run"
        else:
            seen = "an unfinished run directory (no manifest)"
        for checkpoint in sorted((out / "checkpoints").glob("step-*")):
            if checkpoint.name.endswith(".tmp"):
                continue
            problems += [f"{checkpoint.name}: {p}" for p in _checkpoint_problems(checkpoint)]
        final = out / "final"
        if final.exists():
            problems += [f"final: {p}" for p in _checkpoint_problems(final)]
        return seen, problems

    def compare(self, out: Path, reference: Path) -> list[str]:
        problems = _verified(out, RunManifest)
        if problems:
            return problems
        mine, ref = load_manifest(out, RunManifest), load_manifest(reference, RunManifest)
        problems += _same_files(out, reference, [f.path for f in ref.files])
        if mine.fingerprint != ref.fingerprint:
            problems.append("fingerprint (final deltas, routers, optimizer, state) differs from the uninterrupted run")
        keys = ("steps", "tokens", "skipped_steps", "first_loss", "final_loss", "loss_window", "first_losses_mean",
                "last_losses_mean", "eval_losses", "reselections")
        a, b = mine.summary.model_dump(), ref.summary.model_dump()
        problems += [f"summary {k}: {a[k]} != {b[k]}" for k in keys if a[k] != b[k]]
        metrics, ref_metrics = _step_losses(out), _step_losses(reference)
        if metrics != ref_metrics:
            problems.append(f"metrics.jsonl: step records {metrics} != {ref_metrics} of the uninterrupted run")
        left = sorted(p.name for p in (out / "checkpoints").glob("*.tmp"))
        if left:
            problems.append(f"temporary checkpoints left after the rerun: {left}")
        return problems

    def check_rerun(self, trial: Trial, out: Path, before: list, rerun_events: list, stderr: str) -> list[str]:
        match = re.search(r"resuming from \S+ \(step (\d+) of", stderr)
        trial.resumed_from = int(match.group(1)) if match else None
        if trial.resumed_from != trial.last_checkpoint:
            return [f"resumed from step {trial.resumed_from}, the newest checkpoint on disk is {trial.last_checkpoint}"]
        return []


def _step_losses(run: Path) -> list[tuple[int, float]]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r and "step" in r]


def _checkpoint_problems(directory: Path) -> list[str]:
    """A visible checkpoint must load completely (what --resume and export read)."""
    try:
        read_checkpoint(directory)
    except UsafError as e:
        return [f"does not load: {getattr(e, 'message', e)}"]
    return []


def _latest_checkpoint(out: Path) -> int | None:
    found = latest_checkpoint(out) if out.exists() else None
    return int(found.name.split("-")[1]) if found is not None else None


@dataclass
class Reference:
    path: Path
    events: int
    first_event_s: float
    seconds: float
    log: list = field(default_factory=list)  # (number, kind, path) of every write event
    last_event_s: float = 0.0  # when the last write event was logged (the process then only exits)


def run_reference(stage: Stage, root: Path, *, timeout: float = 600) -> Reference:
    out, events = root / f"{stage.name}-reference", root / f"{stage.name}-reference.events"
    start = time.perf_counter()
    proc = subprocess.Popen(_child(events, 0, 0.0, stage.args(out)), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first, last, size = None, 0.0, 0
    while proc.poll() is None:
        now = events.stat().st_size if events.is_file() else 0
        if now != size:
            size, last = now, time.perf_counter() - start
            first = last if first is None else first
        time.sleep(0.005)
    seconds = time.perf_counter() - start
    stdout, stderr = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the reference {stage.name} run failed: {stderr.decode()[-2000:]}")
    log = _events(events)
    return Reference(out, len(log), first or 0.0, seconds, log, last or seconds)


def run_trial(
    stage: Stage,
    reference: Reference,
    root: Path,
    number: int,
    rng: random.Random,
    mode: str,
    *,
    kill_at: int | None = None,
    fraction: float | None = None,
) -> Trial:
    """One killed run and its rerun; ``kill_at``/``fraction`` pick the event instead of ``rng`` (event mode).

    ``mode``: ``event`` (SIGKILL at a write event), ``time`` (SIGKILL after a delay) or ``disk-full`` (the
    disk fills at a random file write: the run must answer in one error line, leave nothing torn, and
    the same command, rerun, must finish as the uninterrupted run did).
    """
    out = root / f"{stage.name}-{number:03d}"
    events = root / f"{stage.name}-{number:03d}.events"
    trial = Trial(stage.name, mode)
    if mode in ("event", DISK_FULL):
        writes = [n for n, kind, _ in reference.log if kind in WRITE_KINDS]
        default = rng.choice(writes) if mode == DISK_FULL else rng.randint(1, reference.events)
        trial.kill_at = kill_at if kill_at is not None else default
        trial.fraction = fraction if fraction is not None else round(rng.random(), 3)
        spec = f"{trial.kill_at}:enospc" if mode == DISK_FULL else trial.kill_at
        proc = subprocess.run(_child(events, spec, trial.fraction, stage.args(out)), capture_output=True, timeout=600)
        returncode = proc.returncode
    else:
        # the delay runs from the process's own first write (imports and model loading take a varying time
        # on a shared machine), up to the reference's time from its first write to its last
        trial.delay_s = round(rng.uniform(0, max(reference.last_event_s - reference.first_event_s, 0.01)), 3)
        child = subprocess.Popen(
            _child(events, 0, 0.0, stage.args(out)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        while child.poll() is None and not (events.is_file() and events.stat().st_size):
            time.sleep(0.002)
        try:
            child.wait(timeout=trial.delay_s)
        except subprocess.TimeoutExpired:
            child.send_signal(signal.SIGKILL)
        returncode = child.wait()
    before = _events(events)
    kill_line = [e for e in before if e[1] in ("KILL", "FAULT")]
    if mode == DISK_FULL:
        trial.killed = bool(kill_line)  # the fault landed (the run then answers it, or goes on without it)
        trial.problems += _disk_full_answer(stage, out, returncode, proc.stderr.decode())
    else:
        trial.killed = returncode == -signal.SIGKILL
    if kill_line:
        trial.event = " ".join(_landed_on(before, kill_line))
    elif before:
        trial.event = f"after {before[-1][1]} {before[-1][2]}"
    trial.event = trial.event.replace(str(root) + "/", "")
    if not trial.killed:
        if returncode != 0:
            trial.problems.append(f"the run ended with status {returncode}, not by the kill")
        return trial  # finished before the kill: nothing to test here
    if mode == DISK_FULL and returncode == 0:  # an optional write (eval's base cache): the run went on
        trial.visible_after_kill = "finished without the optional write"
        trial.problems += stage.compare(out, reference.path)
        trial.equal_to_reference = not trial.problems
        return trial
    trial.torn = _torn(before, kill_line, trial)
    if trial.torn:
        torn_path = Path(_landed_on(before, kill_line)[1])
        trial.torn_bytes = torn_path.stat().st_size if torn_path.is_file() else -1
    trial.visible_after_kill, problems = stage.check_visible(out)
    trial.problems += problems
    if isinstance(stage, TrainStage):
        trial.last_checkpoint = _latest_checkpoint(out)
        completed = [int(m.group(1)) for n, kind, path in before if kind == "replace" and (m := STEP_DIR.search(path))
                     and not (kill_line and n == kill_line[0][0])]  # fmt: skip
        if mode != "time" and (max(completed) if completed else None) != trial.last_checkpoint:
            trial.problems.append(
                f"checkpoints completed before the kill {completed}, newest on disk {trial.last_checkpoint}"
            )
    if isinstance(stage, QuantizeStage):
        layers = out.parent / f".{out.name}.usaf-partial" / "layers"
        trial.complete_layers = sorted(p.stem for p in layers.glob("layer-*.pt")) if layers.is_dir() else []
    if (out / "manifest.json").is_file():  # killed after the commit: the artifact is complete, nothing to rerun
        trial.problems += stage.compare(out, reference.path)
        trial.equal_to_reference = not trial.problems
        return trial
    rerun_events = root / f"{stage.name}-{number:03d}.rerun.events"
    rerun = subprocess.run(_child(rerun_events, 0, 0.0, stage.args(out)), capture_output=True, timeout=600)
    if rerun.returncode != 0:
        trial.problems.append(f"the rerun failed ({rerun.returncode}): {rerun.stderr.decode()[-600:]}")
        return trial
    trial.problems += stage.check_rerun(trial, out, before, _events(rerun_events), rerun.stderr.decode())
    problems = stage.compare(out, reference.path)
    trial.equal_to_reference = not problems
    trial.problems += problems
    return trial


def _disk_full_answer(stage: Stage, out: Path, returncode: int, stderr: str) -> list[str]:
    """A full disk's answer: one error line naming the output and the cause, exit 2, no temporaries left."""
    if returncode == 0:
        return []  # judged by comparing the finished output (an optional write was skipped)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    problems = [] if returncode == 2 else [f"exit status {returncode}, not 2: {stderr[-400:]}"]
    if len(errors) != 1 or "Traceback" in stderr:
        problems.append(f"{len(errors)} error lines{' and a traceback' if 'Traceback' in stderr else ''}")
    elif str(out) not in errors[0] or "no space left on the disk" not in errors[0]:
        problems.append(f"the error line does not name the output and the cause: {errors[0]}")
    return problems + [f"left after the full disk: {name}" for name in _temporaries_of(out)]


def _temporaries_of(out: Path) -> list[str]:
    """Temporary siblings of ``out``, and temporaries inside it or its resumable partial directory."""
    names = [p.name for p in out.parent.glob(f".{out.name}.usaf-*") if not p.name.endswith(".usaf-partial")]
    for directory in (out, out.parent / f".{out.name}.usaf-partial"):
        if directory.is_dir():
            names += [str(p.relative_to(out.parent)) for p in directory.rglob("*")
                      if p.name.endswith(".tmp") or ".usaf-tmp-" in p.name]  # fmt: skip
    return sorted(names)


def _landed_on(before: list, kill_line: list) -> tuple[str, str]:
    """(kind, path) of the write event the kill or the fault landed on."""
    return next((kind, path) for n, kind, path in before if n == kill_line[0][0] and kind not in ("KILL", "FAULT"))


def _torn(before: list, kill_line: list, trial: Trial) -> bool:
    """Whether the kill left a file partly written (event mode: a write event cut short)."""
    if not kill_line or trial.mode != "event":
        return False
    kind = _landed_on(before, kill_line)[0]
    if kind == "ptfile.add":  # the streaming writer's temporary holds the layers added so far
        return True
    return kind in ("save_file", "torch.save", "write_text") and 0 < trial.fraction < 1


def run_stage(
    stage: Stage, root: Path, *, kills: int, seed: int, time_share: float = 1 / 3, disk_full: int = 0
) -> dict:
    """The reference run plus ``kills`` killed trials and ``disk_full`` full-disk trials; a JSON-able record."""
    rng = random.Random(seed)
    reference = run_reference(stage, root)
    trials = []
    for number in range(kills):
        mode = "time" if rng.random() < time_share else "event"
        trials.append(run_trial(stage, reference, root, number, rng, mode))
    for number in range(kills, kills + disk_full):
        trials.append(run_trial(stage, reference, root, number, rng, DISK_FULL))
    return {
        "stage": stage.name,
        "seed": seed,
        "reference": {
            "events": reference.events,
            "seconds": round(reference.seconds, 2),
            "writing_seconds": round(reference.last_event_s - reference.first_event_s, 2),
        },
        "trials": [{**asdict(t), "survived": t.survived} for t in trials],
    }


@dataclass
class Setup:
    model: Path
    quantized: Path
    tokens: Path
    plan: Path


def build_setup(root: Path, *, num_layers: int = 4) -> Setup:
    """A tiny qwen3_moe model, its quantization, a tokens file and a plan (in-process, a few seconds)."""
    model = build_tiny_model("qwen3_moe", root / "model", tokenizer=True, num_layers=num_layers)
    _, quantized = quantize(QuantizeConfig(model=str(model), out=root / "quantized", method="rtn", group_size=8))
    rng = random.Random(0)
    tokens = root / "tokens.jsonl"
    with tokens.open("w", encoding="utf-8") as f:
        for _ in range(16):
            ids = [rng.randrange(1, 512) for _ in range(24)]
            f.write(json.dumps({"input_ids": ids, "labels": ids}) + "\n")
    plan = root / "plan"
    result = CliRunner().invoke(
        app,
        ["score", "--model", str(quantized), "--data", str(tokens), "--out", str(plan), "--frac", "0.05",
         "--calib-samples", "8", "--train-from", "1", "--no-stability"],
    )  # fmt: skip
    if result.exit_code != 0:
        raise RuntimeError(result.output)
    return Setup(model, quantized, tokens, plan)
