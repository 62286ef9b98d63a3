"""One mistake of the zoo: where it goes, what it changes, and which test must catch it, for what reason."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Mistake:
    name: str
    path: str  # the file it changes, relative to the repository
    edits: dict[str, str]  # text that must occur exactly once in the file -> what the mistake puts there
    test: str  # the pytest node id that must fail (file::name, with [params] where the test has them)
    reason: str  # a regex that the failing test's output must match: the catch is for this reason
    harm: str  # what the mistake does to training, in one line
    notice: str  # how one would notice it on a GPU cluster, in one line

    def apply(self, source: str) -> str:
        """``source`` with every edit made; ValueError naming the first edit that does not match once."""
        for old, new in self.edits.items():
            count = source.count(old)
            if count != 1:
                raise ValueError(f"{self.name}: {self.path} holds {count} copies of {old!r}, not one")
            source = source.replace(old, new)
        return source

    def matches_reason(self, output: str) -> bool:
        return re.search(self.reason, output) is not None
