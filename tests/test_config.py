"""Settings precedence: flag > USAF_* env > --config TOML ([command] over [defaults]) > legacy env > default."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field, ValidationError

from usaf.config import StageConfig, resolve_config
from usaf.errors import UsafError


class Demo(StageConfig):
    frac: float = Field(0.005, gt=0, le=1)
    steps: int = Field(180, ge=1)
    layers: list[int] = Field(default_factory=list)
    name: str = "x"


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "usaf.toml"
    path.write_text(text)
    return path


def test_defaults_when_nothing_is_set():
    cfg = resolve_config(Demo, section="demo", cli={"frac": None}, env={})
    assert cfg == Demo()


def test_each_source_wins_over_the_next(tmp_path):
    file = toml(tmp_path, "[defaults]\nfrac = 0.1\nsteps = 5\nname = 'd'\n[demo]\nfrac = 0.2\n")
    env = {"USAF_STEPS": "7", "FRAC": "0.9", "STEPS": "99"}
    legacy = {"FRAC": "frac", "STEPS": "steps"}
    cfg = resolve_config(Demo, section="demo", cli={"name": "cli"}, config_file=file, env=env, legacy_env=legacy)
    # name: flag; steps: USAF_ env over TOML and legacy; frac: [demo] over [defaults] and legacy.
    assert (cfg.name, cfg.steps, cfg.frac) == ("cli", 7, 0.2)
    # Legacy variables fill what nothing else set.
    cfg = resolve_config(Demo, section="demo", cli={}, env={"FRAC": "0.3"}, legacy_env=legacy)
    assert cfg.frac == 0.3


def test_list_values_from_env_as_commas_or_json():
    assert resolve_config(Demo, section="demo", cli={}, env={"USAF_LAYERS": "1, 2,3"}).layers == [1, 2, 3]
    assert resolve_config(Demo, section="demo", cli={}, env={"USAF_LAYERS": "[4,5]"}).layers == [4, 5]


def test_a_whole_number_choice_from_env_is_a_number():
    """USAF_NBITS=4 was refused for every value ("Input should be 2, 3, 4 or 8": the string '4' is not the number);
    a value outside the choices is still refused, naming the variable (the control)."""
    from usaf.settings.quantize import QuantizeConfig

    given = {"model": "m"}
    assert resolve_config(QuantizeConfig, section="quantize", cli=given, env={"USAF_NBITS": " 3"}).nbits == 3
    for bad in ("5", "four"):
        with pytest.raises(UsafError, match="USAF_NBITS"):
            resolve_config(QuantizeConfig, section="quantize", cli=given, env={"USAF_NBITS": bad})


def test_every_problem_is_reported_with_its_source(tmp_path):
    file = toml(tmp_path, "[demo]\nsteps = 0\n")
    with pytest.raises(UsafError) as e:
        resolve_config(Demo, section="demo", cli={"frac": 2.0}, config_file=file, env={"USAF_NAME": ""})
    message = e.value.message
    assert "--frac = 2.0" in message and "less than or equal to 1" in message
    assert f"--config {file} [demo] steps = 0" in message
    assert e.value.hint == "fix each setting the error names (flags win over USAF_* variables, which win over --config)"
    # flags alone: which source wins does not bear on it, and it read as an unrelated hint (found in review)
    with pytest.raises(UsafError) as e:
        resolve_config(Demo, section="demo", cli={"frac": 2.0}, env={})
    assert e.value.hint == "fix the setting the error names"


def test_a_toml_boolean_is_not_a_number(tmp_path):
    """pydantic's lax mode read `steps = true` as 1 (found in review). Control: a boolean field takes one."""

    class WithFlag(Demo):
        cache: bool = False
        stream: bool | None = None

    file = toml(tmp_path, "[demo]\nsteps = true\n")
    with pytest.raises(UsafError, match=r"\[demo\] steps = true: a boolean, which this setting does not take"):
        resolve_config(WithFlag, section="demo", cli={}, config_file=file, env={})
    file = toml(tmp_path, "[demo]\ncache = true\nstream = false\nsteps = 3\n")
    taken = resolve_config(WithFlag, section="demo", cli={}, config_file=file, env={})
    assert (taken.cache, taken.stream, taken.steps) == (True, False, 3)


def test_unknown_toml_key_and_bad_toml_are_errors(tmp_path):
    with pytest.raises(UsafError, match="has no setting 'fracc'"):
        resolve_config(Demo, section="demo", cli={}, config_file=toml(tmp_path, "[demo]\nfracc = 1\n"), env={})
    with pytest.raises(UsafError, match="not valid TOML"):
        resolve_config(Demo, section="demo", cli={}, config_file=toml(tmp_path, "[demo\n"), env={})
    with pytest.raises(UsafError, match="no such file"):
        resolve_config(Demo, section="demo", cli={}, config_file=tmp_path / "missing.toml", env={})


def test_other_commands_tables_are_ignored(tmp_path):
    file = toml(tmp_path, "[train]\nlr = 1\n[demo]\nsteps = 3\n")
    assert resolve_config(Demo, section="demo", cli={}, config_file=file, env={}).steps == 3


def test_config_is_frozen_and_forbids_extra_keys():
    cfg = Demo()
    with pytest.raises(ValidationError):
        cfg.frac = 0.5  # type: ignore[misc]
    with pytest.raises(TypeError):
        resolve_config(Demo, section="demo", cli={"nope": 1}, env={})


class WithPaths(StageConfig):
    out: Path | None = None
    inputs: list[Path] = Field(default_factory=list)
    name: str = "x"


