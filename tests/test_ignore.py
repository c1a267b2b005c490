"""What a directory input skips by default (usaf.data.ignore): hidden paths, environments, what git ignores.

A user points ``usaf tokenize`` at their repository's root: its ``.venv`` (thousands of installed packages'
files), build outputs, logs and ``.env`` must not become training text, and whatever is skipped is said.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import invoke
from usaf.artifacts import TokensManifest, load_verified
from usaf.data import ignore
from usaf.data.corpus import discover
from usaf.testing import build_tiny_tokenizer

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


@pytest.fixture(autouse=True)
def plain_git(monkeypatch, tmp_path):
    """No global or system git configuration: its excludes would change what is ignored."""
    empty = tmp_path / "gitconfig"
    empty.write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(empty))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")


def git_init(path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(path)], check=True)


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


USER_FILES = {"src/a.py": "a = 1\n" * 40, "docs/guide.md": "# guide\n" * 40, "notes.txt": "notes\n" * 40,
              "nested/n.py": "n = 1\n" * 40}  # fmt: skip
OTHER_FILES = {
    ".gitignore": "build/\n*.log\n",
    "src/debug.log": "log line\n" * 40,  # ignored by a pattern
    "build/lib/b.py": "b = 1\n" * 40,  # an ignored directory
    ".venv/pyvenv.cfg": "home = /usr/bin\n",  # hidden and an environment
    ".venv/lib/site-packages/m.py": "m = 1\n" * 40,
    "env/pyvenv.cfg": "home = /usr/bin\n",  # an environment by its marker, whatever its name
    "env/lib/e.py": "e = 1\n" * 40,
    "conda/conda-meta/history": "==> 2024 <==\n",
    "conda/lib/c.py": "c = 1\n" * 40,
    "web/node_modules/pkg/index.js": "module.exports = 1;\n" * 40,
    ".env": "API_KEY=secret\n",
    ".github/workflows/ci.yml": "on: push\n",
    "nested/.gitignore": "out/\n",  # a nested repository's own rules
    "nested/out/o.py": "o = 1\n" * 40,
}


@pytest.fixture
def repo(tmp_path) -> Path:
    root = tmp_path / "project"
    write(root, {**USER_FILES, **OTHER_FILES})
    if shutil.which("git"):
        git_init(root)
        git_init(root / "nested")
    return root


def rel_files(corpus, root: Path) -> set[str]:
    return {f.path.relative_to(root).as_posix() for f in corpus.files}


@needs_git
def test_a_repository_root_gives_the_users_files_only(repo):
    corpus = discover([repo], include=[], exclude=[], source_depth=1)
    assert rel_files(corpus, repo) == set(USER_FILES)
    skipped = {why: {p.relative_to(repo).as_posix() for p in paths} for why, paths in corpus.skipped_default.items()}
    assert skipped == {
        ignore.HIDDEN: {".venv", ".github", ".env", ".gitignore", "nested/.gitignore"},
        ignore.ENVIRONMENT: {"env", "conda", "web/node_modules"},
        ignore.GITIGNORE: {"build", "src/debug.log", "nested/out"},
    }
    # the control: --all-files reads everything but the version control's own directories
    everything = discover([repo], include=[], exclude=[], source_depth=1, all_files=True)
    assert rel_files(everything, repo) == set(USER_FILES) | set(OTHER_FILES)
    assert everything.skipped_default == {}


@needs_git
def test_a_directory_named_on_the_command_line_is_read_even_where_a_rule_covers_it(repo):
    for named in (repo / "build", repo / "env", repo / "build" / "lib"):
        corpus = discover([named], include=[], exclude=[], source_depth=1)
        assert corpus.files and not corpus.skipped_default, named
    (repo / "src" / ".hidden.py").write_text("h = 1\n")
    assert discover([repo / "src" / ".hidden.py"], include=[], exclude=[], source_depth=1).files  # a file, named


@needs_git
def test_a_linked_repository_is_asked_about_its_own_rules(tmp_path):
    other = tmp_path / "other"
    write(other, {".gitignore": "*.tmp\n", "o.py": "o = 1\n" * 40, "scratch.tmp": "t\n" * 40})
    git_init(other)
    links = tmp_path / "links"
    links.mkdir()
    (links / "other").symlink_to(other)
    corpus = discover([links], include=[], exclude=[], source_depth=1)
    assert [f.path.name for f in corpus.files] == ["o.py"]
    assert [p.name for p in corpus.skipped_default[ignore.GITIGNORE]] == ["scratch.tmp"]


@needs_git
def test_an_ignored_link_to_a_directory_is_not_followed(tmp_path):
    outside = tmp_path / "outside"
    write(outside, {"big.py": "b = 1\n" * 40})
    root = tmp_path / "project"
    write(root, {".gitignore": "data\n", "a.py": "a = 1\n" * 40})
    (root / "data").symlink_to(outside)  # git lists an ignored link as a file: "data", no "/"
    git_init(root)
    corpus = discover([root], include=[], exclude=[], source_depth=1)
    assert rel_files(corpus, root) == {"a.py"}
    assert [p.name for p in corpus.skipped_default[ignore.GITIGNORE]] == ["data"]


def test_without_git_the_other_rules_still_apply(repo, monkeypatch):
    monkeypatch.setattr(ignore.shutil, "which", lambda name: None)
    corpus = discover([repo], include=[], exclude=[], source_depth=1)
    # what only git knows is read (build/, *.log, nested/out/); hidden paths and environments are not
    assert rel_files(corpus, repo) == set(USER_FILES) | {"src/debug.log", "build/lib/b.py", "nested/out/o.py"}
    assert ignore.GITIGNORE not in corpus.skipped_default and corpus.skipped_default[ignore.ENVIRONMENT]


def test_outside_a_repository_nothing_is_asked_of_git(tmp_path):
    write(tmp_path / "plain", {"a.py": "a\n", "build/b.py": "b\n", ".gitignore": "build/\n"})
    corpus = discover([tmp_path / "plain"], include=[], exclude=[], source_depth=1)
    assert rel_files(corpus, tmp_path / "plain") == {"a.py", "build/b.py"}  # no repository: .gitignore means nothing


@needs_git
def test_tokenize_says_what_it_skipped_and_all_files_reads_it(repo, tmp_path):
    tok = tmp_path / "tok"
    build_tiny_tokenizer(tok, model_max_length=1024)
    out = tmp_path / "tokens"
    result = invoke("tokenize", repo, "--model", tok, "--seq-len", 32, "--out", out)
    assert result.exit_code == 0, result.output
    note = " ".join(result.stderr.split())
    assert "skipped under the directory inputs: 5 hidden (.github, .venv, .env, ...); 3 environment" in note
    assert "3 ignored by git (build, out, debug.log); --all-files reads them" in note
    summary = load_verified(out, TokensManifest).summary
    assert summary.documents == len(USER_FILES)
    assert summary.skipped_by_default == {"hidden": 5, "environment": 3, "gitignore": 3}
    assert "11 paths skipped by default (--all-files)" in result.stdout
    every = tmp_path / "every"
    result = invoke("tokenize", repo, "--model", tok, "--seq-len", 32, "--out", every, "--all-files")
    assert result.exit_code == 0, result.output
    assert "skipped under" not in result.stderr
    summary = load_verified(every, TokensManifest).summary
    assert summary.documents == len(USER_FILES) + len(OTHER_FILES) and summary.skipped_by_default == {}
    manifest = json.loads((every / "manifest.json").read_text())
    assert manifest["config"]["all_files"] is True


def test_a_corpus_of_only_skipped_paths_is_refused_naming_all_files(tmp_path):
    """A directory holding only what is skipped by default: the empty-corpus error says so and names --all-files."""
    tok = tmp_path / "tok"
    build_tiny_tokenizer(tok, model_max_length=1024)
    only = tmp_path / "only"
    write(only, {".venv/pyvenv.cfg": "home = /usr/bin\n", ".venv/lib/m.py": "m = 1\n" * 40, ".notes.txt": "n\n" * 40})
    out = tmp_path / "tokens"
    result = invoke("tokenize", only, "--model", tok, "--seq-len", 32, "--out", out)
    message = " ".join(result.stderr.split())
    assert result.exit_code == 2 and not out.exists()
    assert "empty corpus" in message
    assert "2 hidden, environment or git-ignored paths (--all-files reads them)" in message
    assert "hint: pass --all-files to read them" in message
    assert invoke("tokenize", only, "--model", tok, "--seq-len", 32, "--out", out, "--all-files").exit_code == 0


@needs_git
def test_a_command_the_repositorys_own_config_names_is_never_run(tmp_path):
    """A downloaded repository's .git/config is the corpus's, not the user's: its core.fsmonitor command ran at
    usaf tokenize (found in review). The control: git itself runs it, so the check is not vacuous."""
    root = tmp_path / "downloaded"
    write(root, {"a.py": "a = 1\n" * 40})
    git_init(root)
    ran = tmp_path / "ran"
    hook = tmp_path / "hook.sh"
    hook.write_text(f"#!/bin/sh\ntouch {ran}\n")
    hook.chmod(0o755)
    subprocess.run(["git", "-C", str(root), "config", "core.fsmonitor", str(hook)], check=True)
    assert ignore.git_rules(root, "") is not None and not ran.exists()
    subprocess.run(["git", "-C", str(root), "ls-files", "--others"], capture_output=True, check=False)
    assert ran.exists()
