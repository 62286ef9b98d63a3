"""The one reader of a run's metrics.jsonl, for every command that reads one.

A run appends one JSON object a line, each with its ``event`` (common.bookkeeping). One rule for what is
not such a line:

- The last line, where it is not whole JSON, is a write cut short: a run killed mid-write, or one still
  writing. It is left out, and said once on stderr (``PATH: left out line N, ...``); everything before
  it is read. A run resumed from it drops that line itself (common.bookkeeping), so a finished run has none.
- Any other line that is not a record (not JSON, cut short in the middle, not an object with a string
  ``event``, or a number larger than a float holds, which no run writes) is an edit, damage or another
  program's file: ``UnreadableRecord`` (a ValueError) naming the file, the line and what is wrong, which
  each command prints as its one message. Guessing past it would draw or judge a run that is not there.

The file is read as UTF-8 with undecodable bytes replaced, so a damaged byte is a line that fails the rule,
not a UnicodeDecodeError. A missing file is the caller's ``FileNotFoundError`` (an ``OSError``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.run_dir import METRICS_FILE

# Files whose torn last line was said already, as they were then (size, mtime): a command reads a run more
# than once (compare_runs: its model, its steps, its evaluation) and says it once.
_SAID: set[tuple[Path, int, int]] = set()


class UnreadableRecord(ValueError):
    """A line of metrics.jsonl that is no run's record; its text names the file, line and what is wrong."""


@dataclass(frozen=True)
class _NoFloat:
    """A JSON integer that no float holds (past 1.8e308), kept aside to be named with its field."""

    digits: int


def _json_integer(text: str) -> int | _NoFloat:
    digits = len(text.lstrip("-"))
    if digits > 309:  # json reads integers with int(), which refuses more than 4,300 digits (ValueError)
        return _NoFloat(digits)
    value = int(text)
    return value if abs(value) <= sys.float_info.max else _NoFloat(digits)


def load_line(line: str, path: Path, number: int) -> Any:
    """``json.loads`` of line ``number`` of the metrics file ``path``, for readers that compute with its numbers in
    floats: ``json.JSONDecodeError`` for a line cut short, as json says, and ``UnreadableRecord`` for a number
    larger than a float holds, which no run writes (an edit, or damage)."""
    loaded = json.loads(line, parse_int=_json_integer)
    for name, value in _fields(loaded) if isinstance(loaded, dict) else []:
        if isinstance(value, _NoFloat):
            raise UnreadableRecord(
                f"{path}, line {number}: {name} is a number of {value.digits} digits, larger than any a float holds "
                "and than any a run writes (was the file edited, or damaged?)"
            )
    return loaded


def _fields(record: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every value of ``record``, nested ones too (``local_state_bytes.params``, a list's items), with its name."""
    for key, value in record.items():
        name = f"{prefix}{key}"
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else None
        if items is None:
            yield name, value
        else:
            yield from _fields(dict((str(k), v) for k, v in items), f"{name}.")


@dataclass(frozen=True)
class Records:
    """What one run's metrics.jsonl holds, in the order it was written."""

    path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    torn_line: int | None = None  # the last line, cut short and left out

    def of(self, event: str) -> list[dict[str, Any]]:
        return [record for record in self.records if record["event"] == event]

    @property
    def final(self) -> dict[str, Any] | None:
        """The run's final record (the last, should an edit have left two); None before the run has finished."""
        finals = self.of("final")
        return finals[-1] if finals else None


def read_records(run_dir: Path) -> Records:
    """The records of ``run_dir``'s metrics.jsonl, by the module's rule: a torn last line left out and said,
    any other line that is no record ``UnreadableRecord``."""
    path = run_dir / METRICS_FILE
    with path.open(encoding="utf-8", errors="replace") as file:
        text = file.read()
        stat = os.fstat(file.fileno())
    lines = text.splitlines()
    records, torn_line = [], None
    for number, line in enumerate(lines, 1):
        try:
            record = load_line(line, path, number)
        except json.JSONDecodeError as err:
            if number == len(lines):
                torn_line = number
                break
            raise UnreadableRecord(f"{path}, line {number}: not a whole record ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("event"), str):
            raise UnreadableRecord(f"{path}, line {number}: not a record of a run (an object with its event)")
        records.append(record)
    if torn_line is not None and (key := (path.absolute(), stat.st_size, stat.st_mtime_ns)) not in _SAID:
        _SAID.add(key)
        print(
            f"{path}: left out line {torn_line}, not a whole record (cut off mid-write, or being written now)",
            file=sys.stderr,
        )
    return Records(path, records, torn_line)


def final_record(run_dir: Path) -> dict[str, Any]:
    """The final record of a run that has finished; ``UnreadableRecord`` where there is none."""
    final = read_records(run_dir).final
    if final is None:
        raise UnreadableRecord(f"{run_dir / METRICS_FILE}: no final record: the run did not finish")
    return final
