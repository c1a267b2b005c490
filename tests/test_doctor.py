"""``usaf doctor`` through the real CLI app: tables, --json, settings precedence, errors (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from usaf.backends.testing import hide_accelerators, simulate_cuda, simulate_directml
from usaf.cli.app import app

runner = CliRunner()


@pytest.fixture(autouse=True)
def _clean_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only machine with none of the variables doctor reads set."""
    hide_accelerators(monkeypatch)
    for name in list(os.environ):
        if name.startswith(("USAF_", "USE_")) or name.endswith("_VISIBLE_DEVICES"):
            monkeypatch.delenv(name)


def doctor_json(*args: str, env: dict[str, str] | None = None) -> dict:
    result = runner.invoke(app, ["doctor", "--json", *args], env=env)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_doctor_tables() -> None:
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    # "configuration" (the expert layout, can/cannot) was built and never printed (found in review)
    headings = ("versions", "devices", "unavailable backends", "environment", "what a run here would use",
                "configuration", "expert layout")  # fmt: skip
    for heading in headings:
        assert heading in result.stdout
    assert torch.__version__ in result.stdout and "CPU-only build" in result.stdout
    assert "float32" in result.stdout and "torch-directml" in result.stdout
    assert "capabilities" not in result.stdout  # only with --verbose
    assert "capabilities" in runner.invoke(app, ["doctor", "--verbose"]).stdout


@pytest.fixture(autouse=True)
def _no_device_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """doctor lists the device-related variables that are set; the tests set the ones they want."""
    from usaf.backends.legacy import _OTHER_MEANINGS

    for name in _OTHER_MEANINGS:
        monkeypatch.delenv(str(name), raising=False)


def test_doctor_json_fields() -> None:
    report = doctor_json()
    assert report["versions"]["torch"] == torch.__version__
    assert report["versions"]["typer"] and report["versions"]["pydantic"]
    assert report["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert report["torch_build"] == "CPU-only"
    assert set(report["extras"]) == {"directml", "dev"} and report["extras"]["dev"]["pytest"]
    devices = {d["name"]: d for d in report["devices"]}
    assert list(devices) == ["cuda", "directml", "mps", "cpu"]
    assert devices["cpu"]["available"] and devices["cpu"]["devices"][0]["details"]["logical_cores"] >= 1
    assert not devices["cuda"]["available"] and "CPU-only" in devices["cuda"]["reason"]
    assert "torch-directml" in devices["directml"]["reason"]
    run = report["run"]
    assert (run["backend"], run["device"]) == ("cpu", "cpu")
    fp32 = {"compute": "float32", "master": "float32", "autocast": None, "loss_scaling": False}
    assert run["dtype_policy"] == fp32
    assert 0 < run["memory"]["host_available"] <= run["memory"]["host_total"]
    assert report["environment"] == [] and run["notes"] == []


def test_doctor_sees_simulated_rocm_and_directml(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_cuda(monkeypatch, capability=(11, 0), rocm="6.2", names=("AMD Radeon RX 7900 XTX",))
    simulate_directml(monkeypatch)
    report = doctor_json()
    assert report["torch_build"] == "ROCm 6.2"
    assert report["run"]["label"] == "ROCm 6.2" and report["run"]["dtype_policy"]["compute"] == "bfloat16"
    assert report["run"]["memory"]["device_total"] == 24 * 2**30
    directml = next(d for d in report["devices"] if d["name"] == "directml")
    assert directml["available"] and directml["devices"][0]["device"] == "directml:0"
    fp16 = doctor_json("--device", "directml")["run"]
    expected = {"compute": "float16", "master": "float32", "autocast": None, "loss_scaling": True}
    assert fp16["dtype_policy"] == expected


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        ([], {"USE_CUDA": "1"}, "cuda"),  # legacy applies when nothing else sets the device
        ([], {"USE_CUDA": "0"}, "cpu"),
        ([], {"USE_CUDA": "1", "USAF_DEVICE": "cpu"}, "cpu"),  # USAF_DEVICE beats legacy
        (["--device", "cpu"], {"USAF_DEVICE": "cuda"}, "cpu"),  # the flag beats USAF_DEVICE
        (["--config", "{toml}"], {"USE_CUDA": "1"}, "cpu"),  # --config beats legacy
        (["--config", "{toml}"], {"USAF_DEVICE": "cuda"}, "cuda"),  # USAF_DEVICE beats --config
        (["--config", "{toml}", "--device", "cuda:0"], {}, "cuda"),
    ],
)
def test_device_precedence(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, args: list[str], env: dict[str, str], expected: str
) -> None:
    simulate_cuda(monkeypatch)
    toml = tmp_path / "usaf.toml"
    toml.write_text('[doctor]\ndevice = "cpu"\n')
    args = [str(toml) if a == "{toml}" else a for a in args]
    assert doctor_json(*args, env=env)["run"]["backend"] == expected


