"""Hostile settings values and tampered checkpoints, each through the real CLI (:mod:`usaf.testing.hostile`).

Settings: a float setting that is not finite (``inf``, ``-inf``, ``nan``, ``1e309``), given as a flag, a
``USAF_*`` or legacy variable or in a ``--config`` table, for every float setting of ``usaf train`` and a few
of the other commands; a ``--config`` file with an unknown table or key; an environment value that is not
of its setting's type. The error must name where the value came from (the flag, the variable, the table).

Checkpoints: a finished two-step run (built once per bench, :func:`finished_run`) copied per case and then
tampered with: NaN/Inf in a delta or router, a router of another shape, a ``step-N`` directory renamed, a
step in ``state.json`` edited, ``optimizer.pt`` replaced (random bytes, a pickle that runs code, valid
pickles of other structures, tensors of other sizes). Read by ``usaf eval``, ``export``, ``generate`` and
``train`` resuming; the error must name the file (or the checkpoint directory).
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from usaf.cli.app import app
from usaf.testing.hostile import Bench, Case, _resign, _RunsCode, marker_of, resign_checkpoint

SETTINGS = "settings values (flags, env, TOML)"
CHECKPOINTS = "checkpoints"
READERS = (SETTINGS, CHECKPOINTS)

RUN_STEPS = 2  # the bench run's steps; each one is checkpointed


# -- the bench's finished run ------------------------------------------------------------------------------


def _train_args(bench: Bench, out: Path) -> list[str]:
    """The bench run's command line; a resume must repeat it exactly (its settings are the run's identity)."""
    return [
        "train", "--model", str(bench.quantized), "--data", str(bench.tokens), "--out", str(out),
        "--workspace", str(bench.root / "ws"), "--steps", str(RUN_STEPS), "--save-every", "1", "--frac", "0.05",
        "--calib-samples", "2", "--microbatch", "1",
    ]  # fmt: skip


_RUNS: dict[Path, Path] = {}  # bench root -> its finished run (built on the first checkpoint case)


def finished_run(bench: Bench) -> Path:
    """A finished ``usaf train`` run on ``bench`` (built once per bench; cases copy it)."""
    if bench.root not in _RUNS:
        run = bench.root / "settings-run"
        shutil.rmtree(run, ignore_errors=True)
        result = CliRunner().invoke(app, _train_args(bench, run))
        if result.exit_code != 0:
            raise RuntimeError(f"the bench run failed: {result.output[-2000:]}")
        _RUNS[bench.root] = run
    return _RUNS[bench.root]


def _copy_run(bench: Bench, case_dir: Path) -> Path:
    return Path(shutil.copytree(finished_run(bench), case_dir / "run"))


def _unfinish(run: Path) -> Path:
    """The run as an interrupted one: no manifest, no final/; its newest checkpoint is step 2."""
    (run / "manifest.json").unlink()
    shutil.rmtree(run / "final")
    return run


def _step_dir(run: Path, step: int = RUN_STEPS) -> Path:
    return run / "checkpoints" / f"step-{step:07d}"


# -- the commands that read a run ------------------------------------------------------------------------


def _eval(bench: Bench, case_dir: Path, run: Path) -> list[str]:
    return [
        "eval", "--checkpoint", str(run), "--model", str(bench.quantized), "--data", str(bench.tokens),
        "--out", str(case_dir / "out"), "--workspace", str(case_dir / "ws"), "--no-base-cache", "--no-plots",
        "--bootstrap", "100", "--max-sequences", "2", "--microbatch", "2",
    ]  # fmt: skip


def _export(bench: Bench, case_dir: Path, run: Path) -> list[str]:
    return ["export", "--checkpoint", str(run), "--model", str(bench.quantized), "--format", "delta",
            "--out", str(case_dir / "out"), "--workspace", str(case_dir / "ws")]  # fmt: skip


def _generate(bench: Bench, case_dir: Path, run: Path) -> list[str]:
    return ["generate", "def f", "--checkpoint", str(run), "--model", str(bench.quantized), "--max-new-tokens", "2",
            "--workspace", str(case_dir / "ws"), "--device", "cpu"]  # fmt: skip


def _resumed(bench: Bench, case_dir: Path, run: Path) -> list[str]:
    """Resuming the interrupted run (its step-2 checkpoint tampered with) with its own command line."""
    return _train_args(bench, run)


Command = Callable[[Bench, Path, Path], list[str]]


# -- settings values ---------------------------------------------------------------------------------------

# Every float setting of usaf train, with a valid value of each for the other flags' sake.
TRAIN_FLOATS = ("lr", "router-lr", "weight-decay", "clip", "warmup", "reselect-fraction", "aux-loss-coef",
                "z-loss-coef", "epochs", "frac", "prefix-cache-gib")  # fmt: skip


def _train_quick(bench: Bench, case_dir: Path, *, steps: bool = True) -> list[str]:
    """A train command line refused at its settings, before anything is loaded."""
    args = ["train", "--model", str(bench.quantized), "--data", str(bench.tokens), "--out", str(case_dir / "out"),
            "--workspace", str(case_dir / "ws")]  # fmt: skip
    return [*args, "--steps", "1"] if steps else args


def _flag_case(flag: str, value: str) -> Case:
    def build(bench: Bench, case_dir: Path) -> list[str]:
        return [*_train_quick(bench, case_dir, steps=flag != "epochs"), f"--{flag}", value]

    return Case(SETTINGS, f"train --{flag} {value}", build, f"--{flag}")


def _env_case(variable: str, value: str, *, needle: str | None = None, name: str = "") -> Case:
    def build(bench: Bench, case_dir: Path) -> list[str]:
        return _train_quick(bench, case_dir, steps=variable not in ("USAF_EPOCHS", "USAF_STEPS"))  # the flag would win

    label = name or f"train with {variable}={value}"
    return Case(SETTINGS, label, build, needle or variable, env={variable: value})


def _toml_case(name: str, text: str, needle: str, *, command: str = "train") -> Case:
    def build(bench: Bench, case_dir: Path) -> list[str]:
        path = case_dir / "settings.toml"
        path.write_text(text, encoding="utf-8")
        args = _train_quick(bench, case_dir) if command == "train" else _other(command, bench, case_dir)
        return [*args, "--config", str(path)]

    return Case(SETTINGS, name, build, needle)


def _other(command: str, bench: Bench, case_dir: Path) -> list[str]:
    """A command line of another command that reads settings first (refused before it loads anything)."""
    if command == "score":
        return ["score", "--model", str(bench.quantized), "--data", str(bench.tokens), "--out", str(case_dir / "out"),
                "--calib-samples", "2", "--no-stability"]  # fmt: skip
    if command == "plan":
        return ["plan", str(bench.model)]
    if command == "tokenize":
        corpus = case_dir / "corpus.txt"
        corpus.write_text("def f(x):\n    return x + 1\n" * 40, encoding="utf-8")
        return ["tokenize", str(corpus), "--model", str(bench.model), "--out", str(case_dir / "out")]
    if command == "generate":
        return ["generate", "hi", "--model", str(bench.quantized), "--no-checkpoint", "--max-new-tokens", "1"]
    if command == "export":
        return ["export", "--model", str(bench.quantized), "--out", str(case_dir / "out")]
    if command == "quantize":
        return ["quantize", str(bench.model), "--out", str(case_dir / "out"), "--method", "rtn", "--group-size", "8"]
    if command == "eval":
        return _eval(bench, case_dir, finished_run(bench))
    raise ValueError(command)


def _other_flag_case(command: str, flag: str, value: str) -> Case:
    def build(bench: Bench, case_dir: Path) -> list[str]:
        return [*_other(command, bench, case_dir), f"--{flag}", value]

    return Case(SETTINGS, f"{command} --{flag} {value}", build, f"--{flag}")


def _other_env_case(command: str, variable: str, value: str) -> Case:
    """A value from the environment is named as such: the device is parsed after the settings resolve."""

    def build(bench: Bench, case_dir: Path) -> list[str]:
        if command == "export":  # a complete command line (export checks its checkpoint before the device),
            args = _export(bench, case_dir, finished_run(bench))  # of the format that computes (a delta does not)
            return [*args[: args.index("delta")], "hf", *args[args.index("delta") + 1 :]]
        return _train_quick(bench, case_dir) if command == "train" else _other(command, bench, case_dir)

    return Case(SETTINGS, f"{command} with {variable}={value}", build, f"{variable} {value}", env={variable: value})


def settings_cases() -> list[Case]:
    flags = [_flag_case(flag, value) for flag in TRAIN_FLOATS for value in ("inf", "nan")]
    return [
        *flags,
        _flag_case("lr", "-inf"),
        _flag_case("router-lr", "1e309"),
        _other_flag_case("score", "frac", "nan"),
        _other_flag_case("plan", "frac", "inf"),
        _other_flag_case("tokenize", "held-out-frac", "nan"),
        _other_flag_case("generate", "temperature", "inf"),
        _other_flag_case("generate", "top-p", "nan"),
        _other_flag_case("export", "max-shard-gib", "inf"),
        _env_case("USAF_LR", "inf"),
        _env_case("USAF_EPOCHS", "nan"),
        _env_case("USAF_ROUTER_LR", "1e309"),
        _env_case("LR_PEAK", "inf", name="train with the legacy LR_PEAK=inf"),
        _env_case("USAF_LR", "abc", name="train with USAF_LR=abc (not a number)"),
        _env_case("USAF_STEPS", "three", name="train with USAF_STEPS=three"),
        _env_case("USAF_ROUTER", "maybe", name="train with USAF_ROUTER=maybe"),
        _env_case("USAF_RESELECT_EVERY", "500", name="train with USAF_RESELECT_EVERY=500 over --steps 1"),
        _env_case("USAF_VRAM", "lots", name="train with USAF_VRAM=lots (checked after resolving)"),
        _env_case("USAF_SEQ_LEN", "99999", name="train with USAF_SEQ_LEN beyond the model's context"),
        *(_other_env_case(c, "USAF_DEVICE", "gpu9") for c in ("train", "score", "quantize", "eval", "export")),
        _other_env_case("generate", "USAF_DEVICE", "gpu9"),
        _toml_case("[train] lr = inf", "[train]\nlr = inf\n", "[train] lr"),
        _toml_case("[train] warmup = 1e309", "[train]\nwarmup = 1e309\n", "[train] warmup"),
        _toml_case("[defaults] z_loss_coef = nan", "[defaults]\nz_loss_coef = nan\n", "[defaults] z_loss_coef"),
        _toml_case("[defaults] with a key no command has", "[defaults]\nlearning_rate = 0.1\n", "learning_rate"),
        _toml_case("a misspelt table [trian]", "[trian]\nsteps = 3\n", "[trian]"),
        _toml_case("[train] with an unknown key", "[train]\nstepz = 3\n", "stepz"),
        _toml_case("a key outside any table", "lr = 0.1\n", "'lr'"),
        _toml_case("[score] frac = nan, read by score", "[score]\nfrac = nan\n", "[score] frac", command="score"),
    ]


# -- tampered checkpoints -----------------------------------------------------------------------------------


def _edit_safetensors(path: Path, edit: Callable[[dict], None]) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _first(tensors: dict, suffix: str = "") -> str:
    return next(name for name in sorted(tensors) if name.endswith(suffix))


def _poison(suffix: str, value: float) -> Callable[[dict], None]:
    def edit(tensors: dict) -> None:
        name = _first(tensors, suffix)
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] = value

    return edit


def _reshape_router(shape: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    def edit(tensors: dict) -> None:
        name = _first(tensors)
        tensors[name] = shape(tensors[name]).contiguous()

    return edit


def _checkpoint_case(
    name: str,
    tamper: Callable[[Path, Path], Path],
    command: Command,
    needle: str,
    *,
    finished: bool = True,
    resigned: bool = True,
    **kw,
) -> Case:
    """``tamper(run, case_dir)`` damages the copied run (finished, or made interrupted) and returns the
    checkpoint directory it damaged; ``command`` reads the run. The checkpoint's checksums are re-signed (so the
    checks behind them are what is tested) unless not ``resigned``, and so is a finished run's manifest."""

    def build(bench: Bench, case_dir: Path) -> list[str]:
        run = _copy_run(bench, case_dir)
        if not finished:
            _unfinish(run)
        damaged = tamper(run / "final" if finished else _step_dir(run), case_dir)
        if resigned:
            resign_checkpoint(damaged)
        if finished:
            _resign(run)
        return command(bench, case_dir, run)

    return Case(CHECKPOINTS, name, build, needle, **kw)


