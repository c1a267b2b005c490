"""The seams of docs/ARCHITECTURE.md, enforced: each rule reads the source (AST and text only, no imports) and
fails with every offending ``file:line``.

Rules:

- **layers**: a module may import only modules of a *lower* layer, at any depth (module top and inside
  functions). Same-layer packages may not import each other, except the pairs in ``SAME_LAYER``. Layers,
  top to bottom::

      9  usaf.__main__, the harnesses of usaf.testing (crash, crash_child, crash_stages, hostile, hostile_*,
         workloads)
      8  usaf.cli
      7  usaf.stages
      6  usaf.distributed
      5  usaf.engine, usaf.memory_plan, usaf.testing.faults (a disk that refuses a write)
      4  usaf.data, usaf.families, usaf.quant, usaf.demo
      3  usaf.artifacts, usaf.backends, usaf.testing (the model and tokenizer builders, rss)
      2  usaf.settings
      1  usaf (the package), usaf.config
      0  usaf.errors, usaf.units, usaf._version

  Why there: ``errors``, ``units`` and ``_version`` import nothing of usaf's and everybody uses them; ``config``
  (settings precedence) needs only ``errors``. ``settings`` (every command's settings models) is imported by ``cli``
  at ``usaf --help`` time, by the stages and by ``memory_plan.config``: it may build only on ``config``, which
  keeps it free of torch (``tests/test_cli.py`` checks that too). ``distributed`` (the torchrun ``World``) is used by
  stages and by ``usaf doctor``, and merges the engine's grow scores. ``demo`` is packaged data (the demo
  model, the stdlib domains), built with the tokenizer of ``usaf.testing``. The builders of ``usaf.testing``
  (tiny models, the stdlib tokenizer) depend on nothing of usaf's but ``errors``, so ``usaf tiny-model`` and
  the demo can use them; its harnesses drive stages and the CLI in-process exactly as tests do, so they sit
  above the CLI like ``tests/``. Nothing imports ``usaf.cli`` but ``usaf.__main__`` and those harnesses.
- **device**: no device-specific call outside ``usaf/backends/``: ``torch.cuda.*``, ``torch.mps.*``,
  ``torch_directml``, or a branch on a device's type (``device.type == "cuda"``, ``x.type in ("cpu", ...)``).
  Code asks its ``Backend`` or ``usaf.backends.transfer`` instead.
- **hf-names**: no Hugging Face module or class name outside ``usaf/families/`` (attribute access like
  ``layer.self_attn``, strings like ``"mlp.experts"`` or ``"model.layers.3..."`` parsed by hand, class names
  like ``Qwen3MoeForCausalLM``); docstrings, comments and ``description=``/``help=`` texts aside. Modules and
  tensors are reached through the families API (``FamilySpec``'s names, ``usaf.families.modules``).
  Not covered: ``model.model.layers`` (the decoder stack's attribute is too common a word to tell apart).
- **test-imports**: no test module imports another test module (``tests/*.py`` other than ``helpers*.py``
  and ``conftest.py``); shared code lives in ``tests/helpers*.py`` or conftest fixtures.
- **lazy-import**: an import inside a function in ``src/usaf`` says why it is there, with a ``# lazy: reason``
  comment on its line or on the comment/import lines right above it (an import cycle, an optional dependency,
  keeping ``usaf --help`` or a light module free of torch). Anything else goes to the module's top, where the
  dependency graph can be read. ``usaf/cli/`` is exempt as a whole (``LAZY_BY_DESIGN``: ``usaf --help`` imports it
  all).

``ALLOWED`` lists (file, rule) pairs that are known violations in files other changes are rewriting in
parallel; each entry is exempt from that one rule only. Prune it as those files are fixed.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
TESTS = ROOT / "tests"

# Longest dotted prefix wins. Imports within one unit (the same prefix) are always allowed.
LAYERS: dict[str, int] = {
    "usaf.__main__": 9,
    "usaf.testing.crash": 9,
    "usaf.testing.crash_child": 9,
    "usaf.testing.crash_stages": 9,
    "usaf.testing.hostile": 9,
    "usaf.testing.workloads": 9,
    "usaf.cli": 8,
    "usaf.stages": 7,
    "usaf.distributed": 6,
    "usaf.engine": 5,
    "usaf.memory_plan": 5,
    "usaf.testing.faults": 5,  # patches the writers of usaf.quant and the libraries; the harnesses use it
    "usaf.testing.dispatch": 4,  # tells host from device through usaf.backends
    "usaf.data": 4,
    "usaf.families": 4,
    "usaf.quant": 4,
    "usaf.demo": 4,
    "usaf.artifacts": 3,
    "usaf.backends": 3,
    "usaf.testing": 3,
    "usaf.settings": 2,
    "usaf": 1,
    "usaf.config": 1,
    "usaf.errors": 0,
    "usaf.units": 0,
    "usaf._version": 0,
}

# Same-layer imports with a reason (importer unit, imported unit).
SAME_LAYER: dict[tuple[str, str], str] = {
    # The tokenizer's chat-template handling differs between transformers 4 and 5; which transformers is
    # installed is the families' knowledge (usaf.families.modules.transformers_major).
    ("usaf.data", "usaf.families"): "transformers' major version",
    # The crash harness's export and eval stages extend its Stage and share its checks (crash.py stays small).
    ("usaf.testing.crash_stages", "usaf.testing.crash"): "the harness's Stage and checks",
}

# Known violations in files being rewritten in parallel (issue 18's other areas). (file, rule) -> why kept.
ALLOWED: dict[tuple[str, str], str] = {}

# Packages exempt from the lazy-import rule as a whole, the reason said once here rather than on each import.
LAZY_BY_DESIGN: dict[str, str] = {
    # `usaf --help` imports every cli module (the app registers each command) and loads nothing but typer:
    # rich, pydantic (usaf.config, usaf.settings), torch and the stages load inside the command that runs.
    # tests/test_cli.py and tests/test_doctor.py check the light import; cheap imports (stdlib, usaf.errors,
    # usaf.units) still sit at the modules' tops.
    "src/usaf/cli/": "`usaf --help` stays instant",
}

DEVICE_TYPES = {"cuda", "cpu", "mps", "privateuseone", "xpu"}
HF_MODULES = {
    "self_attn",
    "mlp",
    "block_sparse_moe",
    "gate_up_proj",
    "down_proj",
    "gate_up_proj_bias",
    "down_proj_bias",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "kv_b_proj",
    "kv_a_proj_with_mqa",
    "q_a_layernorm",
    "embed_tokens",
    "lm_head",
    "input_layernorm",
    "post_attention_layernorm",
    "shared_expert",
    "shared_experts",
    "shared_expert_gate",
}
HF_PATH = re.compile(r"(^|\.)layers\.")  # a tensor name parsed by hand ("model.layers.3...")
HF_CLASS = re.compile(r"\b(Qwen2Moe|Qwen3Moe|Mixtral|Olmoe|GptOss|DeepseekV3|Glm4Moe|PhiMoe)[A-Z]\w*")


@dataclass(frozen=True, order=True)
class Violation:
    path: str
    line: int
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.detail}"


# -- reading source ----------------------------------------------------------------------------------------


def module_name(path: str) -> str:
    """``src/usaf/engine/optim.py`` -> ``usaf.engine.optim`` (a package's ``__init__`` is the package)."""
    parts = list(Path(path).with_suffix("").parts)
    parts = parts[parts.index("usaf") :]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool) -> list[str]:
    """Absolute names of what one import statement imports (``from a import b`` counts as ``a.b``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = importer.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    return [f"{module}.{alias.name}" for alias in node.names]


def unit_of(module: str) -> str | None:
    # the catalogue's slices (usaf.testing.hostile_<slice>: more Cases for hostile.run_case) are one unit with it
    module = re.sub(r"^usaf\.testing\.hostile_\w+", "usaf.testing.hostile", module)
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYERS:
            return prefix
    return None


def _function_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return sorted(set(found), key=lambda n: n.lineno)


def _docstrings(tree: ast.AST) -> set[int]:
    """Constants that document rather than do: docstrings and ``description=``/``help=`` arguments."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg in ("description", "help"):
            ids.update(id(n) for n in ast.walk(node.value) if isinstance(n, ast.Constant))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


