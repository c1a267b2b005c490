"""Hostile output paths: an ``--out`` that is, contains or lies inside an input, a user's directory with
``--overwrite``, a symbolic link, a file, an output another process is writing, for every command that writes.

Every case copies the inputs it names into its own directory first, so a command that did delete one would
delete only that copy, and checks afterwards (``Case.after``) that the inputs and the user's files are byte for
byte as they were and that a link is still a link.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
from pathlib import Path

from typer.testing import CliRunner

from usaf.artifacts.lock import LOCK_TAG, OutputLock
from usaf.cli.app import app
from usaf.testing.hostile import Bench, Case

COLLISION = "output paths: an input as --out"
REPLACE = "output paths: what may be replaced"
READERS = (COLLISION, REPLACE)

INPUTS = "inputs"  # the case directory's copy of the inputs
USER_FILE = "notes.txt"


@functools.cache
def _plan_and_run(root: str) -> tuple[Path, Path]:
    """A plan and a finished 2-step run on the bench's quantized model (made once per bench)."""
    bench_root = Path(root)
    bench = Bench(bench_root, bench_root / "model", bench_root / "quantized", bench_root / "tokens.jsonl")
    plan, run = bench_root / "outputs-plan", bench_root / "outputs-run"
    for args in (
        ["score", "--model", bench.quantized, "--data", bench.tokens, "--out", plan, "--frac", "0.05",
         "--calib-samples", "4", "--no-stability"],
        ["train", "--model", bench.quantized, "--data", bench.tokens, "--plan", plan, "--out", run, "--steps", "2"],
    ):  # fmt: skip
        result = CliRunner().invoke(app, [str(a) for a in args])
        if result.exit_code != 0:
            raise RuntimeError(f"the bench's run failed: {result.output}")
    return plan, run


def _inputs(bench: Bench, case_dir: Path) -> dict[str, Path]:
    """The case's own copies of every input a command may read."""
    top = case_dir / INPUTS
    top.mkdir(parents=True, exist_ok=True)
    plan, run = _plan_and_run(str(bench.root))
    corpus = top / "corpus"
    corpus.mkdir()
    (corpus / "code.py").write_text("def f(x):\n    return x + 1\n" * 20, encoding="utf-8")
    tokens = Path(shutil.copy(bench.tokens, top / "tokens.jsonl"))
    return {
        "model": Path(shutil.copytree(bench.model, top / "model")),
        "quantized": Path(shutil.copytree(bench.quantized, top / "quantized")),
        "tokens": tokens,
        "corpus": corpus,
        "plan": Path(shutil.copytree(plan, top / "plan")),
        "run": Path(shutil.copytree(run, top / "run")),
    }


def _command(name: str, p: dict[str, Path], out: Path) -> list[str]:
    """The command ``name`` reading the case's inputs and writing ``out``."""
    q, t = str(p["quantized"]), str(p["tokens"])
    return {
        "tokenize": ["tokenize", str(p["corpus"]), "--model", str(p["model"]), "--out", str(out)],
        "quantize": ["quantize", str(p["model"]), "--method", "rtn", "--group-size", "8", "--out", str(out)],
        "score": ["score", "--model", q, "--data", t, "--out", str(out), "--calib-samples", "2", "--no-stability"],
        "train": ["train", "--model", q, "--data", t, "--plan", str(p["plan"]), "--steps", "1", "--out", str(out)],
        "eval": ["eval", "--model", q, "--checkpoint", str(p["run"]), "--data", t, "--no-plots", "--out", str(out)],
        "export": ["export", "--model", q, "--checkpoint", str(p["run"]), "--format", "delta", "--out", str(out)],
        "tiny-model": ["tiny-model", str(out), "--layers", "2"],
    }[name]


REPLACE_FLAG = {"quantize": "--force"}  # the others: --overwrite


def _flag(name: str) -> str:
    return REPLACE_FLAG.get(name, "--overwrite")


def _snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and LOCK_TAG not in p.name
    }


_BEFORE: dict[str, dict[str, str]] = {}  # case directory -> its inputs' snapshot, taken when the case is built


def _intact(case_dir: Path) -> list[str]:
    before, after = _BEFORE.pop(str(case_dir), {}), _snapshot(case_dir / INPUTS)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    return [f"inputs changed: {changed[:5]}"] if changed else []


# (command, the input the output collides with, its flag in the message, the shape)
COLLISIONS = [
    ("tokenize", "corpus", "INPUTS", "is"), ("tokenize", "corpus", "INPUTS", "lies inside"),
    ("tokenize", "model", "--model", "is"), ("tokenize", "all", "INPUTS", "contains"),
    ("quantize", "model", "MODEL", "is"), ("quantize", "model", "MODEL", "lies inside"),
    ("quantize", "all", "MODEL", "contains"),
    ("score", "quantized", "--model", "is"), ("score", "quantized", "--model", "lies inside"),
    ("score", "tokens", "--data", "is"), ("score", "all", "--model", "contains"),
    ("train", "quantized", "--model", "is"), ("train", "plan", "--plan", "is"),
    ("train", "plan", "--plan", "lies inside"), ("train", "tokens", "--data", "is"),
    ("train", "all", "--model", "contains"),
    ("eval", "run", "--checkpoint", "is"), ("eval", "run", "--checkpoint", "lies inside"),
    ("eval", "quantized", "--model", "is"), ("eval", "tokens", "--data", "is"), ("eval", "all", "--model", "contains"),
    ("export", "run", "--checkpoint", "is"), ("export", "run", "--checkpoint", "lies inside"),
    ("export", "quantized", "--model", "is"), ("export", "quantized", "--model", "lies inside"),
    ("export", "all", "--model", "contains"),
]  # fmt: skip