def test_a_home_in_a_path_setting_is_expanded_wherever_it_was_set(tmp_path, monkeypatch):
    """A shell expands ``~`` only at a word's start: ``--out=~/x``, a quoted path, a variable or a TOML value made a
    directory named ``~`` in the current one (found in review). The control: a string setting keeps its ``~``."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home = tmp_path / "home"
    cfg = resolve_config(WithPaths, section="demo", cli={"out": Path("~/x"), "inputs": [Path("~/a"), Path("b")],
                                                         "name": "~/n"}, env={})  # fmt: skip
    assert cfg.out == home / "x" and cfg.inputs == [home / "a", Path("b")] and cfg.name == "~/n"
    file = toml(tmp_path, "[demo]\nout = '~/t'\n")
    assert resolve_config(WithPaths, section="demo", cli={}, config_file=file, env={}).out == home / "t"
    assert resolve_config(WithPaths, section="demo", cli={}, env={"USAF_OUT": "~/e"}).out == home / "e"
    (home / "c.toml").parent.mkdir()
    (home / "c.toml").write_text("[demo]\nname = 'from home'\n")
    assert resolve_config(WithPaths, section="demo", cli={}, config_file=Path("~/c.toml"), env={}).name == "from home"


def test_a_path_of_the_wrong_kind_is_named_as_what_it_is(tmp_path):
    """A directory given as --config was "no such file", a file given as a model directory "no such directory" (found
    in review)."""
    from usaf.data.hub import resolve_model_dir

    with pytest.raises(UsafError, match=f"--config {tmp_path}: a directory, not a file"):
        resolve_config(Demo, section="demo", cli={}, config_file=tmp_path, env={})
    (tmp_path / "model.py").write_text("")
    with pytest.raises(UsafError, match="MODEL .*model.py: a file, not a directory"):
        resolve_model_dir(str(tmp_path / "model.py"))
    with pytest.raises(UsafError, match="MODEL .*absent: no such directory"):  # the control: absent is still said so
        resolve_model_dir(str(tmp_path / "absent"))


def test_a_setting_read_from_the_original_tools_variable_is_said(tmp_path, monkeypatch):
    """``STEPS=3 usaf train ...`` trained 3 steps and never said why, where LR_PEAK was named as the lr's source
    (found in review). Every command that reads the original tool's variables says which it read, as which flag.
    The control: without them, nothing is said."""
    from helpers import invoke
    from usaf.config import legacy_note
    from usaf.settings.train import TrainConfig

    settings = resolve_config(TrainConfig, section="train", cli={"model": "m"}, env={"STEPS": "3", "LR_PEAK": "1e-3"},
                              legacy_env={"STEPS": "steps", "LR_PEAK": "lr"})  # fmt: skip
    assert settings.steps == 3 and legacy_note(settings) == (
        "read from the original tool's environment variables: STEPS=3 as --steps, LR_PEAK=0.001 as --lr (usaf's "
        "own: USAF_STEPS, ...)")  # fmt: skip
    assert legacy_note(resolve_config(TrainConfig, section="train", cli={"model": "m"}, env={})) is None
    assert invoke("tiny-model", tmp_path / "tm").exit_code == 0
    monkeypatch.setenv("MICROBATCH", "2")
    said = invoke("plan", tmp_path / "tm")
    assert said.exit_code == 0 and "MICROBATCH=2 as --microbatch" in said.stderr, said.output
    monkeypatch.delenv("MICROBATCH")
    assert "original tool" not in invoke("plan", tmp_path / "tm").stderr


def test_a_usaf_variable_no_setting_has_is_said_by_the_command(tmp_path, monkeypatch):
    """``USAF_SEQLEN=64`` (for USAF_SEQ_LEN) was ignored in silence by every command; doctor alone said it (found in
    review). Each command says it, with the name it may have meant; under torchrun, rank 0 alone. The control: a
    variable a setting has says nothing of the kind."""
    from helpers import invoke

    assert invoke("tiny-model", tmp_path / "tm").exit_code == 0
    monkeypatch.setenv("USAF_SEQLEN", "64")
    said = " ".join(invoke("plan", tmp_path / "tm").stderr.split())
    assert "USAF_SEQLEN: read by no command: misspelt? (did you mean USAF_SEQ_LEN?;" in said, said
    monkeypatch.setenv("RANK", "1")  # a rank other than 0 under torchrun: rank 0 says it, once
    assert "misspelt" not in invoke("plan", tmp_path / "tm").stderr
    monkeypatch.setenv("RANK", "0")
    assert "misspelt" in invoke("plan", tmp_path / "tm").stderr
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("USAF_SEQLEN")
    monkeypatch.setenv("USAF_SEQ_LEN", "64")
    assert "misspelt" not in invoke("plan", tmp_path / "tm").stderr


def test_a_toml_string_for_a_list_setting_is_shown_as_the_list_to_write(tmp_path):
    """``[tokenize] held_out = "shlex.py"`` got pydantic's "Input should be a valid list" alone (found in review): the
    message shows the list to write. The control: the list itself is taken."""
    from usaf.settings.tokenize import TokenizeConfig

    toml = tmp_path / "usaf.toml"
    toml.write_text('[tokenize]\nheld_out = "shlex.py"\n')
    with pytest.raises(UsafError, match=r'held_out = \["shlex.py"\]\)'):
        resolve_config(TokenizeConfig, section="tokenize", cli={"inputs": [tmp_path], "model": "m"}, config_file=toml,
                       env={})  # fmt: skip
    toml.write_text('[tokenize]\nheld_out = ["shlex.py"]\n')
    taken = resolve_config(TokenizeConfig, section="tokenize", cli={"inputs": [tmp_path], "model": "m"},
                           config_file=toml, env={})  # fmt: skip
    assert taken.held_out == ["shlex.py"]