# -- the rules ---------------------------------------------------------------------------------------------


def check_layers(path: str, source: str) -> list[Violation]:
    importer = module_name(path)
    mine = unit_of(importer)
    if mine is None:
        return [Violation(path, 1, "layers", f"{importer} has no layer: add it to LAYERS")]
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for target in imported_modules(node, importer, path.endswith("__init__.py")):
            theirs = unit_of(target)
            if theirs is None or theirs == mine or (mine, theirs) in SAME_LAYER:
                continue
            if LAYERS[theirs] >= LAYERS[mine]:
                found.append(
                    Violation(
                        path,
                        node.lineno,
                        "layers",
                        f"{mine} (layer {LAYERS[mine]}) imports {target} ({theirs}, layer {LAYERS[theirs]})",
                    )
                )
    return found


def _is_device_type(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in DEVICE_TYPES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_device_type(e) for e in node.elts)
    return False


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def check_device(path: str, source: str) -> list[Violation]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            if _dotted(node.value) in ("torch.cuda", "torch.mps"):
                found.append(Violation(path, node.lineno, "device", f"{_dotted(node)}: ask the backend"))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "torch_directml" for n in names):
                found.append(Violation(path, node.lineno, "device", "torch_directml: only usaf.backends loads it"))
            elif any(n.startswith(("torch.cuda", "torch.mps")) for n in names):
                found.append(Violation(path, node.lineno, "device", f"{ast.unparse(node)}: ask the backend"))
        elif isinstance(node, ast.Constant) and node.value == "torch_directml":
            found.append(Violation(path, node.lineno, "device", "'torch_directml': only usaf.backends loads it"))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            typed = any(isinstance(s, ast.Attribute) and s.attr == "type" for s in sides)
            if typed and any(_is_device_type(s) for s in sides):
                found.append(
                    Violation(path, node.lineno, "device", f"{ast.unparse(node)}: branch on the backend's capabilities")
                )
    return sorted(set(found))


