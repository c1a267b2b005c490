"""Data-parallel `usaf train` and `usaf score` under torchrun: 2 CPU processes on gloo.

The reference for a 2-rank run with microbatch 1 is one process with microbatch 1 × grad-accum 2: the same
global batch split the same way (grow scores are a per-microbatch statistic, |g1| + |g2|), so everything —
losses, gradients, the RigL reselection, the final deltas — must match bit for bit. The plans here train
frac 0.3 of a tiny model's expert weights, where the grow-score pools hold every candidate, so merging the
ranks' pools is exact (with overflowing pools both sides are lower-bound approximations; see
docs/ARCHITECTURE.md). One process with microbatch 2 matches a static-mask run to fp32 rounding.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from helpers import invoke, same_plan
from helpers_distributed import assert_same_deltas, deltas, finished, losses, torchrun
from usaf.artifacts import PlanManifest, RunManifest, load_verified
from usaf.stages.score_resume import CALIBRATION, RANK_CALIBRATION
from usaf.testing import stdlib_dir

STEPS = 10
RIGL = ("--steps", STEPS, "--reselect-every", 5, "--lr", 0.05, "--seed", 3)


def files(run: Path) -> list[str]:
    return sorted(str(p.relative_to(run)) for p in run.rglob("*"))


@pytest.fixture(scope="module", autouse=True)
def one_thread_like_the_ranks():
    """The ranks run with OMP_NUM_THREADS=1; the one-process twins run in this process, whose intra-op threads
    must match for their sums to be bit-identical (with 2 threads the losses differed by ~2e-7)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def setup(prepared, tmp_path_factory):
    """(qdir, tokens, plan at frac 0.3 of the experts and attention, root)."""
    qdir, tokens, _ = prepared("qwen3_moe")
    root = tmp_path_factory.mktemp("dp")
    plan = root / "plan"
    args = ("--model", qdir, "--data", tokens, "--frac", 0.3, "--calib-samples", 8, "--train-from", 2, "--no-stability",
            "--targets", "experts,attention")  # fmt: skip
    result = invoke("score", *args, "--out", plan)
    assert result.exit_code == 0, result.output
    return qdir, tokens, plan, root


def train_args(setup, out: Path, *extra) -> list:
    qdir, tokens, plan, _ = setup
    return ["train", "--model", qdir, "--data", tokens, "--plan", plan, "--out", out, *extra]


@pytest.fixture(scope="module")
def two_rank_run(setup):
    """A 2-rank RigL run (microbatch 1, checkpoints every 4 steps) and the matching one-process run."""
    root = setup[3]
    dp, single = root / "dp", root / "single"
    proc = torchrun(*train_args(setup, dp, *RIGL, "--microbatch", 1, "--save-every", 4))
    result = invoke(*train_args(setup, single, *RIGL, "--microbatch", 1, "--grad-accum", 2, "--save-every", 4))
    assert result.exit_code == 0, result.output
    code, _, stderr = finished(proc)
    assert code == 0, stderr
    assert "data parallel: 2 processes (gloo)" in stderr
    return dp, single


