"""What a directory input skips by default: tool state, installed third-party code and what git ignores.

Pointed at a repository's root, a walk that reads everything trains on its virtual environment (thousands of
installed packages' files), its build outputs and caches, and its hidden files (``.env`` holds secrets), and
stopped at the first binary-ish file among them (a PDF in matplotlib's package data). What a user means by
"my code" is what ``git`` would show them: tracked files and untracked ones no ``.gitignore`` excludes. So,
unless ``--all-files``:

- hidden files and directories (a name starting with ``.``) under a directory input;
- environments: a directory holding ``pyvenv.cfg`` (venv, virtualenv, uv) or ``conda-meta`` (conda), and
  ``node_modules``;
- what git ignores, asked of ``git`` itself (``ls-files --others --ignored --exclude-standard``), so that every
  rule of ``.gitignore``, ``.git/info/exclude`` and the user's global excludes means what it means to git. Each
  repository met (the input's, a nested one, a linked one) is asked about its own tree.

An input named on the command line is read even when one of these rules covers it: naming it is the request.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

HIDDEN = "hidden"
ENVIRONMENT = "environment"
GITIGNORE = "gitignore"
ENVIRONMENT_MARKERS = ("pyvenv.cfg", "conda-meta")  # a directory holding one of these is an environment
ENVIRONMENT_DIRS = frozenset({"node_modules"})
_GIT_TIMEOUT_S = 120


@dataclass(frozen=True)
class GitRules:
    """The paths git ignores under one directory of the walk: ``prefix`` is that directory's path under the
    walked tree (``""`` or ``"sub/"``), ``ignored`` holds paths relative to it (directories end with ``/``)."""

    prefix: str
    ignored: frozenset[str]

    def covers(self, rel: str) -> bool:
        """Whether git ignores ``rel`` (a path under the walked tree; a directory's ends with ``/``). A symbolic link
        to a directory is a file to git: listed without the ``/``."""
        if not rel.startswith(self.prefix):
            return False
        under = rel[len(self.prefix) :]
        return under in self.ignored or under.rstrip("/") in self.ignored


def git_rules(directory: Path, prefix: str) -> GitRules | None:
    """What git ignores under ``directory``, or None where git does not apply: no ``git`` on PATH, not a work tree,
    git refusing the repository (another user's: "dubious ownership"), or ``directory`` itself ignored (an input
    named by the user, or a tree reached through a link: read as asked)."""
    git = shutil.which("git")
    if git is None:
        return None
    inside = _git(git, directory, "rev-parse", "--is-inside-work-tree")
    if inside is None or inside.strip() != b"true":
        return None
    if _git(git, directory, "check-ignore", "-q", ".") is not None:  # exit 0: the directory itself is ignored
        return None
    listed = _git(git, directory, "ls-files", "-z", "--others", "--ignored", "--exclude-standard", "--directory")
    if listed is None:
        return None
    paths = (os.fsdecode(p) for p in listed.split(b"\0") if p)
    return GitRules(prefix, frozenset(p.replace(os.sep, "/") for p in paths))


# The corpus is not trusted: its own .git/config may name a command git runs for ls-files (core.fsmonitor, until
# 2026-12-06 run by usaf tokenize on a downloaded repository: found in review). Command-line -c wins over every
# config file; no command usaf runs reads hooks, the setting is belt and braces. No optional locks: usaf only reads.
_UNTRUSTED = ("-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null")


def _git(git: str, directory: Path, *args: str) -> bytes | None:
    """``git -C directory args``'s stdout, or None when it fails (any exit other than 0, or it cannot run)."""
    try:
        done = subprocess.run(
            [git, *_UNTRUSTED, "-C", str(directory), *args],
            capture_output=True,
            timeout=_GIT_TIMEOUT_S,
            check=False,
            env={**os.environ, "GIT_OPTIONAL_LOCKS": "0", "GIT_TERMINAL_PROMPT": "0"},
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def default_skip(path: Path, rel: str, *, is_dir: bool, rules: list[GitRules]) -> str | None:
    """Why the walk skips ``path`` by default (:data:`HIDDEN`, :data:`ENVIRONMENT`, :data:`GITIGNORE`), or None.

    ``rel``: its path under the walked tree, a directory's with a trailing ``/``.
    """
    if path.name.startswith("."):
        return HIDDEN
    if is_dir and (path.name in ENVIRONMENT_DIRS or any((path / m).exists() for m in ENVIRONMENT_MARKERS)):
        return ENVIRONMENT
    if any(r.covers(rel) for r in rules):
        return GITIGNORE
    return None


def is_repository_root(directory: Path) -> bool:
    """A directory with its own ``.git`` (a directory, or a submodule's or worktree's file)."""
    return (directory / ".git").exists()
