"""``usaf train --deterministic`` (usaf.backends.determinism) on the CPU.

What it is for, bit-exact runs on a GPU, is checked by tests/test_cuda.py. Here: the flag trains the same bytes as
the CPU's default (whose kernels are deterministic already), leaves the process's torch setting as it found it, may
change when a run resumes, and turns an op without a deterministic kernel into one error line.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from helpers import ctrl_c_at_step, explain, invoke
from usaf.stages.train import trainer

STEPS = ("--steps", 6, "--reselect-every", 3, "--save-every", 3, "--lr", 0.05)


def train(prepared, out, *extra):
    qdir, tokens, plan = prepared("qwen3_moe")
    return invoke("train", "--model", qdir, "--data", tokens, "--plan", plan, "--out", out, *STEPS, *extra)


def deltas(run):
    return load_file(str(run / "final" / "deltas.safetensors"))


def assert_same_deltas(a, b):
    assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a)


def test_deterministic_trains_the_cpus_bytes_and_restores_torchs_setting(prepared, tmp_path):
    for name, extra in (("default", ()), ("deterministic", ("--deterministic",))):
        result = train(prepared, tmp_path / name, *extra)
        assert result.exit_code == 0, explain(result)
        assert not torch.are_deterministic_algorithms_enabled()  # restored after the run, not left on
    assert_same_deltas(deltas(tmp_path / "default"), deltas(tmp_path / "deterministic"))


def test_a_run_resumes_with_or_without_it(prepared, tmp_path):
    assert train(prepared, tmp_path / "straight").exit_code == 0
    with ctrl_c_at_step(4):
        assert train(prepared, tmp_path / "resumed").exit_code == 130
    result = train(prepared, tmp_path / "resumed", "--deterministic")
    assert result.exit_code == 0 and "resuming from" in result.stderr, explain(result)
    assert_same_deltas(deltas(tmp_path / "straight"), deltas(tmp_path / "resumed"))


NO_KERNEL = "index_foo_cuda does not have a deterministic implementation, but you set 'torch.use_deterministic_algo"


@pytest.mark.parametrize(
    ("message", "exit_code"),
    [
        (NO_KERNEL, 2),
        ("index_foo_cuda: some other failure", 1),  # negative control: any other RuntimeError stays a crash
    ],
)
def test_an_op_without_a_deterministic_kernel_is_one_error_line(prepared, tmp_path, monkeypatch, message, exit_code):
    def fail(self):
        raise RuntimeError(message)

    monkeypatch.setattr(trainer.Trainer, "step", fail)
    result = train(prepared, tmp_path / "run", "--deterministic")
    assert result.exit_code == exit_code, explain(result)
    if exit_code == 2:
        assert "error: --deterministic: index_foo_cuda does not have a deterministic implementation" in result.output
        assert "run without --deterministic" in result.output
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("reproducible", [False, True])
def test_a_resume_on_a_device_that_is_not_reproducible_says_so(prepared, tmp_path, monkeypatch, reproducible):
    """A resumed run on a device whose sums' order varies (a GPU, simulated on the CPU) notes that it matches only
    within that noise unless --deterministic; the CPU (reproducible) says nothing."""
    import dataclasses

    from usaf.backends import cpu

    caps = dataclasses.replace(cpu.capabilities(), reproducible=reproducible)
    monkeypatch.setattr(cpu, "capabilities", lambda: caps)
    with ctrl_c_at_step(4):
        assert train(prepared, tmp_path / "run").exit_code == 130
    for extra, noted in (((), not reproducible), (("--deterministic",), False)):
        with ctrl_c_at_step(5):  # interrupted again, so the second resume has a checkpoint to resume from
            result = train(prepared, tmp_path / "run", *extra)
        assert "resuming from" in result.stderr, explain(result)
        assert ("only within the device's run-to-run noise" in result.stderr) is noted, result.stderr
