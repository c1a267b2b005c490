"""Checks every command's settings and every checkpoint reader share (issue 19, slice "settings").

- every float setting of every command is finite, from a flag, a ``USAF_*`` variable or a ``--config`` table;
- a ``--config`` file holds only known tables and keys, a misspelt one answered with the closest valid name;
- a value from the environment or a file is named by where it came from, in cross-field messages too;
- a checkpoint with NaN/Inf tensors, a step that is not one, or optimizer state that does not fit is refused
  naming the file (the CLI paths: tests/test_hostile_settings.py).
"""

from __future__ import annotations

import importlib
import inspect
import math
import typing
from pathlib import Path

import pytest
import torch

from usaf.artifacts.run import Checkpoint, DeltaRecord, checkpoint_dirs, read_checkpoint, write_checkpoint
from usaf.config import flag_name, resolve_config, source_of
from usaf.engine.optim_state import check_state_dict
from usaf.errors import UsafError
from usaf.settings import TABLES, table_keys
from usaf.settings.argv import cli_type
from usaf.settings.tokenize import TokenizeConfig
from usaf.settings.train import TrainConfig
from usaf.stages.train.resume import latest_checkpoint

# -- every float setting of every command ----------------------------------------------------------------


def _models() -> dict[str, type]:
    out = {}
    for table, spec in TABLES.items():
        module, _, name = spec.partition(":")
        out[table] = getattr(importlib.import_module(f"usaf.settings.{module}"), name)
    return out


def _required(model: type) -> dict:
    """Placeholder values of the model's required fields (the checks run before anything reads them)."""
    return {
        name: ["x"] if typing.get_origin(info.annotation) is list else "x"
        for name, info in model.model_fields.items()
        if info.is_required()
    }


FLOATS = [
    (table, field)
    for table, model in _models().items()
    for field, info in model.model_fields.items()
    if cli_type(info.annotation) is float
]


def test_the_float_settings_are_found():
    """The parametrization below is not vacuous: it holds train's learning rates and the other commands' floats."""
    assert {("train", "lr"), ("train", "router_lr"), ("train", "epochs"), ("score", "frac"), ("plan", "frac"),
            ("generate", "temperature"), ("export", "max_shard_gib"), ("demo", "lr")} <= set(FLOATS)  # fmt: skip


@pytest.mark.parametrize(("table", "field"), FLOATS, ids=[f"{t}.{f}" for t, f in FLOATS])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, float("1e309")], ids=["inf", "-inf", "nan", "1e309"])
def test_every_float_setting_refuses_a_non_finite_flag(table, field, value):
    model = _models()[table]
    with pytest.raises(UsafError) as e:
        resolve_config(model, section=table, cli={**_required(model), field: value}, env={})
    assert f"{flag_name(field)} = {value!r}: not a finite number" in e.value.message


@pytest.mark.parametrize(("table", "field"), FLOATS, ids=[f"{t}.{f}" for t, f in FLOATS])
def test_every_float_setting_refuses_nan_from_env_and_inf_from_toml(table, field, tmp_path):
    model = _models()[table]
    variable = "USAF_" + field.upper()
    with pytest.raises(UsafError) as e:
        resolve_config(model, section=table, cli=_required(model), env={variable: "nan"})
    assert f"{variable} = 'nan': not a finite number" in e.value.message and flag_name(field) not in e.value.message
    config = tmp_path / "usaf.toml"
    config.write_text(f"[{table}]\n{field} = 1e309\n")
    with pytest.raises(UsafError) as e:
        resolve_config(model, section=table, cli=_required(model), config_file=config, env={})
    assert f"[{table}] {field} = inf: not a finite number" in e.value.message


def test_negative_control_finite_floats_from_every_source_are_accepted(tmp_path):
    config = tmp_path / "usaf.toml"
    config.write_text("[defaults]\nz_loss_coef = 0.001\n[train]\nwarmup = 0.1\n")
    settings = resolve_config(TrainConfig, section="train", cli={"lr": 1e-3, "epochs": 2.5}, config_file=config,
                              env={"USAF_ROUTER_LR": "1e-5", "USAF_CLIP": "0.5"})  # fmt: skip
    assert (settings.lr, settings.epochs, settings.router_lr, settings.clip) == (1e-3, 2.5, 1e-5, 0.5)
    assert (settings.warmup, settings.z_loss_coef) == (0.1, 0.001)