def _collision_case(command: str, which: str, flag: str, shape: str, replace: bool) -> Case:
    def build(bench: Bench, case_dir: Path) -> list[str]:
        paths = _inputs(bench, case_dir)
        out = paths[which] if which != "all" else case_dir / INPUTS
        out = out / "sub" if shape == "lies inside" else out
        args = _command(command, paths, out)
        _BEFORE[str(case_dir)] = _snapshot(case_dir / INPUTS)
        return args + ([_flag(command)] if replace else [])

    flag_note = f" with {_flag(command)}" if replace else ""
    name = f"{command}: --out {shape} {'its inputs' if which == 'all' else 'its ' + flag}{flag_note}"
    needle = f"{shape} the input {flag}" if flag.startswith("-") else f"{shape} the input "  # a positional: its path
    return Case(COLLISION, name, build, needle, after=_intact)


def _existing_case(command: str, what: str, replace: bool) -> Case:
    """``--out`` where something that is not a usaf artifact already is: a user's directory, a file, a link."""

    def build(bench: Bench, case_dir: Path) -> list[str]:
        paths = _inputs(bench, case_dir)
        target = case_dir / INPUTS / "mine"
        target.mkdir(parents=True)
        (target / USER_FILE).write_text("my own work\n")
        out = case_dir / "link"
        if what == "a user's directory":
            out = target
        elif what == "a file":
            out = case_dir / INPUTS / "file.txt"
            out.write_text("a file of mine\n")
        elif what == "a link to a user's directory":
            out.symlink_to(target, target_is_directory=True)
        elif what == "a dangling link":
            out.symlink_to(case_dir / "nowhere", target_is_directory=True)
        _BEFORE[str(case_dir)] = _snapshot(case_dir / INPUTS)
        return _command(command, paths, out) + ([_flag(command)] if replace else [])

    def after(case_dir: Path) -> list[str]:
        problems = _intact(case_dir)
        if what.endswith("link") and not (case_dir / "link").is_symlink():
            problems.append("the link was replaced")
        if what.endswith("link") and any(p.name.startswith(".link") for p in case_dir.iterdir()):
            problems.append("a sibling of the link was left")
        return problems

    needle = {"a user's directory": "usaf did not make", "a file": "a file, not a directory"}.get(what, "symbolic link")
    flag_note = f" with {_flag(command)}" if replace else ""
    return Case(REPLACE, f"{command}: --out is {what}{flag_note}", build, needle, after=after)


def _locked_case(command: str) -> Case:
    """``--out`` another writer holds (here: this process, through another lock object, as a second usaf would)."""
    held: dict[str, OutputLock] = {}

    def build(bench: Bench, case_dir: Path) -> list[str]:
        paths = _inputs(bench, case_dir)
        out = case_dir / "busy"
        held[str(case_dir)] = OutputLock(out).acquire()
        _BEFORE[str(case_dir)] = _snapshot(case_dir / INPUTS)
        return _command(command, paths, out)

    def after(case_dir: Path) -> list[str]:
        held.pop(str(case_dir)).release()
        problems = _intact(case_dir)
        return problems + (["the busy output was created"] if (case_dir / "busy").exists() else [])

    return Case(REPLACE, f"{command}: --out another process is writing", build, "another usaf process", after=after)


def _inside_artifact_case(command: str) -> Case:
    """``--out`` inside a finished usaf artifact the command does not read: a run (a plan for eval and export, which
    read the run), which would then hold files its manifest does not list."""
    host = "plan" if command in ("eval", "export") else "run"

    def build(bench: Bench, case_dir: Path) -> list[str]:
        paths = _inputs(bench, case_dir)
        _BEFORE[str(case_dir)] = _snapshot(case_dir / INPUTS)
        return _command(command, paths, paths[host] / "sub") + [_flag(command)]

    name = f"{command}: --out inside a usaf {host} it does not read, with {_flag(command)}"
    return Case(COLLISION, name, build, "would add files its manifest does not list", after=_intact)


OWN_KIND = {"quantize": "quantized", "score": "plan", "train": "run"}  # the commands' own artifacts among the inputs


def _added_file_case(command: str) -> Case:
    """``--out`` at an artifact of the command's own kind that holds a file of the user's (a model card, notes):
    the flag would have deleted it with the artifact."""

    def build(bench: Bench, case_dir: Path) -> list[str]:
        paths = _inputs(bench, case_dir)
        (paths[OWN_KIND[command]] / USER_FILE).write_text("my own notes\n")
        _BEFORE[str(case_dir)] = _snapshot(case_dir / INPUTS)
        return _command(command, paths, paths[OWN_KIND[command]]) + [_flag(command)]

    name = f"{command}: --out is its own kind of artifact holding a user's file, with {_flag(command)}"
    return Case(REPLACE, name, build, "usaf did not write there", after=_intact)


WRITERS = ("tokenize", "quantize", "score", "train", "eval", "export", "tiny-model")
EXISTING = ("a user's directory", "a file", "a link to a user's directory", "a dangling link")


def cases() -> list[Case]:
    found: list[Case] = []
    for command, which, flag, shape in COLLISIONS:
        found.append(_collision_case(command, which, flag, shape, replace=True))
        if shape == "is":
            found.append(_collision_case(command, which, flag, shape, replace=False))
    for command in WRITERS:
        for what in EXISTING:
            found.append(_existing_case(command, what, replace=True))
        found.append(_existing_case(command, "a user's directory", replace=False))
        found.append(_locked_case(command))
        found.append(_inside_artifact_case(command))
        if command in OWN_KIND:
            found.append(_added_file_case(command))
    return found
