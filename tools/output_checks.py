"""What a command checks of its outputs before any work starts: one message (exit 2) instead of an hour's
work lost to a name it cannot write.

The writing itself, whole or not at all, is common.outputs', which the training scripts share; these
checks are the commands' alone: ``--overwrite``, an output that is also an input, a device where a file
goes, a folder of run folders that holds something else.
"""

from __future__ import annotations

import argparse
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from common.outputs import OVERWRITE_FLAG, creation_failure, holds_something, name_max, nearest_existing, not_a_folder
from common.run_dir import METRICS_FILE


def same_file(a: Path, b: Path) -> bool:
    """One file under two names (a relative and an absolute path, a link, a hard link)."""
    try:
        return a.resolve() == b.resolve() or (os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b))
    except OSError:
        return False


def add_overwrite_flag(parser: argparse._ActionsContainer) -> None:
    """``--overwrite``, the same flag in every command that writes a file a user names."""
    parser.add_argument(
        OVERWRITE_FLAG,
        action="store_true",
        help="replace output files that exist already (never an input of the same command)",
    )


def not_a_regular_file(path: Path) -> bool:
    """``path`` is, or links to, something that is not a plain file: a device, a pipe, a socket."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:  # nothing there, or a dangling link: a file may take the name
        return False


def output_problem(path: Path, flag: str, inputs: Iterable[Path] = (), overwrite: bool = False) -> str | None:
    """Why writing ``path`` (given as ``flag``) must not start, or None."""
    named = f"{flag} {path}".strip()
    clash = next((source for source in inputs if same_file(path, source)), None)
    if clash is not None:
        return f"{named} is also an input of this command ({clash}); write the output under another name"
    if os.path.isdir(path):
        return f"{named} is a folder; give the name of the file to write"
    existing = nearest_existing(path.parent)
    if not os.path.isdir(existing):
        return f"{named}: {existing} {not_a_folder(existing)}"
    longest = name_max(path.parent)
    if len(os.fsencode(path.name)) > longest:
        return f"{named}: the name {path.name[:40]}... is longer than the {longest} bytes a name may have here"
    if not_a_regular_file(path):
        return (
            f"{named} is not a regular file (a device, a pipe or a socket); outputs are written as files, "
            f"and {OVERWRITE_FLAG} does not replace such a node: give a file name"
        )
    if os.path.lexists(path) and not overwrite:
        return f"{named} exists; choose another name, or pass {OVERWRITE_FLAG} to replace it"
    failure = creation_failure(existing, make_folders=existing != path.parent)
    if failure is not None:
        return f"{named}: cannot create anything in {existing} ({failure})"
    return None


def check_output_path(
    parser: argparse.ArgumentParser,
    path: Path,
    flag: str,
    inputs: Iterable[Path] = (),
    overwrite: bool = False,
) -> None:
    """Refuse, with ``parser.error`` (one line, exit 2), an output that ``output_problem`` objects to."""
    problem = output_problem(path, flag, inputs, overwrite)
    if problem is not None:
        parser.error(problem)


def folder_problem(folder: Path, flag: str) -> str | None:
    """Why outputs cannot go into ``folder`` (given as ``flag``), made if need be; None if they can."""
    existing = nearest_existing(folder)
    if not os.path.isdir(existing):
        return f"{flag} {folder}: {existing} {not_a_folder(existing)}"
    failure = creation_failure(existing, make_folders=True)
    if failure is not None:
        return f"{flag} {folder}: cannot create anything in {existing} ({failure})"
    return None


def check_output_folder(parser: argparse.ArgumentParser, folder: Path, flag: str) -> None:
    """Refuse, with ``parser.error``, a folder of outputs that ``folder_problem`` objects to."""
    problem = folder_problem(folder, flag)
    if problem is not None:
        parser.error(problem)


def finished_run_in(folder: Path) -> bool:
    """``folder`` holds what a finished run leaves (its record), so it is a run directory."""
    return (folder / METRICS_FILE).is_file()


def not_a_run(folder: Path) -> bool:
    """``folder`` holds something, and not a finished run's files (a run leaves METRICS_FILE): not this command's."""
    return holds_something(folder) and not finished_run_in(folder)


def check_run_folders(
    parser: argparse.ArgumentParser,
    folders: Iterable[Path],
    flag: str,
    value: Path,
    overwrite: bool,
    earlier: str = "earlier runs",
) -> None:
    """Refuse, before any run, the run folders ``output_folder`` would replace once their runs finish: one whose
    name something else has taken (a source tree named ``ddp``), whatever ``overwrite`` says, and one that
    holds an earlier run, unless ``overwrite`` says so."""
    folders = list(folders)
    foreign = [str(folder) for folder in folders if not_a_run(folder)]
    if foreign:
        parser.error(
            f"{flag}: {', '.join(foreign)} must hold this command's runs, but hold(s) something else (no "
            f"{METRICS_FILE}); {OVERWRITE_FLAG} replaces earlier runs only. Choose another {flag}"
        )
    taken = [str(folder) for folder in folders if holds_something(folder)]
    if taken and not overwrite:
        parser.error(
            f"{flag} {value}: {earlier} are in {', '.join(taken)}; pass {OVERWRITE_FLAG} to replace each once its "
            f"new run has finished, or choose another {flag}"
        )
