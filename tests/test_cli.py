"""The CLI surface: instant help/version, only working commands listed, `python -m usaf`."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from helpers import invoke
from usaf import __version__

BUILT = {
    "demo",
    "tokenize",
    "quantize",
    "score",
    "train",
    "plan",
    "eval",
    "export",
    "generate",
    "inspect",
    "doctor",
    "tiny-model",
}
NOT_YET: set[str] = set()


def test_help_lists_only_working_commands():
    result = invoke("--help")
    assert result.exit_code == 0
    commands = result.stdout.split("Commands:")[1]
    listed = {line.split()[0] for line in commands.splitlines() if line.startswith("  ") and line.split()}
    assert listed >= BUILT, listed
    assert not (NOT_YET & listed), NOT_YET & listed


def test_every_command_has_help():
    for command in BUILT:
        result = invoke(command, "--help")
        assert result.exit_code == 0, (command, result.output)
        assert "Usage" in result.stdout
        # every flag's value is named by a plain type (an optional Annotated type once showed its repr: --targets)
        assert "typing." not in result.stdout and "Annotated" not in result.stdout, (command, result.stdout)


def test_a_positional_argument_is_named_in_the_usage_as_messages_name_it():
    """Errors say "MODEL ..." and "INPUTS ..."; the usage line said ``[model]`` and ``[inputs]...`` (found in
    review). The control: the lowercase name is gone from the usage line."""
    for command, name in (("quantize", "MODEL"), ("tokenize", "INPUTS"), ("inspect", "PATH"), ("plan", "MODEL")):
        usage = invoke(command, "--help").stdout.splitlines()[0]
        assert name in usage and name.lower() not in usage, (command, usage)
    said = " ".join(invoke("quantize", "--method", "rtn").stderr.split())
    assert "MODEL is required" in said, said


def test_ctrl_c_while_a_stage_is_still_importing_is_an_interrupt(monkeypatch):
    """Ctrl-C in the first second of train or quantize, while torch was being imported: the command's cleanup
    imported usaf.distributed, which imported the half-loaded torch again, and its traceback replaced the interrupt
    (exit 1; found in review). The cleanup leaves alone what was never imported. The control: with usaf.distributed
    imported, its cleanup runs (here, as a spy)."""
    import importlib
    import sys

    real = importlib.import_module

    def interrupted(name, *args):
        if name.startswith("usaf.stages."):
            raise KeyboardInterrupt
        return real(name, *args)

    class NoDistributed:  # importing usaf.distributed now fails, as it did after the half-import
        def find_spec(self, name, *args):
            if name == "usaf.distributed":
                raise RuntimeError("duplicate registrations for aten.linspace.Tensor_Tensor")
            return None

    monkeypatch.setattr(importlib, "import_module", interrupted)
    monkeypatch.delitem(sys.modules, "usaf.distributed", raising=False)
    monkeypatch.setattr(sys, "meta_path", [NoDistributed(), *sys.meta_path])
    result = invoke("quantize", "/nowhere", "--method", "rtn")
    assert result.exit_code == 130 and "interrupted" in result.stderr, result.output
    assert "Traceback" not in result.output and "duplicate registrations" not in result.output

    shutdowns = []
    monkeypatch.setitem(sys.modules, "usaf.distributed", type(sys)("usaf.distributed"))
    sys.modules["usaf.distributed"].shutdown = lambda clean: shutdowns.append(clean)
    assert invoke("quantize", "/nowhere", "--method", "rtn").exit_code == 130 and shutdowns == [False]


def test_version_and_module_entry_point():
    assert invoke("--version").stdout.strip() == f"usaf {__version__}"
    proc = subprocess.run([sys.executable, "-m", "usaf", "--version"], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == f"usaf {__version__}"


@pytest.mark.parametrize("argv", [["--version"], ["inspect", "/nonexistent"]], ids=["done", "refused"])
def test_a_stop_signal_once_the_command_is_over_is_ignored(argv):
    """Ctrl-C after a finished export, in the interpreter's teardown (a second or more with torch loaded), exited 130
    without a word (found in review): once the command is over, done or refused, stop signals are ignored and the
    exit status is its own. A real SIGINT is sent to the process itself after main() returns; the control, before
    main() runs, shows Python's default handler in place."""
    code = (
        "import os, signal, sys\n"
        "from usaf.cli.app import main\n"
        "print('before', signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)\n"
        f"sys.argv = ['usaf', *{argv!r}]\n"
        "try:\n    main()\nexcept SystemExit as e:\n    status = e.code\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "print('after', signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)\n"
        "sys.exit(status)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "before True" in proc.stdout and "after True" in proc.stdout, (proc.stdout, proc.stderr)
    assert proc.returncode == (0 if argv == ["--version"] else 2), proc.stderr


def test_cli_import_does_not_load_heavy_modules():
    code = (
        "import sys, usaf.cli.app; "
        "heavy = [m for m in ('torch', 'transformers', 'tokenizers', 'hqq', 'safetensors') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "", f"imported at CLI start: {proc.stdout}"


def test_unknown_command_is_a_usage_error():
    result = invoke("finetune")
    assert result.exit_code == 2


def test_example_config_file_is_valid_for_every_table():
    from pathlib import Path

    from usaf.config import resolve_config
    from usaf.stages.tokenize import TokenizeConfig

    example = Path(__file__).parent.parent / "examples" / "usaf.toml"
    cfg = resolve_config(
        TokenizeConfig, section="tokenize", cli={"inputs": [Path(".")], "model": "m"}, config_file=example, env={}
    )
    assert cfg.held_out_frac == 0.1 and cfg.decode_errors == "replace"


def test_tiny_model_then_inspect_describes_it(tmp_path):
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "tiny"
    result = invoke("tiny-model", out, "--family", "mixtral", "--layers", "3", "--json")
    assert result.exit_code == 0, result.output
    said = json.loads(result.stdout)
    assert said["path"] == str(out) and said["model"]["model_dir"] == str(out)  # not its temporary (review)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "mixtral" and model.config.num_hidden_layers == 3
    assert len(AutoTokenizer.from_pretrained(out)) == model.config.vocab_size
    # --verify of it said "a Hugging Face model: ... take what usaf quantize makes of it" (review): now what it is
    result = invoke("inspect", out, "--verify")
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "a usaf-made tiny model, a Hugging Face model with no sha256s to check; " \
        "usaf score, train, eval and generate take what usaf quantize makes of it" in said, said  # the way on too
    result = invoke("inspect", out, "--json")
    assert result.exit_code == 0, result.output
    described = json.loads(result.stdout)["model"]
    assert described["spec"]["family"] == "mixtral"
    assert sum(p.numel() for p in model.parameters()) == described["total_params"]
    # Another tool's manifest.json beside the model was taken for a broken usaf artifact (found in review); one of
    # usaf's, cut short, still is (the control: its damage is said)
    (out / "manifest.json").write_text('{"name": "my model", "files": 12}')
    result = invoke("inspect", out, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["model"]["spec"]["family"] == "mixtral", result.output
    (out / "manifest.json").write_text('{"kind": "hf_export", "usaf_vers')
    result = invoke("inspect", out)
    assert result.exit_code == 2 and "manifest.json" in result.stderr, result.output
    (out / "manifest.json").unlink()
    # Existing output and unknown families: one clear line, exit 2, nothing written.
    result = invoke("tiny-model", out)
    assert result.exit_code == 2 and "already exists" in result.stderr
    result = invoke("tiny-model", tmp_path / "llama", "--family", "llama")
    assert result.exit_code == 2 and "--family llama" in result.stderr and not (tmp_path / "llama").exists()
    # A model usaf cannot train (deepseek_v3's first layer is dense) was left written, and its rerun refused as
    # existing (found in review); the control: two layers make one.
    result = invoke("tiny-model", tmp_path / "dense", "--family", "deepseek_v3", "--layers", "1")
    assert result.exit_code == 2 and "--layers 1: config.json makes all 1 layers dense" in result.stderr
    assert not (tmp_path / "dense").exists()
    assert invoke("tiny-model", tmp_path / "dense", "--family", "deepseek_v3", "--layers", "2").exit_code == 0
    one = invoke("tiny-model", tmp_path / "one", "--layers", "1")  # "(1 layers)" (review)
    assert one.exit_code == 0 and "model (1 layer) with its tokenizer" in one.stdout, one.output
    # A seed out of range was a pydantic traceback (exit 1; review); the control: the largest one builds
    result = invoke("tiny-model", tmp_path / "seeded", "--seed", -1)
    assert result.exit_code == 2 and "--seed = -1: Input should be greater than or equal to 0" in result.stderr
    assert "Traceback" not in result.output and not (tmp_path / "seeded").exists()
    assert invoke("tiny-model", tmp_path / "seeded", "--seed", 2**32 - 1).exit_code == 0


def test_tiny_model_help_lists_the_families_it_builds():
    """--family took one of six names its help did not give (review); the list is kept beside the settings, which sit
    below usaf.families, so this checks the two agree."""
    from usaf.families import SUPPORTED_FAMILIES
    from usaf.settings.tiny_model import FAMILIES

    assert FAMILIES == SUPPORTED_FAMILIES
    shown = " ".join(invoke("tiny-model", "--help").stdout.split())
    assert f"Model family (config.json model_type): {', '.join(SUPPORTED_FAMILIES)}." in shown, shown


def test_the_example_pipeline_chains_every_stage_through_the_workspace(tmp_path):
    """examples/pipeline.sh: tiny-model → tokenize → quantize → score → train → eval → export → generate, no paths."""
    import json
    import os
    from pathlib import Path

    script = Path(__file__).parent.parent / "examples" / "pipeline.sh"
    bin_dir = str(Path(sys.executable).parent)  # the `usaf` console script of this environment
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    proc = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for kind in ("tokens", "quantized_model", "plan", "run", "eval_report", "hf_export"):
        (artifact,) = (tmp_path / kind).iterdir()
        assert json.loads((artifact / "manifest.json").read_text())["kind"] == kind
    assert "newest made for this model" in proc.stderr
    assert "32 tokens" in proc.stderr and proc.stdout.strip()  # generate's summary line and its text


@pytest.mark.parametrize("args", [
    ["tokenize", "{corpus}", "--model", "{tok}", "--out", ""],
    ["tokenize", "", "--model", "{tok}", "--out", "{cwd}/tokens"],
    ["tokenize", "{corpus}", "--model", "", "--out", "{cwd}/tokens"],
    ["tokenize", "{corpus}", "--model", "{tok}", "--config", ""],
    ["tokenize", "{corpus}", "--config", "{toml}"],
    ["export", "--base", "", "--out", "{cwd}/export"],
    ["quantize", "", "--out", "{cwd}/q"],
    ["plan", ""],
], ids=["--out", "INPUTS", "--model", "--config", "toml out", "--base", "quantize MODEL", "plan MODEL"])  # fmt: skip
def test_an_empty_path_is_refused_not_read_as_the_current_directory(tmp_path, monkeypatch, args):
    """``--out "$OUT"`` with OUT unset: click read "" as the current directory, which it then wrote into or refused
    for what it held; ``--base ""`` read the current directory as the model (found in review). The control: "." is
    the current directory, written into."""
    from usaf.testing import build_tiny_tokenizer

    tok, cwd, corpus = tmp_path / "tok", tmp_path / "cwd", tmp_path / "corpus.txt"
    build_tiny_tokenizer(tok)
    corpus.write_text("def f(x):\n    return x + 1\n" * 40, encoding="utf-8")
    toml = tmp_path / "settings.toml"
    toml.write_text(f'[tokenize]\nout = ""\nmodel = "{tok}"\n', encoding="utf-8")
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    result = invoke(*[a.format(corpus=corpus, tok=tok, cwd=cwd, toml=toml) for a in args])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "an empty path" in said, said
    assert "an empty path (an unset shell variable?): pass a path" in said or 'out = "" is an empty path' in said
    assert list(cwd.iterdir()) == []
    if args[-2:] == ["--out", ""]:  # control
        done = invoke(*[a.format(corpus=corpus, tok=tok, cwd=cwd, toml=toml) for a in args[:-1]], ".")
        assert done.exit_code == 0 and (cwd / "manifest.json").is_file(), done.output


@pytest.mark.parametrize(("args", "said", "lists"), [
    (["train", "--steps", "abc"], "error: invalid value for '--steps'", "usaf train -h` lists its options"),
    (["train", "--bogus"], "error: no such option: --bogus", "usaf train -h` lists its options"),
    (["tokenize", "--seq-len"], "error: option '--seq-len' requires an", "usaf tokenize -h` lists its options"),
    (["inspect"], "error: missing argument 'PATH'", "usaf inspect -h` lists its options"),
    (["trian"], "error: no such command 'trian'. Did you mean 'train'?", "usaf -h` lists the commands"),
    (["--bogus"], "error: no such option: --bogus", "usaf -h` lists the commands"),
])  # fmt: skip
def test_a_command_line_that_does_not_parse_is_said_as_usafs_errors_are(args, said, lists):
    """``--steps abc``, an unknown option or command, a missing value: click printed its ``Usage:`` block, a ``Try``
    line and ``Error: Invalid value ...``, where usaf's errors are an ``error:`` and a ``hint:`` line (found in
    review). Exit 2 as before. The control: ``usaf`` alone still prints the help (click raises it as a usage error
    too), and ``-h`` its usage."""
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(said) and lines[1].startswith("hint: `") and lines[1].endswith(
        lists), lines  # fmt: skip
    assert "Usage:" not in result.output and "Error:" not in result.output and result.stdout == ""
    helped = invoke()
    assert "Usage: usaf [OPTIONS] COMMAND" in helped.output and "Commands" in helped.output
    if args[0] in ("train", "tokenize", "inspect"):
        assert invoke(args[0], "-h").output.startswith(f"Usage: usaf {args[0]}")


def test_an_empty_path_in_a_toml_list_is_named_with_its_list_and_nothing_else_is_said_of_it(tmp_path):
    """``inputs = ["a.txt", ""]`` in a --config table was said as ``inputs = ""``, and with it "no INPUTS given"
    (the refused value left the field unset); ``model = ""`` added "--model is required" (found in review). The
    control: a real problem of another setting beside it is still said."""
    from usaf.testing import build_tiny_tokenizer

    tok, corpus, toml = tmp_path / "tok", tmp_path / "a.txt", tmp_path / "settings.toml"
    build_tiny_tokenizer(tok)
    corpus.write_text("def f(x):\n    return x + 1\n" * 40, encoding="utf-8")
    cases = [
        (f'inputs = ["{corpus}", ""]\nmodel = "{tok}"', f'inputs = ["{corpus}", ""], whose "" is an empty path'),
        (f'inputs = ["{corpus}"]\nmodel = ""', 'model = "" is an empty path'),
        ('inputs = [""]\nmodel = ""\nseq_len = 0', 'inputs = [""], whose "" is an empty path'),
    ]
    for table, needle in cases:
        toml.write_text(f"[tokenize]\n{table}\n", encoding="utf-8")
        result = invoke("tokenize", "--config", toml, "--out", tmp_path / "tokens")
        said = " ".join(result.stderr.split())
        assert result.exit_code == 2 and needle in said, said
        assert "no INPUTS given" not in said and "is required" not in said, said
        assert not (tmp_path / "tokens").exists()
    assert "seq_len = 0" in said and 'model = "" is an empty path' in said  # the control: the others still said


def test_a_single_valued_option_given_twice_with_other_values_says_the_one_used(tmp_path):
    """``usaf generate --checkpoint A --checkpoint B`` used B, the first accepted and ignored in silence (found in
    review); ``--stability --no-stability`` kept the last. The last still wins (a script's ``$CMD --save-every 2``
    overrides its defaults), and a note names the one used. The controls: the same value twice, and an option that
    takes several values (--include), say nothing; a value that looks like an option is a value."""
    from usaf.testing import build_tiny_tokenizer

    twice = invoke("generate", "hello", "--checkpoint", tmp_path / "a", "--checkpoint", tmp_path / "b")
    said = " ".join(twice.stderr.split())
    assert f"--checkpoint given more than once (--checkpoint {tmp_path / 'a'}, --checkpoint {tmp_path / 'b'}): the " \
        f"last, --checkpoint {tmp_path / 'b'}, is used" in said, said
    assert f"--checkpoint {tmp_path / 'b'}: no such directory" in said  # the last was the one used
    both = invoke("score", "--stability", "--no-stability", "--model", tmp_path / "m")
    assert "(--stability, --no-stability): the last, --no-stability, is used" in both.stderr, both.output
    tok, corpus = tmp_path / "tok", tmp_path / "a.jsonl"
    build_tiny_tokenizer(tok)
    corpus.write_text('{"--out": "def f(x):\\n    return x + 1\\n"}\n' * 40, encoding="utf-8")
    out = tmp_path / "tokens"
    same = invoke("tokenize", corpus, "--model", tok, "--model", tok, "--include", "*.jsonl", "--include", "*.txt",
                  "--text-field", "--out", "--out", out)  # fmt: skip
    assert same.exit_code == 0 and (out / "manifest.json").is_file(), same.output
    assert "more than once" not in same.stderr


def test_a_tokenizer_model_set_in_a_config_table_is_named_there_when_missing(tmp_path):
    """``[tokenize] model = "tm"`` of no such directory was said as "--model tm: no such directory" (found in
    review): the value was set in the file. The control: the flag is named when the flag set it."""
    corpus, toml = tmp_path / "a.txt", tmp_path / "settings.toml"
    corpus.write_text("def f(x):\n    return x + 1\n" * 40, encoding="utf-8")
    toml.write_text(f'[tokenize]\nmodel = "{tmp_path / "nowhere"}"\n', encoding="utf-8")
    said = " ".join(invoke("tokenize", corpus, "--config", toml, "--out", tmp_path / "t").stderr.split())
    assert f"--config {toml} [tokenize] model {tmp_path / 'nowhere'}: no such directory" in said, said
    flag = " ".join(invoke("tokenize", corpus, "--model", tmp_path / "nowhere", "--out", tmp_path / "t").stderr.split())
    assert f"--model {tmp_path / 'nowhere'}: no such directory" in flag, flag


def test_a_progress_bar_into_a_log_is_one_whole_line(monkeypatch):
    """Into a log (stderr no terminal) rich printed the bar once on 80 columns: a longer line wrapped, leaving "kB"
    alone on a line and the loss cut to "0:0…" (found in review). There it is one line without a bar. The control:
    on a terminal the line is drawn on the terminal's width (80 here), cut."""
    import io

    from usaf.cli import progress
    from usaf.cli.console import err

    def shown(terminal: bool) -> str:
        log = io.StringIO()
        monkeypatch.setattr(sys, "stderr", log)  # rich's stderr consoles write to sys.stderr as it is at each print
        monkeypatch.setattr(err, "_force_terminal", terminal)
        bar = progress.RichProgress()
        bar.start("quantizing experts of a model with a long name " + "x" * 40, 10**10, "bytes")
        bar.advance(10**10, tokens=10**9, loss=1.25)
        bar.finish()
        return log.getvalue()

    line = shown(False)
    assert len(line.splitlines()) == 1 and "9.3 GiB/9.3 GiB (100 %), " in line and "loss 1.2500" in line, line
    assert "━" not in line
    assert "…" in shown(True)


def test_a_progress_bar_into_a_log_says_where_it_is_every_so_often(monkeypatch):
    """Into a log rich prints a bar once, at its end: a train under tee said nothing for 182 of its 189 s (found in
    review). A line every LOG_EVERY_SECONDS says where it is and the time left. The control: on a terminal, the bar
    alone (no such lines), with its time left kept at 80 columns, where rich cut it (the counters come after it)."""
    import io

    from usaf.cli import progress
    from usaf.cli.console import err

    monkeypatch.setattr(progress, "LOG_EVERY_SECONDS", 0.0)

    def shown(terminal: bool) -> str:
        log = io.StringIO()
        monkeypatch.setattr(sys, "stderr", log)
        monkeypatch.setattr(err, "_force_terminal", terminal)
        bar = progress.RichProgress()
        bar.start("training", 1668, "steps", done=400)
        for _ in range(3):
            bar.advance(10, **{"tokens since the resume": 266_137, "loss (20-step mean)": 3.3124})
        bar.finish()
        return log.getvalue()

    logged = shown(False).splitlines()
    lines = [line for line in logged if "so far" in line]
    assert len(lines) == 3 and lines[-1].startswith("training 430/1,668 steps (26 %), about "), lines
    # its end: how far it got and the time taken, said so (rich's line showed a bare time, and no commas)
    assert logged[-1].startswith("training 430/1,668 steps (26 %), stopped after 0:00:00  loss"), logged
    assert " left, 0:00:00 so far  loss (20-step mean) 3.3124  266,137 tokens since the resume (" in lines[-1], lines
    bar = shown(True).splitlines()[0]  # 80 columns
    assert "so far" not in bar and re.search(r"430/1668 steps \d:\d\d:\d\d loss \(20-step mean\) 3.3", bar), bar
