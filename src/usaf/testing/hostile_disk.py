"""Hostile environments for the catalogue: a disk that is full, over quota, read-only or forbidden.

Not a malformed file but a disk that refuses one of a stage's writes (``usaf.testing.faults``: the
fault is injected in-process, after the write's torn prefix is left). Every stage that writes is here,
at one of its writes, in each form the refusal takes (``OSError`` ENOSPC/EDQUOT/EROFS/EACCES,
torch.save's ``RuntimeError``, safetensors' ``os error 28``), plus the preflight that refuses a disk too
small before anything is written. The answer must be one error line naming the output and the cause
(read-only says read-only), exit 2, and no output or temporaries left (``hostile.run_case`` checks);
``tests/test_disk_full.py`` checks the resumed reruns and the previous checkpoint.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from typer.testing import CliRunner

from usaf.cli.app import app
from usaf.testing.faults import failing_write
from usaf.testing.hostile import Bench, Case

DISK = "full or read-only disk"
READERS: tuple[str, ...] = (DISK,)


def _fault(form: str, path_part: str, *, at: int = 1, kinds: tuple[str, ...] | None = None):
    """``Case.during``: the ``at``-th write of ``kinds`` whose path holds ``path_part`` (inside the case) fails."""

    def during(case_dir: Path) -> contextlib.AbstractContextManager:
        inside = str(case_dir) + "/"

        def only(path: str) -> bool:  # below the case directory (the bench's own paths never match)
            return path.startswith(inside) and path_part in path[len(inside) :]

        return failing_write(at, form, kinds=kinds, only=only)

    return during


@contextlib.contextmanager
def _tiny_disk(case_dir: Path, free: int = 10_000) -> Iterator[None]:
    """Every path of the case on a disk with ``free`` bytes left (the preflights' view)."""
    real = shutil.disk_usage

    def usage(path):
        found = real(path)
        return shutil._ntuple_diskusage(found.total, found.total - free, free) if str(case_dir) in str(path) else found

    shutil.disk_usage = usage
    try:
        yield
    finally:
        shutil.disk_usage = real


# -- the inputs the writing stages need (built once per bench, in it) ---------------------------------


def _plan(bench: Bench) -> Path:
    plan = bench.root / "disk-plan"
    if not (plan / "manifest.json").is_file():
        _invoke(["score", "--model", str(bench.quantized), "--data", str(bench.tokens), "--out", str(plan),
                 "--frac", "0.05", "--calib-samples", "4", "--no-stability"])  # fmt: skip
    return plan


def _trained(bench: Bench) -> Path:
    run = bench.root / "disk-run"
    if not (run / "manifest.json").is_file():
        _invoke(_train_args(bench, run))
    return run


def _invoke(args: list[str]) -> None:
    result = CliRunner().invoke(app, args)
    if result.exit_code != 0:
        raise RuntimeError(f"building the disk cases' inputs failed: {result.output[-1000:]}")


def _train_args(bench: Bench, out: Path) -> list[str]:
    return ["train", "--model", str(bench.quantized), "--data", str(bench.tokens), "--plan", str(_plan(bench)),
            "--out", str(out), "--steps", "4", "--save-every", "2", "--seed", "3"]  # fmt: skip


# -- the commands, writing into the case directory ----------------------------------------------------


def _tokenize(bench: Bench, case_dir: Path) -> list[str]:
    corpus = case_dir / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 100, encoding="utf-8")
    return ["tokenize", str(corpus), "--model", str(bench.model), "--out", str(case_dir / "out"), "--seq-len", "32"]


def _quantize(bench: Bench, case_dir: Path) -> list[str]:
    return ["quantize", str(bench.model), "--out", str(case_dir / "out"), "--method", "rtn", "--group-size", "8"]


