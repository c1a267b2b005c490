"""Check that the demo's stdlib domains select the same modules on CPython 3.10, 3.11, 3.12 and 3.13.

Needs the ``stdlib-list`` package (``pip install stdlib-list``; its per-version module lists stand in
for the CPython trees, which cannot be downloaded here), and checks the running Python's own files too.

For each version, every module under a domain's package directories is mapped to its possible file
paths (``pkg/a/b.py`` or ``pkg/a/b/__init__.py``), the domain's exclude globs are applied the way
``usaf tokenize`` applies them, and the selected module sets are compared across versions. Top-level
module files must exist, as files (no submodules), in every version.

    PYTHONPATH=src python scripts/check_demo_domains.py
"""

from __future__ import annotations

import fnmatch
import sys

from stdlib_list import stdlib_list

from usaf.demo import DEMO_DOMAIN, PRETRAIN_DOMAIN, StdlibDomain
from usaf.testing import stdlib_dir

VERSIONS = ("3.10", "3.11", "3.12", "3.13")


def _excluded(rel: str, patterns: tuple[str, ...]) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(name, p) for p in patterns)


def selected(domain: StdlibDomain, modules: set[str]) -> tuple[set[str], list[str]]:
    """(selected module names, problems) for one version's module list (package ``__init__`` = the package)."""
    chosen, problems = set(), []
    packages = {m.split(".")[0] for m in modules if "." in m}
    for path in domain.paths:
        if path.endswith(".py"):
            name = path[:-3]
            if name not in modules:
                problems.append(f"{path}: no such module")
            elif name in packages and name != "os":  # os.path is an alias module, os.py is a file
                problems.append(f"{path}: a package in this version")
            elif not _excluded(path, domain.exclude):
                chosen.add(name)
            continue
        if path not in modules or path not in packages:
            problems.append(f"{path}/: no such package")
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] != path or len(parts) == 1:
                continue
            # a module with submodules is a package (its file is __init__.py), any other a .py file
            is_package = any(m.startswith(module + ".") for m in modules)
            rel = "/".join(parts[1:]) + ("/__init__.py" if is_package else ".py")
            if not _excluded(rel, domain.exclude):
                chosen.add(module)
        chosen.add(path)
    return chosen, problems


def main() -> int:
    failed = False
    for domain in (PRETRAIN_DOMAIN, DEMO_DOMAIN):
        per_version = {}
        for version in VERSIONS:
            chosen, problems = selected(domain, set(stdlib_list(version)))
            per_version[version] = chosen
            for problem in problems:
                print(f"{domain.name} {version}: {problem}")
                failed = True
        common = set.intersection(*per_version.values())
        for version, chosen in per_version.items():
            extra = sorted(chosen - common)
            if extra:
                print(f"{domain.name} {version}: selects modules missing elsewhere: {extra}")
                failed = True
        missing = [p for p in domain.paths if not (stdlib_dir() / p).exists()]
        if missing:
            print(f"{domain.name}: missing in this Python ({sys.version.split()[0]}): {missing}")
            failed = True
        held = [h for h in domain.held_out if h not in domain.paths]
        if held:
            print(f"{domain.name}: held-out sources that are not inputs: {held}")
            failed = True
        print(f"{domain.name}: {len(common)} modules selected on every version of {', '.join(VERSIONS)}")
    overlap = set(PRETRAIN_DOMAIN.paths) & set(DEMO_DOMAIN.paths)
    if overlap:
        print(f"the domains overlap: {sorted(overlap)}")
        failed = True
    print("FAILED" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
