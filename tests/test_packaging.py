"""The `directml` extra and the core dependencies resolve to consistent ranges on each platform.

pip evaluates environment markers against the running interpreter, so Windows cannot be resolved here;
instead the markers are evaluated for each platform and the resulting specifier sets intersected.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

packaging = pytest.importorskip("packaging")
from packaging.requirements import Requirement  # noqa: E402
from packaging.specifiers import SpecifierSet  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _ranges(platform: str, extras: tuple[str, ...] = ()) -> dict[str, SpecifierSet]:
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    env = {"sys_platform": platform, "python_version": "3.11", "extra": ""}
    out: dict[str, SpecifierSet] = {}
    for line in lines:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            out[req.name] = out.get(req.name, SpecifierSet()) & req.specifier
    return out


def test_linux_and_macos_keep_transformers_5_and_torch_2_6():
    for platform in ("linux", "darwin"):
        ranges = _ranges(platform, ("directml",))
        assert "torch-directml" not in ranges  # the extra is Windows-only
        assert not ranges["transformers"].contains("4.57.6") and ranges["transformers"].contains("5.24.0")
        assert not ranges["torch"].contains("2.4.1") and ranges["torch"].contains("2.13.0")


def test_windows_directml_extra_admits_torch_2_4_1_and_transformers_4_57():
    ranges = _ranges("win32", ("directml",))
    assert "torch-directml" in ranges
    assert ranges["torch"].contains("2.4.1")  # torch-directml 0.2.5 pins torch==2.4.1
    assert ranges["transformers"].contains("4.57.6") and not ranges["transformers"].contains("5.0.0")
    # negative control: a plain Windows install does not cap transformers
    assert _ranges("win32")["transformers"].contains("5.24.0")