def test_a_legacy_variable_that_is_not_finite_is_named():
    with pytest.raises(UsafError, match=r"legacy env LR_PEAK = 'inf': not a finite number"):
        resolve_config(TrainConfig, section="train", cli={}, env={"LR_PEAK": "inf"}, legacy_env={"LR_PEAK": "lr"})


# -- the --config file's tables and keys ---------------------------------------------------------------------


def _train_with(tmp_path: Path, text: str) -> UsafError:
    config = tmp_path / "usaf.toml"
    config.write_text(text)
    with pytest.raises(UsafError) as e:
        resolve_config(TrainConfig, section="train", cli={}, config_file=config, env={})
    return e.value


def test_an_unknown_defaults_key_is_refused_with_the_closest_setting(tmp_path):
    error = _train_with(tmp_path, "[defaults]\nlearnig_rate = 1\nrouter_lrr = 1\n")
    assert "[defaults] has 'learnig_rate', a setting no command has" in error.message
    assert "[defaults] has 'router_lrr', a setting no command has (did you mean 'router_lr'?)" in error.message


def test_a_misspelt_table_is_refused_with_the_closest_table(tmp_path):
    error = _train_with(tmp_path, "[trian]\nsteps = 3\n")
    assert "unknown table [trian] (did you mean [train]?)" in error.message


def test_an_unknown_key_of_the_own_or_another_table_is_refused(tmp_path):
    error = _train_with(tmp_path, "[train]\nstepz = 3\n")
    assert "[train] has no setting 'stepz' (did you mean 'steps'?)" in error.message
    error = _train_with(tmp_path, "[score]\nfracc = 1\n")
    assert "[score] has no setting 'fracc' (did you mean 'frac'?)" in error.message
    assert "'lr' is outside any table" in _train_with(tmp_path, "lr = 0.1\n").message


def test_every_problem_of_the_file_is_reported_at_once(tmp_path):
    error = _train_with(tmp_path, "[trian]\nsteps = 3\n[train]\nlr = inf\n")
    assert "unknown table [trian]" in error.message and "[train] lr = inf: not a finite number" in error.message


def test_negative_control_keys_of_other_commands_in_defaults_and_their_tables_are_accepted(tmp_path):
    """[defaults] may hold any command's setting (each command takes its own); other tables are left alone."""
    config = tmp_path / "usaf.toml"
    config.write_text('[defaults]\nheld_out_frac = 0.2\nsteps = 4\ndevice = "cpu"\n[tokenize]\nseq_len = 64\n'
                      "[generate]\ntop_p = 0.5\n[train]\nlr = 0.01\n")  # fmt: skip
    settings = resolve_config(TrainConfig, section="train", cli={}, config_file=config, env={})
    assert (settings.steps, settings.device, settings.lr) == (4, "cpu", 0.01)
    example = Path(__file__).parent.parent / "examples" / "usaf.toml"
    assert resolve_config(TrainConfig, section="train", cli={}, config_file=example, env={}).lr == TrainConfig().lr


def test_the_tables_are_the_commands_that_read_a_config_file():
    from usaf.cli.app import app

    with_config = {c.name for c in app.registered_commands if "config" in inspect.signature(c.callback).parameters}
    assert with_config == set(TABLES)
    assert set(table_keys()["train"]) == set(TrainConfig.model_fields)


# -- where a value came from -------------------------------------------------------------------------------


def test_an_environment_value_that_is_wrong_names_the_variable_not_the_flag():
    with pytest.raises(UsafError) as e:
        resolve_config(TrainConfig, section="train", cli={}, env={"USAF_LR": "abc"})
    assert "USAF_LR = 'abc': Input should be a valid number" in e.value.message and "--lr" not in e.value.message


