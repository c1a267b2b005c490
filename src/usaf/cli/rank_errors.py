"""The last lines of the ranks of ``usaf train --nproc N``, said once.

Every rank of a local launch resolves the same flags, files and environment, so a refusal (a bad ``--lr``, a
missing ``--plan``) or a Ctrl-C ended every rank with the same line, printed N times (found in review). Under
``--nproc`` the launcher gives the ranks a directory (``USAF_RANK_ERRORS``): each rank writes its last line there,
rank 0 also prints it as it happens, and the others print nothing. Once torchrun is done, the launcher prints
what another rank said that no lower rank did, under its rank, so a failure of one rank alone (its memory, a peer
lost) is still read, once. Under a torchrun a user starts (no such directory: ranks on other machines, other
files) every rank prints its own, as before.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

ERRORS_ENV = "USAF_RANK_ERRORS"

# A rank's last line: ("error", message, hint) or ("stopped", text, None).
Said = tuple[str, str, "str | None"]


def record(kind: str, text: str, hint: str | None = None) -> bool:
    """Keep this rank's last line for the launcher; True when the rank is to print it itself (rank 0, or no
    launcher collecting them)."""
    directory, rank = os.environ.get(ERRORS_ENV), os.environ.get("RANK")
    if not directory or rank is None:
        return True
    try:
        with open(Path(directory) / f"rank-{int(rank)}.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps([kind, text, hint]) + "\n")
    except (OSError, ValueError):  # the launcher's directory gone, or an odd RANK: say it here rather than lose it
        return True
    return rank == "0"


def say_distinct(directory: Path, say: Callable[[int, Said], None]) -> None:
    """After the launch: ``say(rank, line)`` for each line of a rank > 0 that no lower rank said (rank 0's were
    printed as they happened)."""
    heard: set[tuple[str, str, str | None]] = set()
    for file in sorted(directory.glob("rank-*.jsonl"), key=lambda f: int(f.stem.partition("-")[2])):
        rank = int(file.stem.partition("-")[2])
        for line in file.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                kind, text, hint = json.loads(line)
            except ValueError:  # a rank killed as it wrote: its line is lost, not the launcher's exit status
                continue
            if (kind, text, hint) not in heard and rank > 0:
                say(rank, (kind, text, hint))
            heard.add((kind, text, hint))