def test_two_ranks_equal_one_process_with_the_same_global_batch(two_rank_run, setup, tmp_path):
    dp, single = two_rank_run
    assert len(losses(dp)) == STEPS and losses(dp) == losses(single)
    assert_same_deltas(deltas(dp), deltas(single))
    summary = load_verified(dp, RunManifest).summary
    assert summary.world_size == 2 and len(summary.reselections) == 1 and summary.reselections[0].grown > 0
    assert summary.tokens == load_verified(single, RunManifest).summary.tokens
    # One flat buffer per step: the sparse values + routers (+ one presence flag per tensor), in fp32.
    counts = summary.expert_entries + summary.router_params
    records = [json.loads(line) for line in (dp / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    sent = {r["world"]["allreduce_bytes"] for r in records}
    tensors = len(deltas(dp)) // 6 + 1  # 6 entries per expert tensor in deltas.safetensors; 1 router
    assert sent == {4 * (counts + tensors)}, sent
    # Negative control: half the global batch (one process, microbatch 1) is a different run.
    half = tmp_path / "half"
    assert invoke(*train_args(setup, half, *RIGL, "--microbatch", 1, "--save-every", 0)).exit_code == 0
    assert losses(half)[0] != losses(dp)[0]


def test_only_rank_0_writes(two_rank_run):
    dp, single = two_rank_run
    assert files(dp) == files(single)
    lines = (dp / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len((single / "metrics.jsonl").read_text().splitlines())


def test_static_mask_two_ranks_equal_one_process_with_microbatch_2(setup, tmp_path):
    """Through ``usaf train --nproc 2`` (which launches torchrun itself)."""
    static = ("--steps", 6, "--reselect-every", 0, "--lr", 0.05, "--save-every", 0)
    dp, single = tmp_path / "dp", tmp_path / "single"
    command = [sys.executable, "-m", "usaf", *map(str, train_args(setup, dp, *static, "--microbatch", 1))]
    command += ["--nproc", "2"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert invoke(*train_args(setup, single, *static, "--microbatch", 2)).exit_code == 0
    code, _, stderr = finished(proc)
    assert code == 0, stderr
    assert load_verified(dp, RunManifest).summary.world_size == 2
    assert losses(dp) == pytest.approx(losses(single), abs=1e-5)
    assert_same_deltas(deltas(dp), deltas(single), atol=1e-5)


def test_nproc_reports_a_ranks_refusal_and_ctrl_c_as_usaf_does(setup, tmp_path):
    """usaf train --nproc 2 ran torchrun as a subprocess, which turned a rank's refusal and a Ctrl-C into its own
    traceback (ChildFailedError, SignalException) and exit 1 (found in review). Now: the rank's error line and
    exit 2, and "interrupted: saved" with exit 130, nothing else. The control of the success path is the test above."""
    from usaf.artifacts.lock import OutputLock

    def nproc(run: Path, *extra) -> subprocess.Popen:
        command = [sys.executable, "-m", "usaf", *map(str, train_args(setup, run, *extra)), "--nproc", "2"]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip

    locked = tmp_path / "locked"
    with OutputLock(locked):
        code, _, stderr = finished(nproc(locked, "--steps", 2))
    assert code == 2 and "another usaf process is writing it" in stderr, stderr
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr
    # said once, not once per rank (found in review; under a user's own torchrun each rank says it: the test of a
    # locked out below is the control)
    assert stderr.count("another usaf process is writing it") == 1, stderr

    run = tmp_path / "run"
    proc = nproc(run, "--steps", 300, "--microbatch", 1, "--save-every", 0)
    _wait_for(lambda: _logged_steps(run) >= 2, proc)
    os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the launcher and both ranks
    code, _, stderr = finished(proc)
    assert code == 130 and "interrupted: saved" in stderr, stderr
    assert "Traceback" not in stderr and "SignalException" not in stderr
    # as one process says it: what was saved, once, and not torchrun's log of the signal (found in review)
    assert stderr.count("interrupted: saved") == 1 and "death signal" not in stderr, stderr
    assert "nothing half-written" not in stderr, stderr  # said of what rank 0 saved, it read as contradicting it
    assert len(list((run / "checkpoints").iterdir())) == 1


def test_the_launcher_says_what_another_rank_said_that_no_lower_rank_did(tmp_path, monkeypatch):
    """What the ranks of --nproc said: rank 0 printed its own; a line of rank 1 the same as rank 0's is not said
    again, one of its own is, under its rank, and so is every line where rank 0 said nothing (killed)."""
    from usaf.cli import rank_errors

    monkeypatch.setenv(rank_errors.ERRORS_ENV, str(tmp_path))
    stopped = ("stopped", "interrupted: nothing half-written was left behind", None)
    for rank, lines in {0: [("error", "--plan x: no such directory", "check the path")],
                        1: [("error", "--plan x: no such directory", "check the path")],
                        2: [("error", "out of memory", "lower --microbatch")],
                        3: [("error", "out of memory", "lower --microbatch")],  # rank 2 said it
                        10: [stopped]}.items():  # fmt: skip
        monkeypatch.setenv("RANK", str(rank))
        for kind, text, hint in lines:
            assert rank_errors.record(kind, text, hint) is (rank == 0)  # rank 0 prints its own as it happens
    with open(tmp_path / "rank-3.jsonl", "a") as f:
        f.write('["error", "cut sho')  # a rank killed as it wrote
    said = []
    rank_errors.say_distinct(tmp_path, lambda rank, line: said.append((rank, line)))
    assert said == [(2, ("error", "out of memory", "lower --microbatch")), (10, stopped)]
    (tmp_path / "rank-0.jsonl").unlink()  # rank 0 killed before it said anything: rank 1's line is said
    said.clear()
    rank_errors.say_distinct(tmp_path, lambda rank, line: said.append((rank, line)))
    assert said[0] == (1, ("error", "--plan x: no such directory", "check the path")) and len(said) == 3
    monkeypatch.delenv(rank_errors.ERRORS_ENV)  # control: no launcher collecting (a user's torchrun): each prints
    assert rank_errors.record("error", "x") is True


def test_nproc_status_is_the_failing_ranks_not_the_one_the_launcher_stopped():
    """CI: rank 1 refused (2) and torchrun's SIGTERM reached rank 0 as it left with the same refusal; the command said
    143, the stopped rank's status, because it was the lowest failed rank."""
    from usaf.cli.stage import failed_status

    term, kill = int(signal.SIGTERM), int(signal.SIGKILL)
    assert failed_status({0: -term, 1: 2}) == 2
    assert failed_status({0: 128 + term, 1: 2}) == 2  # stopped at a boundary by its own handler: the same
    assert failed_status({0: -kill, 1: 1}) == 128 + kill  # killed: the cause (usaf's ranks leave on SIGTERM, so the
    assert failed_status({0: 2, 1: -kill}) == 128 + kill  # launcher's SIGKILL never comes; the other lost its peer)
    assert failed_status({0: 2, 1: 3}) == 2  # both on their own: the lowest rank's
    assert failed_status({0: -term, 1: -term}) == 128 + term  # control: all stopped, and the status says so
    assert failed_status({1: -int(signal.SIGSEGV)}) == 128 + int(signal.SIGSEGV)
    assert failed_status({1: -kill, 0: -term}) == 128 + kill  # killed from outside, the other stopped by the launcher
    assert failed_status({0: -kill, 1: -kill}) == 128 + kill
    assert failed_status({0: 128 + term, 1: 1}) == 1  # an error on its own, the other stopped at a boundary


def test_a_rank_killed_by_a_signal_is_said_and_a_stop_is_not():
    from usaf.cli.stage import killed_lines

    term, kill = int(signal.SIGTERM), int(signal.SIGKILL)
    ((rank, message, hint),) = killed_lines({1: -kill, 0: -term})
    assert rank == 1 and message.startswith("rank 1 was killed by SIGKILL (the system's out-of-memory killer")
    assert "resume" in hint
    assert [r for r, _, _ in killed_lines({1: -kill, 0: 1})] == [1]  # the other rank left first, on its own
    assert killed_lines({0: -int(signal.SIGSEGV)})[0][1] == "rank 0 was killed by SIGSEGV"
    # controls: a stop every rank says itself, a refusal, the launcher's own stop
    assert killed_lines({0: -term, 1: -term}) == killed_lines({0: -term, 1: 2}) == killed_lines({-1: 130}) == []


def _cut_back_to(run: Path, copy: Path, step: int) -> Path:
    """``run`` as it was when the checkpoint of ``step`` had just been written (as if killed there)."""
    shutil.copytree(run, copy)
    for later in (copy / "final", copy / "manifest.json"):
        shutil.rmtree(later) if later.is_dir() else later.unlink()
    for checkpoint in (copy / "checkpoints").iterdir():
        if int(checkpoint.name.split("-")[1]) > step:
            shutil.rmtree(checkpoint)
    kept = [line for line in (copy / "metrics.jsonl").read_text().splitlines() if _record_step(line) <= step]
    (copy / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    return copy


def _record_step(line: str) -> int:
    record = json.loads(line)
    return record["step"] if "step" in record else record["reselection"]["step"]


def test_resume_inside_a_scoring_window_is_exact_with_2_ranks_and_with_1(two_rank_run, setup, tmp_path):
    """Step 4 lies in the window (steps 2-5) whose grow scores pick the reselection at step 5: the
    checkpoint holds each rank's partial scores. Resumed by 2 ranks each takes its own, bit for bit; resumed by one
    process (microbatch 1 × grad-accum 2: the same global batch) rank 0 takes them merged, equal to fp32 rounding
    (the same sums in another order), and says so."""
    dp, _ = two_rank_run
    state = torch.load(dp / "checkpoints" / "step-0000004" / "optimizer.pt", weights_only=True)
    assert len(state["scores_by_rank"]) == 2  # negative control: the window really is open at step 4
    again = _cut_back_to(dp, tmp_path / "again", 4)
    code, _, stderr = finished(torchrun(*train_args(setup, again, *RIGL, "--microbatch", 1, "--save-every", 4)))
    assert code == 0 and "resuming from" in stderr and "resumed on" not in stderr, stderr
    assert losses(again) == losses(dp)
    assert_same_deltas(deltas(again), deltas(dp))

    alone = _cut_back_to(dp, tmp_path / "alone", 4)
    result = invoke(*train_args(setup, alone, *RIGL, "--microbatch", 1, "--grad-accum", 2, "--save-every", 4))
    assert result.exit_code == 0 and "resuming from" in result.stderr, result.output
    # not bit for bit, and said so (README called it exact; found in review)
    assert "resumed on 1 process, the run trained on 2 until now" in " ".join(result.stderr.split())
    assert losses(alone) == pytest.approx(losses(dp), abs=1e-6)
    assert_same_deltas(deltas(alone), deltas(dp), atol=1e-6)
    assert load_verified(alone, RunManifest).summary.world_size == 1

    other = _cut_back_to(dp, tmp_path / "other-batch", 4)
    result = invoke(*train_args(setup, other, *RIGL, "--microbatch", 1, "--save-every", 4))  # global batch 1, not 2
    assert result.exit_code == 2 and "holds another run" in result.stderr


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def _logged_steps(run: Path) -> int:
    log = run / "metrics.jsonl"
    return len([line for line in log.read_text().splitlines() if '"loss"' in line]) if log.is_file() else 0


@pytest.mark.parametrize("how", ["Ctrl-C to the group", "SIGTERM to torchrun"])
def test_ctrl_c_stops_every_rank_at_one_step_and_the_rerun_resumes(setup, tmp_path, how):
    """A terminal's Ctrl-C reaches every rank; a scheduler's or a container stop's SIGTERM reaches torchrun,
    which forwards it to the ranks: either way one checkpoint at one step boundary, then a resumable rerun."""
    run = tmp_path / "run"
    args = train_args(setup, run, "--steps", 300, "--microbatch", 1, "--save-every", 0)
    proc = torchrun(*args, start_new_session=True)  # its own process group: a terminal's Ctrl-C reaches all
    _wait_for(lambda: _logged_steps(run) >= 3, proc)
    if how == "SIGTERM to torchrun":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    code, _, stderr = finished(proc)
    assert code != 0 and "interrupted: saved" in stderr, stderr
    (checkpoint,) = list((run / "checkpoints").iterdir())
    step = int(checkpoint.name.split("-")[1])
    assert step == _logged_steps(run) and 0 < step < 300
    code, _, stderr = finished(torchrun(*args))
    assert code == 0 and f"(step {step} of 300)" in stderr, stderr
    assert load_verified(run, RunManifest).summary.steps == 300 and _logged_steps(run) == 300


def test_without_out_the_ranks_resume_the_unfinished_run_rank_0_finds(setup, tmp_path):
    """Without --out, rank 0 names the run directory (or finds the unfinished one) and every rank takes its answer:
    a one-process run stopped at step 2 (microbatch 2) is resumed by 2 ranks (microbatch 1, the same global batch)
    in the same directory, and no second one appears."""
    from helpers import ctrl_c_at_step

    qdir, tokens, plan, _ = setup
    common = ["train", "--workspace", tmp_path, "--model", qdir, "--data", tokens, "--plan", plan, "--steps", 4,
              "--save-every", 0, "--lr", 0.05]  # fmt: skip
    with ctrl_c_at_step(2):
        assert invoke(*common, "--microbatch", 2).exit_code == 130
    (run,) = (tmp_path / "run").iterdir()
    code, _, stderr = finished(torchrun(*common, "--microbatch", 1))
    assert code == 0, stderr
    assert f"resuming the unfinished run {run}" in stderr and "(step 2 of 4)" in stderr
    assert list((tmp_path / "run").iterdir()) == [run] and (run / "manifest.json").is_file()

def test_a_dying_rank_ends_the_run_with_a_message_and_keeps_the_last_checkpoint(setup, tmp_path):
    run = tmp_path / "run"
    proc = torchrun(*train_args(setup, run, "--steps", 400, "--microbatch", 1, "--save-every", 5))
    _wait_for(lambda: (run / "checkpoints" / "step-0000005").is_dir(), proc)
    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
    assert len(ranks) == 1
    ranks[0].kill()
    code, _, stderr = finished(proc)
    assert code != 0
    assert "another process of the run stopped" in stderr and "newest complete checkpoint is" in stderr, stderr
    assert not (run / "manifest.json").exists()
    checkpoints = sorted((run / "checkpoints").iterdir())
    assert checkpoints and not [c for c in checkpoints if c.name.endswith(".tmp")]
    last = int(checkpoints[-1].name.split("-")[1])
    # The checkpoint is intact: one process with the same global batch (microbatch 2) resumes from it.
    result = invoke(*train_args(setup, run, "--steps", 400, "--microbatch", 2, "--save-every", 5))
    assert result.exit_code == 0 and f"(step {last} of 400)" in result.stderr, result.output


def test_a_locked_out_is_one_refusal_on_every_rank(setup, tmp_path):
    """Only rank 0 took the run directory's lock: when another process held it, rank 1 waited at the next barrier for
    a rank 0 that had left and reported "another process of the run stopped or the network broke", with a hint to
    rerun and resume (found in review). Now every rank raises rank 0's refusal."""
    from usaf.artifacts.lock import OutputLock

    run = tmp_path / "run"
    with OutputLock(run):  # another usaf process writing it
        code, _, stderr = finished(torchrun(*train_args(setup, run, "--steps", 2)))
    assert code != 0
    assert stderr.count("another usaf process is writing it") == 2, stderr
    assert "another process of the run stopped" not in stderr and not run.exists()


def test_ranks_that_resolved_other_data_are_refused(setup, tmp_path):
    """Each rank resolves --data on its own: rank 1 given other tokens (here by USAF_DATA, as a workspace per node or
    a tokenize finished between the ranks' lookups would) trained rank 0's record on mixed data in silence (found in
    review). Control: the same data on both ranks trains (two_rank_run)."""
    qdir, tokens, plan, _ = setup
    other = tmp_path / "other"
    made = invoke("tokenize", stdlib_dir() / "glob.py", "--model", qdir, "--seq-len", 32, "--out", other)
    assert made.exit_code == 0, made.output
    wrapper = tmp_path / "rank.sh"
    wrapper.write_text(f'if [ "$RANK" = 1 ]; then export USAF_DATA={other}; else export USAF_DATA={tokens}; fi\n'
                       f'exec {sys.executable} -m usaf "$@"\n')  # fmt: skip
    run = tmp_path / "run"
    args = ["train", "--model", qdir, "--plan", plan, "--out", run, "--steps", 2, "--lr", 0.05, "--reselect-every", 0]
    code, _, stderr = finished(torchrun(*args, entry=("--no-python", "bash", wrapper)))
    assert code != 0 and stderr.count("rank 1 resolved other inputs than rank 0 (--data)") == 2, stderr
    assert not (run / "manifest.json").exists()


def test_score_with_two_ranks_equals_one_process(prepared, tmp_path):
    """Pools as large as the tensors (a candidates factor of 64 at frac 0.05): merging is exact."""
    qdir, tokens, _ = prepared("qwen3_moe")
    args = ("score", "--model", qdir, "--data", tokens, "--frac", 0.05, "--calib-samples", 8, "--microbatch", 2,
            "--train-from", 2, "--candidates-factor", 64, "--cache", "--targets", "experts,attention")  # fmt: skip
    proc = torchrun(*args, "--out", tmp_path / "dp")
    assert invoke(*args, "--out", tmp_path / "single").exit_code == 0
    code, stdout, stderr = finished(proc)
    assert code == 0, stderr
    assert stdout.count("plan →") <= 1  # rank 0 alone reports
    dp, single = (load_verified(tmp_path / name, PlanManifest) for name in ("dp", "single"))
    a, b = (load_file(str(tmp_path / name / "masks.safetensors")) for name in ("dp", "single"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert dp.summary.stability_mean == pytest.approx(single.summary.stability_mean)
    assert [r.tokens_per_expert for r in dp.summary.routing] == [r.tokens_per_expert for r in single.summary.routing]
    assert dp.summary.prefix_cache.samples == single.summary.prefix_cache.samples > 0


STOP_CHILD = Path(__file__).parent / "stop_child.py"
# 8 calibration microbatches (2 halves of 4 sequences, microbatch 1): 4 rounds of 2 ranks; then 4 probes of 3 steps
SCORE_RESUMED = ("--frac", 0.05, "--calib-samples", 8, "--microbatch", 1, "--train-from", 2, "--lr-test",
                 "--lr-test-steps", 3, "--targets", "experts,attention")  # fmt: skip


def score_args(prepared, *extra) -> list:
    qdir, tokens, _ = prepared("qwen3_moe")
    return ["score", "--model", qdir, "--data", tokens, *SCORE_RESUMED, *extra]


def partial(out: Path) -> Path:
    return out.parent / f".{out.name}.usaf-partial"


@pytest.fixture(scope="module")
def straight_two_rank_plan(prepared, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dp-score") / "plan"
    code, _, stderr = finished(torchrun(*score_args(prepared, "--out", out)))
    assert code == 0, stderr
    return out


@pytest.mark.parametrize(
    "rank, at, lost, resumed",
    [
        (1, 3, False, "4 of 8 calibration batches done"),
        (1, 3, True, "2 of 8 calibration batches done"),
        (0, 9, False, "lr test: 1 of 4 probes done by the interrupted run"),
    ],
    ids=["in-the-pass", "in-the-pass-rank-1-share-lost", "in-the-lr-test"],
)
def test_score_stopped_on_one_rank_stops_every_rank_and_resumes_to_the_same_plan(
    prepared, straight_two_rank_plan, tmp_path, rank, at, lost, resumed
):
    """One rank alone gets the stop request: rank 1 at its 3rd check, before the pass's third round (rank 0 stops
    with it at the same check), or rank 0, which runs the lr test while rank 1 waits, at its 9th, in the second
    probe. Each rank saves its own share of the pass, and the same command resumes each share to the plan an
    uninterrupted 2-rank run writes, byte for byte. With rank 1's file gone (a kill before it was written) rank 1
    scores its whole share again while rank 0 resumes its own."""
    out = tmp_path / "plan"
    code, _, stderr = finished(torchrun(*score_args(prepared, "--out", out), entry=(STOP_CHILD, rank, at)))
    assert code != 0 and "interrupted: saved the calibration pass" in stderr, stderr
    assert "another process of the run stopped" not in stderr  # every rank stopped on the request, none lost a peer
    assert (partial(out) / CALIBRATION).is_file() and (partial(out) / RANK_CALIBRATION.format(1)).is_file()
    assert not out.exists()
    if lost:
        (partial(out) / RANK_CALIBRATION.format(1)).unlink()
    code, _, stderr = finished(torchrun(*score_args(prepared, "--out", out)))
    assert code == 0 and resumed in stderr, stderr
    same_plan(out, straight_two_rank_plan)
    assert not partial(out).exists()


def test_a_score_stopped_under_torchrun_resumes_only_with_as_many_processes(prepared, tmp_path):
    """Each rank saved its own share of the pass: one process is refused, naming the difference; --overwrite
    discards the work and scores afresh."""
    out = tmp_path / "plan"
    code, _, stderr = finished(torchrun(*score_args(prepared, "--out", out), entry=(STOP_CHILD, 0, 2)))
    assert code != 0 and "interrupted: saved the calibration pass (2 of 8 batches)" in stderr, stderr
    refused = invoke(*score_args(prepared, "--out", out))
    assert refused.exit_code == 2 and "2 processes there, 1 now" in refused.output, refused.output
    assert (partial(out) / RANK_CALIBRATION.format(1)).is_file()  # refused: nothing touched
    replaced = invoke(*score_args(prepared, "--out", out, "--overwrite"))
    assert replaced.exit_code == 0 and "discarding the interrupted score's work" in replaced.output, replaced.output
    assert not partial(out).exists() and load_verified(out, PlanManifest).summary.calib_samples == 8


def test_train_stopped_while_scoring_its_plan_under_torchrun_resumes_the_score(prepared, tmp_path):
    """``usaf train`` with no plan scores one into RUN/plan: a stop there under torchrun saves each rank's share, and
    the same command resumes that score, then trains."""
    qdir, tokens, _ = prepared("qwen3_moe")
    run = tmp_path / "run"
    args = ["train", "--model", qdir, "--data", tokens, "--workspace", tmp_path / "ws", "--out", run, "--steps", 2,
            "--microbatch", 1, "--calib-samples", 8, "--train-from", 2, "--save-every", 0]  # fmt: skip
    code, _, stderr = finished(torchrun(*args, entry=(STOP_CHILD, 1, 2)))
    assert code != 0 and "interrupted: saved the calibration pass (2 of 8 batches)" in stderr, stderr
    assert (partial(run / "plan") / RANK_CALIBRATION.format(1)).is_file()
    code, _, stderr = finished(torchrun(*args))
    assert code == 0 and "2 of 8 calibration batches done" in stderr, stderr
    assert load_verified(run, RunManifest).summary.steps == 2 and not partial(run / "plan").exists()


def test_doctor_under_torchrun_checks_the_group(tmp_path):
    code, stdout, stderr = finished(torchrun("doctor", "--json"))
    assert code == 0, stderr
    info = json.loads(stdout)["distributed"]  # one report: rank 0's
    assert info["launched"] and info["backend"] == "gloo" and info["check"]["ok"]
    assert [r["rank"] for r in info["ranks"]] == [0, 1]


def test_a_bad_dist_timeout_is_one_clear_error():
    """USAF_DIST_TIMEOUT_MIN=abc was a ValueError traceback on every rank, and 0 a "could not join" after 0 ms (found
    in review). Controls: unset is the default, a positive number is taken."""
    from usaf.distributed import DEFAULT_TIMEOUT_MIN, TIMEOUT_ENV, _timeout_minutes
    from usaf.errors import UsafError

    for bad in ("abc", "0", "-5", "inf", "nan"):
        with pytest.raises(UsafError, match=f"{TIMEOUT_ENV}='{bad}': not a positive number of minutes"):
            _timeout_minutes({TIMEOUT_ENV: bad})
    assert _timeout_minutes({}) == _timeout_minutes({TIMEOUT_ENV: ""}) == DEFAULT_TIMEOUT_MIN
    assert _timeout_minutes({TIMEOUT_ENV: "2.5"}) == 2.5


def test_world_helpers_in_one_process():
    from usaf.cli.stage import _without_option
    from usaf.distributed import World, choose_backend, device_for_rank, launched, shard

    assert choose_backend(None, "cuda") == "nccl" and choose_backend("auto", "cpu") == "gloo"
    assert choose_backend("gloo", "cuda") == "gloo"
    assert not launched({}) and launched({"WORLD_SIZE": "2"})
    assert device_for_rank("cpu", {"WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == "cpu"
    assert shard(list(range(7)), World(rank=1, size=3)) == [1, 4]
    w = World()
    t = torch.ones(3, requires_grad=True)
    t.grad = torch.full((3,), 2.0)
    assert w.sum_gradients([t]) == 0 and torch.equal(t.grad, torch.full((3,), 2.0))  # no-op in one process
    assert _without_option(["train", "--nproc", "2", "--steps", "3", "--nproc=4"], "--nproc") == [
        "train", "--steps", "3"]  # fmt: skip


def test_decided_by_main_gives_every_rank_rank_0s_result_refusal_or_stop(monkeypatch):
    """What rank 0 decides reaches every rank: its result, its UsafError, its stop request (the gather is stood in
    for: rank 0's outcome first, as all_gather_object orders them)."""
    import signal as signals

    from usaf.distributed import World
    from usaf.errors import StopSignal, UsafError

    sent = []

    def gather(self, obj, what="all-gather"):
        sent.append(obj)
        return [outcome, obj]

    monkeypatch.setattr(World, "gather_objects", gather)
    main, other = World(rank=0, size=2), World(rank=1, size=2)
    outcome = ("decided", 7)
    assert main.decided_by_main(lambda: 7, "x") == 7 and other.decided_by_main(lambda: 1 / 0, "x") == 7
    outcome = ("refused", ("--out X: taken", "pick another"))
    with pytest.raises(UsafError, match="taken") as refused:
        other.decided_by_main(lambda: 1 / 0, "x")  # never run on rank 1
    assert refused.value.hint == "pick another"

    def refuse():
        raise UsafError("--out X: taken", "pick another")

    with pytest.raises(UsafError):
        main.decided_by_main(refuse, "x")
    assert sent[-1] == outcome  # rank 0 told the others before raising
    outcome = ("stopped", signals.SIGTERM)
    with pytest.raises(StopSignal) as stopped:
        other.decided_by_main(lambda: 1 / 0, "x")
    assert stopped.value.exit_code == 143
    assert World().decided_by_main(lambda: "alone", "x") == "alone"  # one process: no gather


def test_a_clean_end_meets_the_other_ranks_before_leaving_and_an_error_does_not(monkeypatch):
    """``shutdown``: after a command that ended cleanly every rank meets at a barrier before destroying the process
    group (gloo aborted a rank whose peer left first); after an error it leaves at once (the others may never come:
    the control). A peer already gone at the barrier still leaves."""
    from usaf import distributed

    calls = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: calls.append("destroy"))
    for clean, expected in ((True, ["barrier", "destroy"]), (False, ["destroy"])):
        calls.clear()
        monkeypatch.setattr(distributed, "_WORLD", distributed.World(rank=1, size=2, backend="gloo"))
        distributed.shutdown(clean=clean)
        assert calls == expected and not distributed.world().active, clean

    def lost():
        raise RuntimeError("Connection closed by peer")

    calls.clear()
    monkeypatch.setattr(torch.distributed, "barrier", lost)
    monkeypatch.setattr(distributed, "_WORLD", distributed.World(rank=1, size=2, backend="gloo"))
    distributed.shutdown()
    assert calls == ["destroy"] and not distributed.world().active


def test_a_command_that_fails_leaves_without_waiting(monkeypatch):
    """The CLI's process-group context: a clean end asks for the barrier, an exception (an error, Ctrl-C) does not."""
    from usaf import distributed
    from usaf.cli.stage import _process_group

    seen = []
    monkeypatch.setattr(distributed, "shutdown", lambda *, clean: seen.append(clean))
    with _process_group():
        pass
    with pytest.raises(KeyboardInterrupt), _process_group():
        raise KeyboardInterrupt
    assert seen == [True, False]


_LAUNCHER = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c",
    "import time; from usaf.distributed import stop_with_launcher; stop_with_launcher(); print('ready', flush=True); "
    "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
assert rank.stdout.readline().strip() == "ready"
print(rank.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_rank_stops_when_its_launcher_is_killed():
    """kill -9 of ``usaf train --nproc 2`` left both ranks training as orphans, holding the run's lock (found in
    review). A rank now gets SIGTERM when its launcher dies. The control: with the launcher alive, it runs on."""
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE, text=True)
    rank = int(launcher.stdout.readline())
    time.sleep(1)
    os.kill(rank, 0)  # the control: alive while its launcher is
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.kill(rank, 0)
        except ProcessLookupError:
            return  # gone (reaped by init)
        with open(f"/proc/{rank}/stat") as stat:
            if stat.read().split()[2] == "Z":
                return  # ended, not yet reaped
        time.sleep(0.2)
    os.kill(rank, signal.SIGKILL)
    raise AssertionError("the rank outlived its launcher")


def test_nproc_names_a_rank_killed_from_outside(setup, tmp_path):
    """A rank of ``usaf train --nproc 2`` killed from outside (SIGKILL: the out-of-memory killer's): the command
    named no rank and no signal, and the other rank's "stopped by SIGTERM" read as if the user had stopped it."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "usaf", *map(str, train_args(setup, run, "--steps", 300, "--microbatch", 1,
                                                               "--save-every", 5)), "--nproc", "2"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    _wait_for(lambda: (run / "checkpoints" / "step-0000005").is_dir(), proc)
    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
    assert len(ranks) == 1
    ranks[0].kill()
    code, _, stderr = finished(proc)
    # the killed rank's status, whether the other rank lost its peer first (exit 2) or the launcher stopped it
    assert code == 128 + int(signal.SIGKILL), stderr
    said = " ".join(stderr.split())
    assert said.count("rank 1 was killed by SIGKILL (the system's out-of-memory killer sends SIGKILL") == 1, said