def test_a_cross_field_message_names_the_sources_of_its_values(tmp_path):
    with pytest.raises(UsafError) as e:
        resolve_config(TrainConfig, section="train", cli={"steps": 3}, env={"USAF_RESELECT_EVERY": "500"})
    assert e.value.message == "invalid settings: USAF_RESELECT_EVERY 500 exceeds --steps 3; lower it or pass 0 " \
        "for a static mask"  # fmt: skip
    config = tmp_path / "usaf.toml"
    config.write_text("[train]\nepochs = 2.0\nsteps = 3\n")  # one level: both kept, and refused by name
    with pytest.raises(UsafError) as e:
        resolve_config(TrainConfig, section="train", cli={}, config_file=config, env={})
    assert f"pass either --config {config} [train] steps or --config {config} [train] epochs" in e.value.message


def test_a_check_after_resolving_names_the_source_and_sources_do_not_change_equality(tmp_path):
    config = tmp_path / "usaf.toml"
    config.write_text("[train]\nram = '8GiB'\n")
    settings = resolve_config(TrainConfig, section="train", cli={"lr": 0.1}, config_file=config,
                              env={"USAF_VRAM": "lots"})  # fmt: skip
    assert source_of(settings, "vram") == "USAF_VRAM" and source_of(settings, "lr") == "--lr"
    assert source_of(settings, "ram") == f"--config {config} [train] ram"
    assert source_of(settings, "seq_len") == "--seq-len"  # defaulted: its flag
    assert settings == TrainConfig(lr=0.1, vram="lots", ram="8GiB") and hash(settings) == hash(settings.model_copy())


# -- checkpoints --------------------------------------------------------------------------------------------

TENSOR = "layers.1.experts.down"


def _write(directory: Path, *, step: int = 3, values: torch.Tensor | None = None, router: torch.Tensor | None = None):
    pair = (torch.tensor([0, 2, 5]), torch.tensor([0.1, -0.2, 0.3]) if values is None else values)
    checkpoint = Checkpoint(
        deltas={TENSOR: DeltaRecord(active=pair, frozen=None, cumulative=tuple(t.clone() for t in pair))},
        routers={"layers.1.router": torch.ones(4, 8) if router is None else router},
        state={"step": step},
        optimizer={"format": "x"},
        schedule={},
        rng=torch.get_rng_state(),
    )
    write_checkpoint(directory, checkpoint)
    return directory


def test_negative_control_an_intact_checkpoint_is_read(tmp_path):
    checkpoint = read_checkpoint(_write(tmp_path / "checkpoints" / "step-0000003"), max_step=3)
    assert checkpoint.state["step"] == 3 and set(checkpoint.deltas) == {TENSOR}


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_delta_or_router_is_refused_naming_file_and_tensor(tmp_path, bad):
    directory = _write(tmp_path / "final", values=torch.tensor([0.1, bad, 0.3]))
    with pytest.raises(UsafError, match=rf"deltas\.safetensors: {TENSOR}\.\w*values holds NaN or Inf"):
        read_checkpoint(directory, full=False, flag="--checkpoint")
    router = torch.ones(4, 8)
    router[2, 3] = bad
    directory = _write(tmp_path / "final", router=router)
    with pytest.raises(UsafError, match=r"routers\.safetensors: layers\.1\.router holds NaN or Inf"):
        read_checkpoint(directory, full=False, flag="--checkpoint")


@pytest.mark.parametrize(
    ("step", "why"),
    [(-1, "is not a step"), ("3", "is not a step"), (True, "is not a step"), (2.0, "is not a step"),
     (99, "beyond the run's 3 steps")],
)  # fmt: skip
def test_a_step_that_is_not_one_of_the_run_is_refused(tmp_path, step, why):
    directory = _write(tmp_path / "final", step=step)
    with pytest.raises(UsafError, match=rf"final/state\.json: step .* {why}"):
        read_checkpoint(directory, full=False, max_step=3)


