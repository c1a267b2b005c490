"""The CPU backend's thread count on a busy machine (usaf.backends.cpu.choose_threads): fewer threads than the
idle default when other processes hold cores, never fewer than one, and nothing changed where OMP_NUM_THREADS is
set."""

from __future__ import annotations

import pytest
import torch

from usaf.backends import cpu


@pytest.mark.parametrize(
    ("default", "cores", "busy_percent", "expected"),
    [
        (2, 2, 0.0, 2),  # idle: torch's default
        (2, 2, 20.0, 2),  # less than half a core busy
        (2, 2, 50.0, 1),  # one busy process on two cores
        (2, 2, 100.0, 1),  # every core busy: still one thread
        (8, 8, 30.0, 6),
        (4, 8, 10.0, 4),  # never more than torch's default
    ],
)
def test_threads_leave_the_busy_cores_alone(default, cores, busy_percent, expected):
    assert cpu.threads_for_load(default, cores, busy_percent) == expected


@pytest.fixture
def fresh_choice(monkeypatch):
    """A process that has not chosen yet, 2 cores at torch's 2 threads; restores the real count afterwards."""
    before = torch.get_num_threads()
    monkeypatch.setattr(cpu, "_threads_note", False)
    monkeypatch.setattr(cpu.os, "cpu_count", lambda: 2)
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_busy_machine_lowers_the_count_once_and_says_so(fresh_choice, monkeypatch):
    samples = []
    monkeypatch.setattr(cpu.psutil, "cpu_percent", lambda interval: samples.append(interval) or 55.0)
    note = cpu.choose_threads(env={})
    assert torch.get_num_threads() == 1 and note is not None and "1 of 2 cores busy" in note.message
    assert "OMP_NUM_THREADS" in note.message
    assert cpu.choose_threads(env={}) is note and len(samples) == 1  # chosen once per process


def test_an_idle_machine_keeps_the_default(fresh_choice, monkeypatch):  # the negative control
    monkeypatch.setattr(cpu.psutil, "cpu_percent", lambda interval: 3.0)
    assert cpu.choose_threads(env={}) is None and torch.get_num_threads() == 2


def test_omp_num_threads_is_the_users_choice(fresh_choice, monkeypatch):
    monkeypatch.setattr(cpu.psutil, "cpu_percent", lambda interval: pytest.fail("sampled despite OMP_NUM_THREADS"))
    assert cpu.choose_threads(env={"OMP_NUM_THREADS": "2"}) is None and torch.get_num_threads() == 2


def test_the_cpu_backend_carries_the_note(fresh_choice, monkeypatch):
    from usaf.backends import resolve_backend

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu.psutil, "cpu_percent", lambda interval: 90.0)
    backend = resolve_backend("cpu")
    assert any("cores busy" in n.message for n in backend.notes) and torch.get_num_threads() == 1
