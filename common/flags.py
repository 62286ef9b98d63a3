"""The argparse types of every number and path flag: each refuses what no flag means (nan, 1e999, a word, a value
out of range; an empty, missing or too long path, a file where a folder goes, an output nothing can be created in)
as ``PROG: error: argument --FLAG: ...``, exit 2. Each carries ``kind``, from which tests/test_every_flag.py chooses
the hostile values it tries. No torch here: tools.checks.preflight parses its flags without importing it."""

from __future__ import annotations

import argparse
import functools
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from common.outputs import creation_failure, name_max, nearest_existing, not_a_folder

INTEGER = "whole number"
NUMBER = "number"
EXISTING_FILE = "existing file"
EXISTING_DIR = "existing folder"
EXISTING_PATH = "existing file or folder"  # a checkpoint: step-N.pt, or the folder of a sharded one
OUTPUT_FILE = "output file"
OUTPUT_DIR = "output folder"
OUTPUT_PATH = "output file or folder"  # what a command writes as one or the other, as its other flags say
NAME_PATTERN = "name pattern"  # a glob over names, such as a parameter's

T = TypeVar("T")


def flag_kind(kind: str) -> Callable[[Callable[[str], T]], Callable[[str], T]]:
    def mark(parse: Callable[[str], T]) -> Callable[[str], T]:
        parse.kind = kind  # type: ignore[attr-defined]
        return parse

    return mark


# torch's sizes and numpy's integers are 64-bit: a larger count, which Python reads happily, fails inside them.
INT64_MAX = 2**63 - 1


def shown(text: str) -> str:
    """A flag's text as a message repeats it: a long one cut short, with its length."""
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        # Python refuses to read more than 4,300 digits (ValueError): a whole number still, only too large.
        if not text.strip().lstrip("+-").replace("_", "").isdigit():
            raise argparse.ArgumentTypeError(f"must be a whole number, got {shown(text)}") from None
        return INT64_MAX + 1 if text.strip()[0] != "-" else -INT64_MAX - 2


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {shown(text)}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {shown(text)}")
    return value


def int_in_range(low: int, high: int | None = None, *, name: str = "integer") -> Callable[[str], int]:
    """Whole numbers from ``low`` to ``high`` (when None, to the largest 64-bit integer)."""
    if high is not None:
        bounds = f"an integer from {low} to {high}"
    else:
        bounds = {0: "zero or a positive integer", 1: "a positive integer"}.get(low, f"an integer of at least {low}")

    @flag_kind(INTEGER)
    def parse(text: str) -> int:
        value = _integer(text)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {shown(text)}")
        if abs(value) > INT64_MAX:
            raise argparse.ArgumentTypeError(
                f"must be at most {INT64_MAX:,} (64 bits, what torch and numpy count with), got {shown(text)}"
            )
        return value

    parse.__name__ = name
    return parse


def float_in_range(
    low: float, high: float | None = None, *, above_low: bool = False, unit: str = "", name: str = "number"
) -> Callable[[str], float]:
    """Finite numbers from ``low`` (excluded with ``above_low``) to ``high`` (no upper end when None)."""
    if high is not None:
        bounds = f"above {low:g} and at most {high:g}{unit}" if above_low else f"from {low:g} to {high:g}{unit}"
    elif low == 0:
        bounds = "a positive number" if above_low else "zero or a positive number"
    else:
        bounds = f"above {low:g}{unit}" if above_low else f"at least {low:g}{unit}"

    @flag_kind(NUMBER)
    def parse(text: str) -> float:
        value = _finite(text)
        too_low = value <= low if above_low else value < low
        if too_low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {shown(text)}")
        return value

    parse.__name__ = name
    return parse


positive_int = int_in_range(1, name="positive_int")
non_negative_int = int_in_range(0, name="non_negative_int")
positive_float = float_in_range(0, above_low=True, name="positive_float")
non_negative_float = float_in_range(0, name="non_negative_float")

# numpy's range, and far from the 64 bits torch's generators take with the epoch added
seed_value = int_in_range(0, 2**32 - 1, name="seed_value")