def test_a_step_directory_must_be_named_by_its_step(tmp_path):
    directory = _write(tmp_path / "checkpoints" / "step-0000004", step=3)
    with pytest.raises(UsafError, match="its name says step 4, its state.json says step 3"):
        read_checkpoint(directory)
    directory = _write(tmp_path / "checkpoints" / "step-x3", step=3)
    with pytest.raises(UsafError, match="step-x3: not a checkpoint name"):
        read_checkpoint(directory)


def test_a_runs_checkpoints_are_ordered_by_step_number_not_as_text(tmp_path):
    """step-10000000 (eight digits) is newer than step-9999999; sorted as text it was not."""
    for step in (9_999_999, 10_000_000):
        _write(tmp_path / "checkpoints" / f"step-{step:07d}", step=step)
    (tmp_path / "checkpoints" / "step-0000001.tmp").mkdir()  # an unfinished write: not a checkpoint
    assert latest_checkpoint(tmp_path).name == "step-10000000"
    assert [p.name for p in checkpoint_dirs(tmp_path, flag="--out")] == ["step-9999999", "step-10000000"]
    _write(tmp_path / "checkpoints" / "step-abc", step=1)
    with pytest.raises(UsafError, match="step-abc: not a checkpoint name"):
        latest_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "state",
    [None, 5, [], {"format": "usaf.sparse_adamw/1"}, {"format": "usaf.sparse_adamw/1", "betas": [0.9, 0.99],
     "eps": 1e-8, "max_grad_norm": None, "applied_steps": 1, "skipped_steps": 0, "groups": {"deltas": 1}}],
    ids=["None", "int", "list", "format only", "groups a dict"],
)  # fmt: skip
def test_an_optimizer_state_of_another_structure_is_a_value_error(state):
    """Whatever optimizer.pt holds, its check says what is wrong as a ValueError (resume names the file)."""
    with pytest.raises(ValueError):
        check_state_dict(state, [{"name": "deltas", "params": [torch.zeros(3)]}])


def test_every_seed_is_a_32_bit_count_and_epochs_are_bounded():
    """--seed 1e17 overflowed in the data order (a traceback, a run directory left with its settings alone) and
    --epochs 1e307 in the step count (found in review). The control: the largest seed and 10,000 epochs are taken."""
    import importlib

    from usaf.settings import TABLES

    models = {}
    for name, spec in TABLES.items():
        module, _, attr = spec.partition(":")
        models[name] = getattr(importlib.import_module(f"usaf.settings.{module}"), attr)
    seeded = [name for name, cls in models.items() if "seed" in cls.model_fields]
    assert {"train", "score", "tokenize", "eval", "generate"} <= set(seeded)
    for name in seeded:
        cls = models[name]
        for bad in (2**32, -1):
            with pytest.raises(UsafError, match="seed"):
                resolve_config(cls, section=name, cli={"seed": bad}, env={})
        try:  # some commands need other settings too: the seed is not among the problems
            resolve_config(cls, section=name, cli={"seed": 2**32 - 1}, env={})
        except UsafError as e:
            assert "seed" not in e.message, e.message
    with pytest.raises(UsafError, match="--epochs"):
        resolve_config(TrainConfig, section="train", cli={"epochs": 1e307}, env={})
    assert resolve_config(TrainConfig, section="train", cli={"epochs": 10_000.0}, env={}).epochs == 10_000


def test_epochs_and_steps_are_one_choice_the_higher_source_wins():
    """USAF_STEPS (or STEPS, or [train] steps) with --epochs was refused although flags win over USAF_* (found in
    review). The control: both from flags are still refused."""
    config = resolve_config(TrainConfig, section="train", cli={"epochs": 0.5}, env={"USAF_STEPS": "100"})
    assert (config.epochs, config.steps) == (0.5, None)
    config = resolve_config(TrainConfig, section="train", cli={"steps": 7}, env={"USAF_EPOCHS": "2"})
    assert (config.epochs, config.steps) == (None, 7)
    config = resolve_config(TrainConfig, section="train", cli={}, env={"USAF_EPOCHS": "2", "STEPS": "9"},
                            legacy_env={"STEPS": "steps"})  # fmt: skip
    assert (config.epochs, config.steps) == (2.0, None)
    with pytest.raises(UsafError, match="pass either --steps or --epochs"):
        resolve_config(TrainConfig, section="train", cli={"steps": 7, "epochs": 1.0}, env={})


