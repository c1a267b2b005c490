"""--include/--exclude patterns as .gitignore reads them (usaf.data.globs), and --held-out names."""

from __future__ import annotations

import json
import unicodedata

import pytest

from helpers import invoke
from usaf.data.globs import Glob
from usaf.stages.tokenize import select_heldout

FILES = ["src/a.py", "src/tests/t1.py", "tests/t2.py", "lib/x/tests/t3.py", "lib/x/b.py", "top.py"]


@pytest.mark.parametrize(
    ("pattern", "matched"),
    [
        # fnmatch's * crossed /, and **/ needed a directory (found in review)
        ("**/*.py", FILES),
        ("**/tests/**", ["src/tests/t1.py", "tests/t2.py", "lib/x/tests/t3.py"]),
        ("src/*.py", ["src/a.py"]),
        ("src/**/*.py", ["src/a.py", "src/tests/t1.py"]),
        # a name without / at any depth, a directory's included (--exclude tests matched no file)
        ("tests", ["src/tests/t1.py", "tests/t2.py", "lib/x/tests/t3.py"]),
        ("*.py", FILES),
        ("t?.py", ["src/tests/t1.py", "tests/t2.py", "lib/x/tests/t3.py"]),
        # with the input's name in front, as sources are named
        ("repo/tests/*", ["tests/t2.py"]),
        ("/lib", ["lib/x/tests/t3.py", "lib/x/b.py"]),  # a leading / anchors, as in .gitignore
        ("lib/x/[!b]*", ["lib/x/tests/t3.py"]),
        ("nomatch", []),
    ],
)
def test_a_pattern_matches_as_gitignore_reads_it(pattern, matched):
    assert [f for f in FILES if Glob(pattern).matches(f, root="repo")] == matched


def test_a_name_with_glob_characters_and_an_nfd_name_match_as_themselves():
    """``app[1]`` (a Next.js route directory) matched no file of that name: a class of one character (review)."""
    assert Glob("app[1]").matches("app[1]/x.py") and Glob("app[1]/x.py").matches("app[1]/x.py")
    assert Glob("app[1]").matches("app1/x.py")  # the glob's own reading stays
    nfd = unicodedata.normalize("NFD", "données")
    assert Glob("données").matches(f"{nfd}/a.txt") and Glob(nfd).matches("données/a.txt")
    sources = [f"nfd/{nfd}", "nfd/other.txt", "brd/app[1]", "brd/other"]
    assert select_heldout(sources, ["données", "app[1]"], 0.0, 0) == {f"nfd/{nfd}", "brd/app[1]"}


def test_tokenize_says_a_pattern_that_matched_nothing_and_blames_the_filter_for_an_empty_corpus(tmp_path, tiny_model):
    """A pattern that matched nothing was a no-op in silence; where --include left out every file, the hint offered
    --all-files (found in review). The control: a pattern that matches is not named."""
    model = tiny_model("qwen3_moe", num_layers=2, tokenizer=True)
    repo = tmp_path / "repo"
    for rel in FILES:
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(f"# {rel}\nprint('{rel}')\n")
    (repo / ".env").write_text("SECRET=1\n")  # a default skip: --all-files would read it
    out = tmp_path / "tokens"
    result = invoke("tokenize", repo, "--model", model, "--source-depth", 9, "--exclude", "tests",
                    "--exclude", "docs", "--out", out)  # fmt: skip
    said = " ".join(result.stderr.split())
    assert result.exit_code == 0 and "--exclude docs: matched no file or directory" in said, said
    assert "--exclude tests:" not in said
    sources = {s["source"] for s in json.loads((out / "manifest.json").read_text())["summary"]["sources"]}
    assert sources == {"repo/src/a.py", "repo/lib/x/b.py", "repo/top.py"}
    empty = invoke("tokenize", repo, "--model", model, "--include", "pkg/*.py", "--out", tmp_path / "none")
    said = " ".join(empty.stderr.split())
    assert empty.exit_code == 2 and "hint: check --include/--exclude" in said and "--all-files to read" not in said
