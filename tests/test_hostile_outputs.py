"""Hostile output paths (usaf.testing.hostile_outputs) through the real CLI: one error line naming the reason,
exit 2, and the inputs, the user's files and links exactly as they were."""

from __future__ import annotations

from usaf.testing import hostile_outputs

CASES = hostile_outputs.cases()


def test_every_writing_command_meets_every_shape():
    names = [c.name for c in CASES]
    for command in hostile_outputs.WRITERS:
        assert sum(n.startswith(f"{command}:") for n in names) >= 6, command
    assert len(set(names)) == len(names)