def check_hf_names(path: str, source: str) -> list[Violation]:
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in HF_MODULES:
            found.append(Violation(path, node.lineno, "hf-names", f".{node.attr}: reach it through usaf.families"))
        elif isinstance(node, (ast.Name, ast.Attribute)):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if HF_CLASS.fullmatch(name):
                found.append(Violation(path, node.lineno, "hf-names", f"{name}: a Hugging Face class"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            parts = set(re.split(r"[.\s\"'{}]+", node.value))
            if parts & HF_MODULES or HF_CLASS.search(node.value) or HF_PATH.search(node.value):
                found.append(Violation(path, node.lineno, "hf-names", f"{node.value!r}: a Hugging Face name"))
    return found


def check_test_imports(path: str, source: str, test_modules: set[str]) -> list[Violation]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        for name in names:
            top = name.removeprefix("tests.").split(".")[0]
            if top in test_modules:
                found.append(Violation(path, node.lineno, "test-imports", f"imports test module {top}: use helpers*"))
    return found


def check_lazy_imports(path: str, source: str) -> list[Violation]:
    lines = source.splitlines()

    def explained(lineno: int) -> bool:
        i = lineno - 1
        if "# lazy:" in lines[i]:
            return True
        i -= 1
        while i >= 0 and lines[i].strip().startswith(("#", "from ", "import ")):
            if "# lazy:" in lines[i]:
                return True
            i -= 1
        return False

    return [
        Violation(path, node.lineno, "lazy-import", f"{ast.unparse(node)}: move to the top or say '# lazy: why'")
        for node in _function_imports(ast.parse(source))
        if not explained(node.lineno)
    ]


# -- running them over the tree ----------------------------------------------------------------------------


def _sources(root: Path) -> list[tuple[str, str]]:
    return [(p.relative_to(ROOT).as_posix(), p.read_text(encoding="utf-8")) for p in sorted(root.rglob("*.py"))]


def _report(violations: list[Violation]) -> str:
    return "\n".join(map(str, sorted(violations)))


def _kept(violations: list[Violation]) -> list[Violation]:
    return [v for v in violations if (v.path, v.rule) not in ALLOWED]


def _fail_on(violations: list[Violation]) -> None:
    kept = _kept(violations)
    if kept:
        pytest.fail(f"{len(kept)} violation(s):\n{_report(kept)}", pytrace=False)


def test_layers():
    found = [v for path, text in _sources(SRC / "usaf") for v in check_layers(path, text)]
    _fail_on(found)


def test_device_calls_live_in_backends():
    found = [
        v
        for path, text in _sources(SRC / "usaf")
        if not path.startswith("src/usaf/backends/")
        for v in check_device(path, text)
    ]
    _fail_on(found)


def test_hugging_face_names_live_in_families():
    found = [
        v
        for path, text in _sources(SRC / "usaf")
        if not path.startswith("src/usaf/families/")
        for v in check_hf_names(path, text)
    ]
    _fail_on(found)


def _test_modules() -> set[str]:
    return {p.stem for p in TESTS.glob("*.py") if not p.stem.startswith("helpers") and p.stem != "conftest"}


def test_tests_do_not_import_tests():
    modules = _test_modules()
    found = [v for path, text in _sources(TESTS) for v in check_test_imports(path, text, modules)]
    _fail_on(found)


def test_function_level_imports_say_why():
    found = [
        v
        for path, text in _sources(SRC / "usaf")
        if not path.startswith(tuple(LAZY_BY_DESIGN))
        for v in check_lazy_imports(path, text)
    ]
    _fail_on(found)


def test_every_allowlisted_file_exists():
    missing = sorted({path for path, _ in ALLOWED if not (ROOT / path).is_file()})
    assert not missing, f"ALLOWED names files that are gone (prune them): {missing}"


# -- negative controls: each checker reports a synthetic bad file ------------------------------------------

BAD_ENGINE = '''
"""A docstring may say self_attn and torch.cuda."""
import torch
from torch.cuda import Stream
from usaf.stages.score import run  # engine -> stages: upward


def f(device, model, x):
    from usaf.cli import app  # function-level, upward, unexplained
    from usaf.errors import UsafError  # lazy: a documented reason
    torch.cuda.synchronize()
    if device.type == "cuda":
        pass
    if x.device.type in ("cpu", "mps"):
        pass
    attn = model.self_attn
    name = "model.layers.0.mlp.experts.gate_up_proj"
    return Qwen3MoeForCausalLM, attn, name
'''


@pytest.mark.parametrize(
    ("checker", "expected"),
    [
        (check_layers, {5, 9}),
        (check_device, {4, 11, 12, 14}),
        (check_hf_names, {16, 17, 18}),
        (check_lazy_imports, {9}),
    ],
)
def test_each_checker_reports_a_synthetic_bad_file(checker, expected):
    found = checker("src/usaf/engine/bad.py", BAD_ENGINE)
    assert {v.line for v in found} == expected, _report(found)
    assert all(str(v).startswith("src/usaf/engine/bad.py:") for v in found)


def test_the_layer_checker_resolves_relative_imports_and_allows_its_own_package():
    source = "from . import optim\nfrom ..stages import score\nfrom usaf.backends import resolve_backend\n"
    found = check_layers("src/usaf/engine/bad.py", source)
    assert [(v.line, v.rule) for v in found] == [(2, "layers")], _report(found)
    assert check_layers("src/usaf/engine/__init__.py", "from .optim import x\n") == []


def test_settings_stay_below_everything_that_uses_them():
    assert check_layers("src/usaf/memory_plan/config.py", "from usaf.settings.plan import PlanConfig\n") == []
    found = check_layers("src/usaf/settings/plan.py", "from usaf.config import StageConfig\nimport usaf.backends\n")
    assert [v.line for v in found] == [2], _report(found)


def test_same_layer_packages_may_not_import_each_other():
    found = check_layers("src/usaf/engine/bad.py", "from usaf.memory_plan import choose\n")
    assert [v.line for v in found] == [1], _report(found)


def test_the_test_import_checker_reports_test_modules_not_helpers():
    source = "import helpers\nfrom helpers_engine import batch\nfrom test_engine import make\nimport tests.test_cli\n"
    found = check_test_imports("tests/test_bad.py", source, {"test_engine", "test_cli"})
    assert [v.line for v in found] == [3, 4], _report(found)


def test_an_allowlisted_file_is_exempt_from_its_rule_only(monkeypatch):
    monkeypatch.setitem(ALLOWED, ("src/usaf/stages/trainer.py", "device"), "an example")
    found = check_device("src/usaf/stages/trainer.py", "import torch\ntorch.cuda.empty_cache()\n")
    assert found and not _kept(found)
    assert _kept(check_layers("src/usaf/stages/trainer.py", "import usaf.cli\n"))  # other rules still apply
    other = check_device("src/usaf/stages/other.py", "import torch\ntorch.cuda.empty_cache()\n")
    assert _kept(other) == other
