"""Shared fixtures: tiny MoE models built once per test session and reused across test modules."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

# usaf score's lr test (64 probe steps) would add seconds to every one of the suite's ~60 scorings; it is tested in
# tests/test_lr_test.py (and usaf demo's tests), which turn it on explicitly. USAF_LR_TEST=true runs the suite with it.
os.environ.setdefault("USAF_LR_TEST", "false")

# One torch thread count for the whole suite, in this process and every usaf subprocess it starts: the CPU backend
# lowers the count on a busy machine (usaf.backends.cpu.choose_threads) unless OMP_NUM_THREADS is set, and the
# exactness tests compare runs across processes. tests/test_threads.py tests the choice itself.
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # torch's own default, read before the variable

# The suite tests how usaf meets signals sent to it in a terminal: Ctrl-C, a closed terminal's SIGHUP. A suite started
# in the background of a script (SIGINT ignored) or under nohup (SIGHUP ignored) passes those dispositions on to every
# usaf it starts, which keeps them ignored, as it should (usaf.errors.take_signals; tested with the signal ignored on
# purpose): so the suite puts back the terminal's.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)

# The families with their own file, plus two structural-fallback types: glm4_moe (DeepSeek-like
# routing with shared experts) and phimoe (Mixtral-like on-disk names renamed by transformers).
FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss")
FALLBACK_TYPES = ("glm4_moe", "phimoe")


def _transformers_major() -> int:
    from usaf.families.modules import transformers_major

    return transformers_major()


# The second CI environment runs a subset with transformers 4.57 (the DirectML configuration).
TRANSFORMERS_V5 = _transformers_major() >= 5
needs_v5 = pytest.mark.skipif(
    not TRANSFORMERS_V5, reason="checks transformers >= 5's fused experts modules; 4.x holds per-expert MLPs"
)
V5_ONLY_TYPES = FALLBACK_TYPES  # the structural fallback reads v5's fused experts


# Written by the tools, not by usaf: a test's output belongs in its tmp_path, never in the directory pytest runs in.
_RUN_DIRECTORY_LITTER_OK = {".pytest_cache", ".hypothesis", "__pycache__", ".ruff_cache"}


@pytest.fixture(scope="session", autouse=True)
def nothing_written_where_pytest_runs():
    """Fails the session's last test if the suite left something new in the working directory (a command run
    without --out or --workspace writes into the default workspace, "."; one did: test_outputs.py's eval's cache)."""
    here = Path.cwd()
    before = {p.name for p in here.iterdir()}
    yield
    new = sorted(p.name for p in here.iterdir() if p.name not in before and p.name not in _RUN_DIRECTORY_LITTER_OK)
    assert not new, f"the tests wrote {new} into {here}: give the command an --out or --workspace under tmp_path"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(family, **build_kwargs) -> Path``: built on first request, then cached."""
    from usaf.testing import build_tiny_model

    cache: dict[tuple, Path] = {}
    root = tmp_path_factory.mktemp("tiny-models")

    def get(family: str, **kwargs) -> Path:
        if not TRANSFORMERS_V5 and (family in V5_ONLY_TYPES or kwargs.get("layout") == "fused"):
            pytest.skip(f"{family} {kwargs}: needs transformers >= 5 (structural fallback / fused save)")
        kwargs.setdefault("tokenizer", False)
        key = (family, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in cache:
            cache[key] = build_tiny_model(family, root / f"{family}-{len(cache)}", **kwargs)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def loaded_model(tiny_model):
    """``loaded_model(family, **build_kwargs)``: ``AutoModelForCausalLM.from_pretrained`` of the tiny model (cached)."""
    from transformers import AutoModelForCausalLM

    cache: dict[Path, torch.nn.Module] = {}

    def get(family: str, **kwargs):
        path = tiny_model(family, **kwargs)
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path).eval()
        return cache[path]

    return get


@pytest.fixture(scope="session")
def model_state(tiny_model, loaded_model):
    """``model_state(family, **build_kwargs)``: the loaded model's state_dict in usaf's names.

    On transformers >= 5 that is ``state_dict()``; on 4.x per-expert weights appear as the fused tensors.
    """
    from usaf.families import load_model_config, resolve_family
    from usaf.families.modules import usaf_state_dict

    def get(family: str, **kwargs):
        spec = resolve_family(load_model_config(tiny_model(family, **kwargs)))
        return usaf_state_dict(loaded_model(family, **kwargs), spec)

    return get


@pytest.fixture(scope="session")
def quantized(tiny_model, tmp_path_factory):
    """``quantized(family, **build_kwargs) -> Path`` of an RTN 4-bit quantization (cached)."""
    from usaf.stages.quantize import QuantizeConfig
    from usaf.stages.quantize import run as quantize

    cache = {}
    root = tmp_path_factory.mktemp("quantized")

    def get(family: str, **kwargs):
        key = (family, tuple(sorted(kwargs.items())))
        if key not in cache:
            source = tiny_model(family, **kwargs)
            _, cache[key] = quantize(
                QuantizeConfig(model=str(source), out=root / f"{family}-{len(cache)}", method="rtn", group_size=8)
            )
        return cache[key]

    return get


@pytest.fixture(scope="session")
def prepared(quantized, tmp_path_factory):
    """``prepared(family) -> (qdir, tokens, plan)``: a 3-layer model, tokens and a plan (frac 0.05, scored on the
    CPU, so that tests of other stages on another device do not depend on scoring there). A failure is kept: every
    later request fails with the first one's message instead of tripping over what it half made."""
    cache: dict[str, tuple[Path, Path, Path] | str] = {}
    root = tmp_path_factory.mktemp("train")

    def get(family: str):
        if family not in cache:
            try:
                cache[family] = _prepare(family, quantized, root)
            except AssertionError as e:
                cache[family] = f"preparing {family} failed: {e}"
        if isinstance(cache[family], str):
            pytest.fail(cache[family])
        return cache[family]

    return get


def _prepare(family: str, quantized, root: Path) -> tuple[Path, Path, Path]:
    from helpers import explain, invoke
    from usaf.testing import stdlib_dir

    qdir = quantized(family, num_layers=3, tokenizer=True)
    tokens, plan = root / f"{family}-tokens", root / f"{family}-plan"
    result = invoke("tokenize", stdlib_dir() / "textwrap.py", stdlib_dir() / "shlex.py", "--model", qdir,
                    "--seq-len", 32, "--held-out", "shlex.py", "--out", tokens)  # fmt: skip
    assert result.exit_code == 0, explain(result)
    result = invoke("score", "--model", qdir, "--data", tokens, "--frac", 0.05, "--calib-samples", 8,
                    "--train-from", 2, "--no-stability", "--device", "cpu", "--out", plan)  # fmt: skip
    assert result.exit_code == 0, explain(result)
    return qdir, tokens, plan


@pytest.fixture(scope="session")
def bench(tmp_path_factory):
    """The hostile catalogues' valid inputs (usaf.testing.hostile.Bench): every case copies what it breaks."""
    from usaf.testing import hostile

    return hostile.Bench.build(tmp_path_factory.mktemp("hostile-bench"))