def _tensor_file(file: str, edit: Callable[[dict], None]) -> Callable[[Path, Path], Path]:
    def tamper(checkpoint: Path, _: Path) -> Path:
        _edit_safetensors(checkpoint / file, edit)
        return checkpoint

    return tamper


def _state(edit: Callable[[dict], None]) -> Callable[[Path, Path], Path]:
    def tamper(checkpoint: Path, _: Path) -> Path:
        path = checkpoint / "state.json"
        state = json.loads(path.read_text(encoding="utf-8"))
        edit(state)
        path.write_text(json.dumps(state), encoding="utf-8")
        return checkpoint

    return tamper


def _set_step(value: object) -> Callable[[Path, Path], Path]:
    return _state(lambda state: state.__setitem__("step", value))


def _rename(new_name: str) -> Callable[[Path, Path], Path]:
    def tamper(checkpoint: Path, _: Path) -> Path:
        return checkpoint.rename(checkpoint.with_name(new_name))

    return tamper


def _optimizer(write: Callable[[Path, Path], None]) -> Callable[[Path, Path], Path]:
    def tamper(checkpoint: Path, case_dir: Path) -> Path:
        write(checkpoint / "optimizer.pt", case_dir)
        return checkpoint

    return tamper


def _edit_optimizer(edit: Callable[[dict], object]) -> Callable[[Path, Path], None]:
    def write(path: Path, _: Path) -> None:
        extra = torch.load(path, weights_only=True)
        new = edit(extra)
        torch.save(extra if new is None else new, path)

    return write