@flag_kind(NUMBER)
def probability(text: str) -> float:
    value = _finite(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {shown(text)}")
    return value


# The optimizers compute in float32, and Adam's first step divides the lr by 1 - beta1 = 0.1: a larger lr
# overflows inside AdamW.step (a RuntimeError in torch 2.14, found with --lr 1e38).
LR_LIMIT = 3.4028234663852886e38 / 10


@flag_kind(NUMBER)
def learning_rate(text: str) -> float:
    value = positive_float(text)
    if value > LR_LIMIT:
        raise argparse.ArgumentTypeError(
            f"must be at most {LR_LIMIT:.3g}: the optimizer's float32 arithmetic overflows, got {shown(text)}"
        )
    return value


# Why not below 10 s, the message says; above a week, gloo's clock overflows (1e13 s fails in torch 2.14).
DIST_TIMEOUT_RANGE_S = (10, 7 * 24 * 3600)


@flag_kind(NUMBER)
def timeout_seconds(text: str) -> float:
    value = _finite(text)
    low, high = DIST_TIMEOUT_RANGE_S
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(
            f"must be from {low} to {high} seconds (a week), got {shown(text)}: ranks start seconds apart and wait "
            "while rank 0 saves, so a shorter limit fails a healthy run"
        )
    return value


# The hang watchdog's limit (--hang-timeout): from a second, which a test of a hang waits, to gloo's week.
hang_seconds = float_in_range(1, DIST_TIMEOUT_RANGE_S[1], unit=" s", name="hang_seconds")


@flag_kind(NAME_PATTERN)
def name_pattern(text: str) -> str:
    """A shell-style glob over names (``'blocks.0.*'``). Blank is refused: no name is blank."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a pattern such as 'blocks.0.*', got nothing")
    return text


def path_kind(kind: str) -> Callable[[Callable[[str], Path]], Callable[[str], Path]]:
    """``flag_kind`` for a path, refusing an empty one and an OSError (a long name, a link loop) without a traceback."""

    def mark(check: Callable[[str], Path]) -> Callable[[str], Path]:
        @functools.wraps(check)
        def parse(text: str) -> Path:
            if not text:
                raise argparse.ArgumentTypeError("an empty path")
            try:
                return check(text)
            except OSError as err:
                shown = text if len(text) <= 120 else f"{text[:120]}..."
                raise argparse.ArgumentTypeError(f"{shown}: {err.strerror or err}") from None

        return flag_kind(kind)(parse)

    return mark


def _refuse_a_file(text: str, path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")


def _nearest_folder(text: str, path: Path) -> Path:
    """The nearest existing part of ``path``, refused unless it is a folder (a file, a link to nothing)."""
    existing = nearest_existing(path)
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {existing} {not_a_folder(existing)}")
    return existing


def _refuse_unwritable(text: str, folder: Path) -> None:
    """Refuse a folder to write in whose nearest existing part is a file, or one where nothing can be created."""
    existing = _nearest_folder(text, folder)
    failure = creation_failure(existing, make_folders=existing != folder)
    if failure is not None:
        raise argparse.ArgumentTypeError(f"{text}: cannot create anything in {existing} ({failure})")


def _refuse_long_names(text: str, path: Path) -> None:
    """A name the file system would refuse to make (ENAMETOOLONG), refused now: the parts there already fit."""
    longest = name_max(path)
    if any(len(os.fsencode(name)) > longest for name in path.parts):
        raise argparse.ArgumentTypeError(f"{text}: a name in it is longer than the {longest} bytes a name may have")


@path_kind(EXISTING_FILE)
def existing_file(text: str) -> Path:
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text}: cannot read it")
    return path


@path_kind(EXISTING_PATH)
def existing_path(text: str) -> Path:
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file or folder")
    return path


@path_kind(OUTPUT_DIR)
def folder(text: str) -> Path:
    """A folder that is there or can be made: not a file, not below a file. No write is asked of it: a data set on a
    read-only share is read where it is, and only a download needs to write."""
    path = Path(text)
    _refuse_a_file(text, path)
    _nearest_folder(text, path)
    _refuse_long_names(text, path)
    return path


@path_kind(OUTPUT_DIR)
def output_dir(text: str) -> Path:
    """A folder this run may create or write in: not a file, not below a file."""
    path = Path(text)
    _refuse_a_file(text, path)
    _refuse_unwritable(text, path)
    _refuse_long_names(text, path)
    return path