def test_held_out_and_its_fraction_are_one_choice_the_higher_source_wins(tmp_path):
    """--held-out with a held_out_frac from --config (the shipped example sets one) or USAF_HELD_OUT_FRAC was refused,
    under a hint that flags win (found in review). The control: both from flags are still refused."""
    base = {"inputs": [tmp_path], "model": "m"}
    toml = tmp_path / "usaf.toml"
    toml.write_text("[tokenize]\nheld_out_frac = 0.1\n")
    config = resolve_config(TokenizeConfig, section="tokenize", cli={**base, "held_out": ["json"]}, config_file=toml,
                            env={})  # fmt: skip
    assert (config.held_out, config.held_out_frac) == (["json"], 0.0)
    config = resolve_config(TokenizeConfig, section="tokenize", cli={**base, "held_out": ["json"]},
                            env={"USAF_HELD_OUT_FRAC": "0.5"})  # fmt: skip
    assert (config.held_out, config.held_out_frac) == (["json"], 0.0)
    toml.write_text('[tokenize]\nheld_out = ["json"]\n')
    config = resolve_config(TokenizeConfig, section="tokenize", cli={**base, "held_out_frac": 0.2}, config_file=toml,
                            env={})  # fmt: skip
    assert (config.held_out, config.held_out_frac) == ([], 0.2)
    with pytest.raises(UsafError, match="pass either --held-out or --held-out-frac"):
        resolve_config(TokenizeConfig, section="tokenize", cli={**base, "held_out": ["json"], "held_out_frac": 0.5},
                       env={})  # fmt: skip


def test_a_table_cannot_hold_an_argument_the_command_line_requires(tmp_path):
    """[generate] prompt was accepted: the command line requires PROMPT, so the table's value was never used (found in
    review). Refused as a setting the table does not have. The control: another generate setting is taken."""
    from usaf.settings.generate import GenerateConfig

    toml = tmp_path / "g.toml"
    toml.write_text('[generate]\nprompt = "abc"\n')
    with pytest.raises(UsafError, match=r"\[generate\] has no setting 'prompt'"):
        resolve_config(GenerateConfig, section="generate", cli={"prompt": "hi"}, config_file=toml, env={})
    toml.write_text("[generate]\nmax_new_tokens = 7\n")
    config = resolve_config(GenerateConfig, section="generate", cli={"prompt": "hi"}, config_file=toml, env={})
    assert (config.prompt, config.max_new_tokens) == ("hi", 7)


def test_held_out_is_read_from_no_shared_source_and_one_set_there_is_refused(tmp_path):
    """held_out is a source glob to tokenize and a path to eval: [defaults] held_out and USAF_HELD_OUT were read by
    both, as two different things (found in review). Each command reads it from its flag and its own table; one set
    in a shared source is refused, naming where to put it. The controls: [tokenize] and [eval] held_out are read,
    and a --held-out given makes the variable moot."""
    from usaf.cli.doctor import _usaf_env
    from usaf.settings.eval import EvalConfig

    base = {"inputs": [tmp_path], "model": "m"}
    toml = tmp_path / "usaf.toml"
    toml.write_text('[defaults]\nheld_out = ["json"]\n')
    for cls, section, cli in ((TokenizeConfig, "tokenize", base), (EvalConfig, "eval", {})):
        with pytest.raises(UsafError, match=r"\[defaults\] has 'held_out', which eval and tokenize read only from "
                                            r"their own table: put it under \[eval\] or \[tokenize\]"):  # fmt: skip
            resolve_config(cls, section=section, cli=cli, config_file=toml, env={})
        with pytest.raises(UsafError, match=r"USAF_HELD_OUT: read by no command .*: pass --held-out, or put held_out "
                                            rf"under \[{section}\] of a --config file"):  # fmt: skip
            resolve_config(cls, section=section, cli=cli, env={"USAF_HELD_OUT": "json"})
    toml.write_text('[tokenize]\nheld_out = ["json"]\n[eval]\nheld_out = ["h.jsonl"]\n')
    assert resolve_config(TokenizeConfig, section="tokenize", cli=base, config_file=toml, env={}).held_out == ["json"]
    assert resolve_config(EvalConfig, section="eval", cli={}, config_file=toml, env={}).held_out == [Path("h.jsonl")]
    given = resolve_config(TokenizeConfig, section="tokenize", cli={**base, "held_out": ["x"]},
                           env={"USAF_HELD_OUT": "json"})  # fmt: skip
    assert given.held_out == ["x"]
    meaning = dict((name, said) for name, _, said in _usaf_env({"USAF_HELD_OUT": "x", "USAF_DTYPE": "float32"}))
    assert meaning["USAF_HELD_OUT"].startswith("read by no command: --held-out of tokenize, eval is read from the flag")
    assert meaning["USAF_DTYPE"].startswith("--dtype of ")  # export's own dtype aside, train and others read it