def _first_state(extra: dict) -> dict:
    return extra["optimizer"]["groups"][0]["state"][0]


def _cut_moment(extra: dict) -> None:
    state = _first_state(extra)
    state["exp_avg"] = state["exp_avg"].flatten()[:-1]


def _nan_moment(extra: dict) -> None:
    state = _first_state(extra)
    state["exp_avg_sq"] = torch.full_like(state["exp_avg_sq"], float("nan"))


DELTAS, ROUTERS, STATE, OPTIMIZER = "deltas.safetensors", "routers.safetensors", "state.json", "optimizer.pt"


def checkpoint_cases() -> list[Case]:
    nan_delta = _tensor_file(DELTAS, _poison("values", float("nan")))
    transposed_router = _tensor_file(ROUTERS, _reshape_router(lambda t: t.T))
    finished = [  # (name, tampering of final/, command, needle): the finished run, its manifest re-signed
        ("NaN in a delta (export)", nan_delta, _export, DELTAS),
        ("NaN in a delta (eval)", nan_delta, _eval, DELTAS),
        ("Inf in a router (generate)", _tensor_file(ROUTERS, _poison("", float("inf"))), _generate, ROUTERS),
        ("a router of shape (1, H), broadcastable (generate)",
         _tensor_file(ROUTERS, _reshape_router(lambda t: t[:1])), _generate, "router"),
        ("a router transposed (eval)", transposed_router, _eval, "router"),
        ("state.json step 99999 (eval)", _set_step(99999), _eval, STATE),
        ("state.json step 1.5 (generate)", _set_step(1.5), _generate, STATE),
    ]  # fmt: skip
    interrupted = [  # (name, tampering of checkpoints/step-0000002, command, needle): the run made interrupted
        ("-Inf in a delta of the newest checkpoint (export)",
         _tensor_file(DELTAS, _poison("cumulative_values", float("-inf"))), _export, DELTAS),
        ("NaN in a router (train --resume)", _tensor_file(ROUTERS, _poison("", float("nan"))), _resumed, ROUTERS),
        ("a router transposed (train --resume)", transposed_router, _resumed, ROUTERS),
        ("a router missing (train --resume)", _tensor_file(ROUTERS, lambda t: t.pop(_first(t))), _resumed, ROUTERS),
        ("step dir renamed step-99999 (export)", _rename("step-99999"), _export, "step-99999"),
        ("step dir renamed step--1 (export)", _rename("step--1"), _export, "step--1"),
        ("step dir renamed step-abc (train --resume)", _rename("step-abc"), _resumed, "step-abc"),
        ("state.json step -1 (export)", _set_step(-1), _export, STATE),
        ("state.json step 'abc' (train --resume)", _set_step("abc"), _resumed, STATE),
        ("state.json step 1 in step-0000002 (train --resume)", _set_step(1), _resumed, "step-0000002"),
        ("state.json with an unknown key (train --resume)", _state(lambda s: s.__setitem__("lr", 1)), _resumed, STATE),
        ("state.json company_size 0 (train --resume)", _state(lambda s: s.__setitem__("company_size", 0)), _resumed,
         STATE),
        *[(f"optimizer.pt {what}", _optimizer(write), _resumed, OPTIMIZER) for what, write in _optimizer_files()],
    ]  # fmt: skip
    runs_code = [  # pickles that would create the case's marker if they ran
        ("optimizer.pt a torch.save that runs code",
         lambda p, case_dir: torch.save({"optimizer": _RunsCode(marker_of(case_dir))}, p)),
        ("optimizer.pt a plain pickle that runs code",
         lambda p, case_dir: p.write_bytes(pickle.dumps(_RunsCode(marker_of(case_dir)), 2))),
    ]  # fmt: skip
    finite_delta = _tensor_file(DELTAS, _poison("cumulative_values", 1.25))
    unsigned = [  # (name, tampering, command, needle, finished): edits that read as sound, checksums not re-signed
        ("a delta's value changed, finite, manifest re-signed (eval)", finite_delta, _eval, DELTAS, True),
        ("a delta's value changed, finite, in the newest checkpoint (export)", finite_delta, _export, DELTAS, False),
        ("state.json with an unknown key (train --resume)", _state(lambda s: s.__setitem__("lr", 1)), _resumed, STATE,
         False),
    ]  # fmt: skip
    return [
        *[_checkpoint_case(*row) for row in finished],
        *[_checkpoint_case(*row, finished=False) for row in interrupted],
        *[_checkpoint_case(f"{name}, checksums not re-signed", tamper, command, needle, finished=done, resigned=False)
          for name, tamper, command, needle, done in unsigned],
        *[_checkpoint_case(name, _optimizer(write), _resumed, OPTIMIZER, finished=False, unsafe=True)
          for name, write in runs_code],
    ]  # fmt: skip


def _optimizer_files() -> list[tuple[str, Callable[[Path, Path], None]]]:
    """Replacements of ``optimizer.pt`` that run no code: bytes, other structures, tensors that do not fit."""
    return [
        ("random bytes", lambda p, _: p.write_bytes(random.Random(2).randbytes(4096))),
        ("a dict of another structure",
         lambda p, _: torch.save({"optimizer": {"format": "adam"}, "schedule": {}, "rng": 1}, p)),
        ("a tensor", lambda p, _: torch.save(torch.zeros(3), p)),
        ("moments of the wrong size", _edit_optimizer(_cut_moment)),
        ("NaN moments", _edit_optimizer(_nan_moment)),
        ("rng a float tensor", _edit_optimizer(lambda e: e.__setitem__("rng", torch.zeros(3)))),
        ("schedule without its keys", _edit_optimizer(lambda e: e.__setitem__("schedule", {"peak_lr": 1.0}))),
    ]  # fmt: skip


def cases() -> list[Case]:
    return [*settings_cases(), *checkpoint_cases()]
