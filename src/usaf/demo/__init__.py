"""The built-in demo: a small pretrained Qwen3-MoE shipped with the package, and two stdlib domains.

Everything here is data read at run time from the Python standard library's own sources (text every
machine with Python has), so the demo needs no download:

- ``PRETRAIN_DOMAIN``: what ``scripts/build_demo_model.py`` pretrains the demo model on, with a few
  sources held out for the validation perplexity (and, later, for measuring forgetting);
- ``DEMO_DOMAIN``: the reserved fine-tuning domain (network protocols, mail, async I/O, markup: asyncio,
  email, http, urllib, xml, ...), never seen in pretraining, with held-out sources that use the trained
  packages (xmlrpc, wsgiref, smtplib, ...), so fine-tuning shows an in-domain gain on unseen sources;
- ``CPP_DOMAIN``: a much larger shift, another language: the C++ headers that PyTorch's wheel ships in
  ``torch/include`` (c10 and fmt to train on, pybind11 held out). torch is a dependency of usaf, so they are
  on every machine usaf runs on; the evidence benchmark's second domain (the system's own C headers are kept
  out: they stay an independent check).

Both are expressed in ``usaf tokenize``'s own terms: input paths under ``stdlib_dir()`` (package
directories and single module files), ``--exclude`` globs, ``--held-out`` sources and
``--source-depth 0`` (a package directory or a module file is one source). Paths are named explicitly
rather than globbed because ``--include`` matches a file's name anywhere in the tree (``abc.py`` would
also select ``importlib/abc.py``).

Stability: every path listed exists as the same kind (file or package directory) in CPython 3.10, 3.11,
3.12 and 3.13, and the exclude globs remove the files that exist in only some of those versions
(``asyncio/taskgroups.py`` is 3.11+, ``wsgiref/types.py`` 3.11+, ``__main__.py`` of sqlite3 3.12+,
in-package ``test`` directories moved out in 3.12). So the *selection* is the same set of modules on
each of them; the text inside is each version's own (the model's PROVENANCE.json records which
version built it). Modules that Linux distributions split into optional packages (tkinter, idlelib,
lib2to3, distutils, ensurepip, test) and generated tables (encodings, pydoc_data) are not used.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from usaf.testing import stdlib_dir

__all__ = ["CPP_DOMAIN", "DEMO_DOMAIN", "PRETRAIN_DOMAIN", "StdlibDomain", "demo_model_dir", "torch_include_dir"]


@dataclass(frozen=True)
class StdlibDomain:
    """A selection of standard-library sources, in ``usaf tokenize`` terms.

    Attributes:
        name: a short label (used in output names).
        paths: package directories and module files, relative to the stdlib directory.
        include: ``--include`` globs (``*.py``: no READMEs, ``.rst`` or ``.bat`` files of packages).
        exclude: ``--exclude`` globs (matched against a file's path under its input directory, or its name).
        held_out: ``--held-out`` sources (with ``source_depth`` 0: a package's directory name or a module's file name).
        source_depth: ``--source-depth``.
        base_dir: the directory ``paths`` are relative to (default: this Python's stdlib directory).
    """

    name: str
    paths: tuple[str, ...]
    exclude: tuple[str, ...]
    held_out: tuple[str, ...]
    include: tuple[str, ...] = ("*.py",)
    source_depth: int = 0
    base_dir: Callable[[], Path] = stdlib_dir

    def inputs(self, root: Path | None = None) -> list[Path]:
        """The input paths under ``root`` (default: :attr:`base_dir`)."""
        base = Path(root) if root is not None else self.base_dir()
        return [base / p for p in self.paths]

    def tokenize_options(self, root: Path | None = None) -> dict[str, Any]:
        """Keyword arguments for ``usaf.stages.tokenize.TokenizeConfig`` selecting this domain."""
        return {
            "inputs": self.inputs(root),
            "include": list(self.include),
            "exclude": list(self.exclude),
            "held_out": list(self.held_out),
            "source_depth": self.source_depth,
            "decode_errors": "replace",
        }


# Files present in some of 3.10-3.13 only, package test suites, and entry points.
_EXCLUDE = (
    "test/*",
    "tests/*",
    "test_*.py",
    "__main__.py",
    "taskgroups.py",  # asyncio, 3.11+
    "timeouts.py",  # asyncio, 3.11+
    "types.py",  # wsgiref, 3.11+ (excludes match file inputs too: the top-level types.py is not used)
    "resources/*",  # importlib.resources: a module in 3.10, a package since 3.11
    "resources.py",
    "simple.py",  # importlib.simple, 3.11+
    "_adapters.py",  # importlib, 3.10 only (moved into resources/)
    "_common.py",
    "diagnose.py",  # importlib.metadata, 3.13+
    "sqlite3.py",  # dbm.sqlite3, 3.13+
)

_DEMO_PACKAGES = ("asyncio", "email", "html", "http", "urllib", "xml", "xmlrpc", "wsgiref")
_DEMO_MODULES = (
    "ftplib.py",
    "imaplib.py",
    "ipaddress.py",
    "mailbox.py",
    "mimetypes.py",
    "poplib.py",
    "selectors.py",
    "smtplib.py",
    "socket.py",
    "socketserver.py",
    "ssl.py",
)

DEMO_DOMAIN = StdlibDomain(
    name="stdlib-net",
    paths=_DEMO_PACKAGES + _DEMO_MODULES,
    exclude=_EXCLUDE,
    held_out=("xmlrpc", "wsgiref", "smtplib.py", "imaplib.py", "poplib.py", "mailbox.py"),
)

_PRETRAIN_PACKAGES = (
    "collections",
    "concurrent",
    "ctypes",
    "curses",
    "dbm",
    "importlib",
    "json",
    "logging",
    "multiprocessing",
    "sqlite3",
    "unittest",
    "zoneinfo",
)
# Top-level modules that are one file in every CPython 3.10-3.13 (not re, pathlib, sysconfig, zipfile,
# which became packages; not the modules removed by PEP 594/632), minus the demo domain's, GUI
# (turtle) and joke (this, antigravity) modules.
_PRETRAIN_MODULES = (
    "__future__.py",
    "_aix_support.py",
    "_collections_abc.py",
    "_compat_pickle.py",
    "_compression.py",
    "_markupbase.py",
    "_osx_support.py",
    "_py_abc.py",
    "_pydecimal.py",
    "_pyio.py",
    "_sitebuiltins.py",
    "_strptime.py",
    "_threading_local.py",
    "_weakrefset.py",
    "abc.py",
    "argparse.py",
    "ast.py",
    "base64.py",
    "bdb.py",
    "bisect.py",
    "bz2.py",
    "cProfile.py",
    "calendar.py",
    "cmd.py",
    "code.py",
    "codecs.py",
    "codeop.py",
    "colorsys.py",
    "compileall.py",
    "configparser.py",
    "contextlib.py",
    "contextvars.py",
    "copy.py",
    "copyreg.py",
    "csv.py",
    "dataclasses.py",
    "datetime.py",
    "decimal.py",
    "difflib.py",
    "dis.py",
    "doctest.py",
    "enum.py",
    "filecmp.py",
    "fileinput.py",
    "fnmatch.py",
    "fractions.py",
    "functools.py",
    "genericpath.py",
    "getopt.py",
    "getpass.py",
    "gettext.py",
    "glob.py",
    "graphlib.py",
    "gzip.py",
    "hashlib.py",
    "heapq.py",
    "hmac.py",
    "inspect.py",
    "io.py",
    "keyword.py",
    "linecache.py",
    "locale.py",
    "lzma.py",
    "modulefinder.py",
    "netrc.py",
    "ntpath.py",
    "nturl2path.py",
    "numbers.py",
    "opcode.py",
    "operator.py",
    "optparse.py",
    "os.py",
    "pdb.py",
    "pickle.py",
    "pickletools.py",
    "pkgutil.py",
    "platform.py",
    "plistlib.py",
    "posixpath.py",
    "pprint.py",
    "profile.py",
    "pstats.py",
    "pty.py",
    "py_compile.py",
    "pyclbr.py",
    "pydoc.py",
    "queue.py",
    "quopri.py",
    "random.py",
    "reprlib.py",
    "rlcompleter.py",
    "runpy.py",
    "sched.py",
    "secrets.py",
    "shelve.py",
    "shlex.py",
    "shutil.py",
    "signal.py",
    "site.py",
    "sre_compile.py",
    "sre_constants.py",
    "sre_parse.py",
    "stat.py",
    "statistics.py",
    "string.py",
    "stringprep.py",
    "struct.py",
    "subprocess.py",
    "symtable.py",
    "tabnanny.py",
    "tarfile.py",
    "tempfile.py",
    "textwrap.py",
    "threading.py",
    "timeit.py",
    "token.py",
    "tokenize.py",
    "trace.py",
    "traceback.py",
    "tracemalloc.py",
    "tty.py",
    "typing.py",
    "uuid.py",
    "warnings.py",
    "wave.py",
    "weakref.py",
    "webbrowser.py",
    "zipapp.py",
    "zipimport.py",
)

PRETRAIN_DOMAIN = StdlibDomain(
    name="stdlib-pretrain",
    paths=_PRETRAIN_PACKAGES + _PRETRAIN_MODULES,
    exclude=_EXCLUDE,
    held_out=("json", "logging", "argparse.py", "difflib.py", "textwrap.py"),
)


def torch_include_dir() -> Path:
    """The C++ headers PyTorch's wheel ships (``torch/include``), found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("torch is not installed: the C++ domain reads the headers its wheel ships")
    return Path(spec.origin).parent / "include"


# Another language than the pretraining text: c10 (PyTorch's core library) and fmt train, pybind11 is held out.
# Each is one source (a directory); all three are in every torch wheel since 1.x.
CPP_DOMAIN = StdlibDomain(
    name="torch-cpp",
    paths=("c10", "fmt", "pybind11"),
    exclude=("test/*",),
    held_out=("pybind11",),
    include=("*.h",),
    base_dir=torch_include_dir,
)


def demo_model_dir() -> Path:
    """The packaged demo model: a Hugging Face model directory (config, safetensors, tokenizer, PROVENANCE.json)."""
    return Path(__file__).resolve().parent / "model"
