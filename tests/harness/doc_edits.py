"""The edits a page of docs/ gives as ``diff`` blocks, applied to a copy of a script as a user applies them.

A block follows the heading that names its script (``### fsdp/train_transformer_fsdp2.py``). Each hunk
starts with a line ``@@`` (a title may follow); its lines without ``+`` (context, with a leading space, and lines
marked ``-``) must stand together exactly once in the script, and become its lines without ``-``.
"""

from __future__ import annotations

import re
from pathlib import Path

DIFF_AFTER_HEADING = re.compile(r"^### (\S+)\n(?:(?!#)[^\n]*\n)*?```diff\n(.*?)^```", re.MULTILINE | re.DOTALL)


def edits_by_script(page: Path) -> dict[str, list[tuple[str, str]]]:
    """Each script's hunks on ``page``, as (the lines they replace, what replaces them)."""
    found = {}
    for script, block in DIFF_AFTER_HEADING.findall(page.read_text()):
        hunks = [hunk for hunk in re.split(r"^@@.*\n", block, flags=re.MULTILINE) if hunk.strip()]
        found[script] = [replacement(hunk) for hunk in hunks]
    return found


def replacement(hunk: str) -> tuple[str, str]:
    lines = hunk.splitlines(keepends=True)
    assert all(line[:1] in " -+" for line in lines), f"a hunk line must start with ' ', '-' or '+':\n{hunk}"
    old = "".join(line[1:] for line in lines if not line.startswith("+"))
    new = "".join(line[1:] for line in lines if not line.startswith("-"))
    return old, new


def apply_edits(source: str, edits: list[tuple[str, str]]) -> str:
    """``source`` with each edit made; an edit whose lines do not stand exactly once in it fails the test."""
    for old, new in edits:
        assert source.count(old) == 1, f"the script no longer has these lines once:\n{old}"
        source = source.replace(old, new)
    return source