def _score(bench: Bench, case_dir: Path) -> list[str]:
    return ["score", "--model", str(bench.quantized), "--data", str(bench.tokens), "--out", str(case_dir / "out"),
            "--frac", "0.05", "--calib-samples", "4", "--no-stability"]  # fmt: skip


def _train(bench: Bench, case_dir: Path) -> list[str]:
    # into "run", not "out": a train run directory stays on purpose (its checkpoints resume the run)
    return _train_args(bench, case_dir / "run")


def _eval(bench: Bench, case_dir: Path) -> list[str]:
    return ["eval", "--model", str(bench.quantized), "--data", str(bench.tokens), "--out", str(case_dir / "out"),
            "--workspace", str(case_dir / "ws")]  # fmt: skip


def _export(fmt: str) -> Callable[[Bench, Path], list[str]]:
    def build(bench: Bench, case_dir: Path) -> list[str]:
        return ["export", "--model", str(bench.quantized), "--checkpoint", str(_trained(bench)),
                "--out", str(case_dir / "out"), "--format", fmt]  # fmt: skip

    return build


FULL = "out: no space left on the disk"
READ_ONLY = "out: read-only file system"


def _case(name: str, build: Callable[[Bench, Path], list[str]], during, needle: str = FULL) -> Case:
    return Case(DISK, name, build, needle, during=during)


def cases() -> list[Case]:
    mkdir = ("mkdir",)
    return [
        _case("tokenize: full at train.jsonl", _tokenize, _fault("enospc", "train.jsonl")),
        _case(
            "tokenize: permission denied at --out",
            _tokenize,
            _fault("eacces", "out", kinds=mkdir),
            "out: permission denied",
        ),  # fmt: skip
        _case("quantize: full at a layer file (torch.save's RuntimeError)", _quantize, _fault("torch", "layer-0000")),
        _case("quantize: full at a base shard (safetensors' os error 28)", _quantize, _fault("safetensors", "base-")),
        _case(
            "quantize: over quota in experts_q4.pt (streaming writer)",
            _quantize,
            _fault("edquot", "experts_q4.pt", at=2, kinds=("ptfile.add",)),
        ),  # fmt: skip
        _case("quantize: full at manifest.json", _quantize, _fault("enospc", "manifest.json")),
        _case("quantize: read-only --out", _quantize, _fault("erofs", "out", kinds=mkdir), READ_ONLY),
        _case(
            "quantize: a disk too small (refused before writing)",
            _quantize,
            _tiny_disk,
            "out: the quantized model needs",
        ),  # fmt: skip
        _case(
            "score: full at masks.safetensors (safetensors' os error 28)",
            _score,
            _fault("safetensors", "masks.safetensors"),
        ),  # fmt: skip
        _case("score: full at routing.json", _score, _fault("enospc", "routing.json")),
        _case(
            "train: full mid-checkpoint (torch.save's RuntimeError)",
            _train,
            _fault("torch", "step-0000004.tmp/optimizer.pt"),
            "run: no space left on the disk",
        ),  # fmt: skip
        _case(
            "train: full at metrics.jsonl", _train, _fault("enospc", "metrics.jsonl"), "run: no space left on the disk"
        ),  # fmt: skip
        _case("train: read-only --out", _train, _fault("erofs", "run", kinds=mkdir), "run: read-only file system"),
        _case(
            "train: a disk too small for a checkpoint (refused before writing)",
            _train,
            _tiny_disk,
            "the checkpoint needs",
        ),  # fmt: skip
        _case("eval: full at report.json", _eval, _fault("enospc", "report.json")),
        _case(
            "export: full at a model shard (safetensors' os error 28)",
            _export("hf"),
            _fault("safetensors", "model-0000"),
        ),  # fmt: skip
        _case("export: full at the delta (--format delta)", _export("delta"), _fault("enospc", "deltas.safetensors")),
        _case("export: read-only --out", _export("hf"), _fault("erofs", "out", kinds=mkdir), READ_ONLY),
    ]