def test_defaults_table_sets_the_device(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    simulate_cuda(monkeypatch)
    toml = tmp_path / "usaf.toml"
    toml.write_text('[defaults]\ndevice = "cpu"\n')
    assert doctor_json("--config", str(toml))["run"]["backend"] == "cpu"
    toml.write_text('[defaults]\ndevice = "cpu"\n[doctor]\ndevice = "cuda"\n')
    assert doctor_json("--config", str(toml))["run"]["backend"] == "cuda"


def test_legacy_variables_are_explained_and_multi_gpu_warned() -> None:
    report = doctor_json(env={"USE_MULTI_GPU": "1", "USE_AMP": "1", "USAF_DEVICE": "cpu"})
    names = [row["name"] for row in report["environment"]]
    assert names == ["USE_AMP", "USE_MULTI_GPU", "USAF_DEVICE"]
    assert report["run"]["dtype_policy"]["compute"] == "bfloat16"  # USE_AMP=1 on CPU
    (warning,) = [n for n in report["run"]["notes"] if n["level"] == "warning"]
    assert "USE_MULTI_GPU" in warning["message"] and "torchrun" in warning["message"]


def test_usaf_variables_name_the_commands_that_read_them_and_a_misspelt_one_reads_nowhere() -> None:
    """A misspelt USAF_STEPPS was shown as "--stepps of every command that has it", which none has (found in
    review). Controls: a setting names its commands (export's own-only dtype not among them), a plain variable its
    meaning."""
    env = {"USAF_STEPPS": "5", "USAF_LR": "0.1", "USAF_DTYPE": "auto", "USAF_DIST_TIMEOUT_MIN": "5"}
    rows = {row["name"]: row for row in doctor_json(env=env)["environment"]}
    meaning = {name: " ".join(str(value) for value in row.values()) for name, row in rows.items()}
    assert "read by no command" in meaning["USAF_STEPPS"] and "--stepps" not in meaning["USAF_STEPPS"]
    assert "--lr of demo, train" in meaning["USAF_LR"]
    assert "--dtype of" in meaning["USAF_DTYPE"] and "export" not in meaning["USAF_DTYPE"]
    assert "minutes" in meaning["USAF_DIST_TIMEOUT_MIN"]


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--device", "gpu"], {}, "--device gpu: unknown device 'gpu'"),
        (["--device", "cuda:x"], {}, "device index 'x' is not a non-negative integer"),
        (["--device", "cpu:0"], {}, "--device cpu:0: 'cpu' takes no index"),
        ([], {"USAF_DEVICE": "tpu"}, "USAF_DEVICE tpu: unknown device 'tpu'"),  # where the value came from
    ],
)
def test_bad_device_is_one_red_line_and_exit_2(args: list[str], env: dict[str, str], needle: str) -> None:
    for json_flag in ([], ["--json"]):
        result = runner.invoke(app, ["doctor", *json_flag, *args], env=env)
        assert result.exit_code == 2, result.output
        assert needle in result.stderr and "hint:" in result.stderr
        assert "Traceback" not in result.output and result.stdout == ""


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--device", "cuda"], {}, "--device cuda: CUDA is not available here"),
        (["--device", "mps"], {}, "--device mps: MPS is not available here"),
        (["--device", "directml"], {}, "--device directml: DirectML is not available here"),
        ([], {"USAF_DEVICE": "cuda"}, "USAF_DEVICE cuda: CUDA is not available here"),
        ([], {"USE_CUDA": "1"}, "(legacy for --device cuda): CUDA is not available here"),
    ],
)
def test_a_device_not_here_is_said_after_the_whole_report(args: list[str], env: dict[str, str], needle: str) -> None:
    """Doctor printed the refusal alone, where it is the tool to diagnose it: versions, devices and environment went
    unshown (found in review). They are shown, then the refusal, exit 2 (a run with the setting would refuse)."""
    result = runner.invoke(app, ["doctor", *args], env=env)
    assert result.exit_code == 2 and needle in result.stderr and "hint:" in result.stderr, result.output
    said = " ".join(result.stdout.split())
    assert "versions" in said and "unavailable backends" in said and "without the device asked for" in said, said
    result = runner.invoke(app, ["doctor", "--json", *args], env=env)
    report = json.loads(result.stdout)
    assert result.exit_code == 2 and needle in report["refused"]["error"] and needle in result.stderr
    assert report["run"]["device"] == "cpu" and report["versions"]["torch"] == torch.__version__
    control = json.loads(runner.invoke(app, ["doctor", "--json"]).stdout)
    assert control["refused"] is None


def test_error_line_is_printed_verbatim(tmp_path: Path) -> None:
    result = runner.invoke(app, ["doctor", "--device", "cuda:x"])
    assert result.exit_code == 2 and "--device cuda:x: device index" in result.stderr
    toml = tmp_path / "usaf.toml"
    toml.write_text("[doctor]\ndevcie = 'cpu'\n")
    result = runner.invoke(app, ["doctor", "--config", str(toml)])
    assert result.exit_code == 2 and "[doctor] has no setting 'devcie'" in result.stderr


def test_unknown_config_key_is_exit_2(tmp_path: Path) -> None:
    toml = tmp_path / "usaf.toml"
    toml.write_text("[doctor]\ndevcie = 'cpu'\n")
    result = runner.invoke(app, ["doctor", "--config", str(toml)])
    assert result.exit_code == 2 and "has no setting 'devcie'" in result.stderr


def test_doctor_module_does_not_import_torch() -> None:
    code = "import sys, usaf.cli.doctor; print('torch' in sys.modules, 'pydantic' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