def test_overwrite_is_asked_for_on_the_command_line_or_in_the_commands_own_table(tmp_path):
    """USAF_OVERWRITE=1 or [defaults] overwrite, set once, started every interrupted run over and replaced other
    models' quantizations without a word (found in review). Refused from a shared source, naming the flag and the
    table; the controls: the flag and [train] overwrite are read, and the flag makes the variable moot."""
    from usaf.settings.quantize import QuantizeConfig
    from usaf.settings.train import TrainConfig

    toml = tmp_path / "usaf.toml"
    toml.write_text("[defaults]\noverwrite = true\n")
    with pytest.raises(UsafError, match=r"\[defaults\] has .overwrite., which .*train.* read only from their own"):
        resolve_config(TrainConfig, section="train", cli={}, config_file=toml, env={})
    for cls, section, cli, variable in ((TrainConfig, "train", {}, "USAF_OVERWRITE"),
                                        (QuantizeConfig, "quantize", {"model": "m"}, "USAF_FORCE")):  # fmt: skip
        with pytest.raises(UsafError, match=rf"{variable}: read by no command .*: pass --"):
            resolve_config(cls, section=section, cli=cli, env={variable: "1"})
    toml.write_text("[train]\noverwrite = true\n")
    assert resolve_config(TrainConfig, section="train", cli={}, config_file=toml, env={}).overwrite
    # the table the refusal names, already there, was refused all the same; USAF_OVERWRITE=0 asks for what happens
    # anyway, and was told to pass --overwrite (found in review)
    assert resolve_config(TrainConfig, section="train", cli={}, config_file=toml, env={"USAF_OVERWRITE": "1"}).overwrite
    assert not resolve_config(TrainConfig, section="train", cli={}, env={"USAF_OVERWRITE": "0"}).overwrite
    assert resolve_config(TrainConfig, section="train", cli={"overwrite": True}, env={"USAF_OVERWRITE": "1"}).overwrite
    assert not resolve_config(TrainConfig, section="train", cli={}, env={}).overwrite


def test_train_from_and_layers_are_one_choice_the_higher_source_wins():
    """USAF_LAYERS with --train-from reached train's on-the-fly score as both, and a pydantic traceback came out
    (found in review). One choice, as --steps/--epochs: the higher source wins; from one level both are refused, by
    train as by score (the control)."""
    from usaf.settings.score import ScoreConfig
    from usaf.settings.train import TrainConfig

    for cls, section, base in ((TrainConfig, "train", {}), (ScoreConfig, "score", {})):
        config = resolve_config(cls, section=section, cli={**base, "train_from": 2}, env={"USAF_LAYERS": "3"})
        assert (config.train_from, config.layers) == (2, None)
        config = resolve_config(cls, section=section, cli={**base, "layers": [3]}, env={"USAF_TRAIN_FROM": "2"})
        assert (config.train_from, config.layers) == (None, [3])
        with pytest.raises(UsafError, match="pass either --train-from or --layers, not both"):
            resolve_config(cls, section=section, cli={**base, "train_from": 2, "layers": [3]}, env={})
