"""The one way a script or command writes a file: whole or not at all, and never over what it must keep.

Each output is written under a temporary of this writer's own (``.tmp-NAME.PID.RANDOM``), flushed, then renamed:
a kill or a full disk never leaves half a file under the real name. An existing file is replaced only with
``overwrite=True`` (``--overwrite``, or the run's own checkpoints, metrics.jsonl, model.pt); one that appears while
the work runs is kept (``OutputExists``). Only a SIGKILL, which cannot be held, may leave a temporary behind.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

# What ends a command or a run early; a write in progress holds them off until it is whole.
STOPPING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
OVERWRITE_FLAG = "--overwrite"
TEMPORARY_PREFIX = ".tmp-"  # checkpoint pruning deletes what starts with it: leftovers of killed writes


class OutputExists(FileExistsError):
    def __init__(self, path: Path) -> None:
        message = (
            f"{path} appeared while this command ran (another process wrote it); it was kept, and this "
            f"command's result was not written. Pass {OVERWRITE_FLAG} to replace it"
        )
        super().__init__(errno.EEXIST, message, str(path))

    def __str__(self) -> str:
        return self.strerror


def nearest_existing(path: Path) -> Path:
    """``path`` or its closest existing parent; a link to nothing counts as there (it holds the name)."""
    # os.path's answers are False, not an exception, for a name under a file or in a folder one cannot read.
    return next((folder for folder in (path, *path.parents) if os.path.lexists(folder)), Path("."))


def not_a_folder(path: Path) -> str:
    """What stands where a folder should be, for a message: a file, or a link to nothing."""
    if os.path.islink(path) and not os.path.exists(path):
        return f"is a link to {os.readlink(path)}, which does not exist, not a folder"
    return "is a file, not a folder"


def creation_failure(folder: Path, make_folders: bool) -> str | None:
    """Why nothing can be created in the existing ``folder``, found by trying (access() says yes to root on /proc
    and on many mounts where creating then fails); None if it can."""
    probe = folder / f"{TEMPORARY_PREFIX}probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        if make_folders:
            probe.mkdir()
            probe.rmdir()
        else:
            os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            probe.unlink()
    except OSError as err:
        return err.strerror or str(err)
    return None


def name_max(folder: Path) -> int:
    """The longest name, in bytes, that the file system holding ``folder`` (or its nearest existing parent) allows."""
    try:
        return os.pathconf(nearest_existing(folder), "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255  # where the file system does not say


def temporary_beside(path: Path) -> Path:
    """``.tmp-STEM.UNIQUE.SUFFIX`` beside ``path``, made empty so that no other writer takes it. It keeps the suffix
    (matplotlib picks the format by it); the stem, then the suffix, is cut so any name the file system allows works."""
    room = name_max(path.parent)
    while True:
        unique = f"{os.getpid()}.{secrets.token_hex(4)}"
        suffix = path.suffix if len(os.fsencode(f"{TEMPORARY_PREFIX}.{unique}{path.suffix}")) <= room else ""
        stem_room = room - len(os.fsencode(f"{TEMPORARY_PREFIX}.{unique}{suffix}"))
        stem = os.fsdecode(os.fsencode(path.name.removesuffix(suffix))[: max(stem_room, 0)])
        temporary = path.with_name(f"{TEMPORARY_PREFIX}{stem}.{unique}{suffix}")
        try:
            os.close(os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # umask applies, as for open()
        except FileExistsError:
            continue
        return temporary


@contextmanager
def signals_held() -> Iterator[None]:
    """Stopping signals wait for the end of the block: a stop between two steps that belong together (a
    temporary made and remembered, two files of a pair renamed) would leave one done and the other not."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOPPING_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a signal that came meanwhile is handled now


def publish(temporary: Path, path: Path, overwrite: bool) -> None:
    """Give the complete ``temporary`` the name ``path`` in one step; without ``overwrite``, never over a file."""
    if overwrite:
        os.replace(temporary, path)
        return
    try:
        os.link(temporary, path)  # fails, atomically, if the name is taken: no window for another writer
    except FileExistsError:
        raise OutputExists(path) from None
    except OSError as err:
        # Where a hard link cannot be made: a check, then a rename.
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        if os.path.lexists(path):
            raise OutputExists(path) from None
        os.replace(temporary, path)


def write_outputs(writes: Sequence[tuple[Path, Callable[[IO[bytes]], None]]], overwrite: bool) -> None:
    """Make each ``path`` hold what its ``write`` writes to the binary file it is given, or leave them all as they were
    (a token file and its metadata belong together). Each is written whole under its temporary and flushed (``fill``),
    in order (a later ``write`` may use what an earlier one found), before any takes its name; the renames run with
    stopping signals held. Parent folders are made, and removed again on a failure."""
    temporaries: list[Path] = []
    made: list[Path] = []  # deepest first
    linked: list[Path] = []  # by this call's hard links (never over a file): half a group is not kept
    try:
        for path, write in writes:
            made += [part for part in (path.parent, *path.parent.parents) if not os.path.lexists(part)]
            path.parent.mkdir(parents=True, exist_ok=True)
            with signals_held():
                temporaries.append(temporary_beside(path))
            fill(temporaries[-1], write)
        with signals_held():
            for temporary, (path, _) in zip(temporaries, writes, strict=True):
                publish(temporary, path, overwrite)
                if not overwrite:
                    linked.append(path)
            linked.clear()  # the group is whole
            made.clear()  # they hold the outputs now
    finally:
        with signals_held():
            for path in linked:
                path.unlink(missing_ok=True)
            for temporary in temporaries:
                remove_temporary(temporary)
            for folder in made:
                with suppress(OSError):  # something else filled it meanwhile
                    folder.rmdir()


def remove_temporary(temporary: Path) -> None:
    """Remove a temporary (after a hard link the output keeps the data under its own name); if its folder no
    longer lets it (made read-only meanwhile), say where it stays, rather than hide the write's own error."""
    try:
        temporary.unlink(missing_ok=True)
    except OSError as err:
        print(f"warning: {temporary} stays ({err.strerror}): delete it once its folder can be written", file=sys.stderr)


def fill(temporary: Path, write: Callable[[IO[bytes]], None]) -> None:
    """``write`` into ``temporary``, then flushed to the disk."""
    with temporary.open("r+b") as file:
        try:
            write(file)
        except Exception as err:
            underlying = failure_behind(err)
            if underlying is None:
                raise
            raise underlying from None
        file.flush()
        os.fsync(file.fileno())


def failure_behind(err: Exception) -> BaseException | None:
    """What ``err`` was raised while handling, where that is the real story: a stop (a signal's exception, Ctrl-C)
    first, else the system's error; None if neither. torch.save closes its archive however its block ends, so a
    stop or an ENOSPC mid-write comes out as the archive's RuntimeError ('enforce fail ... unexpected pos')."""
    chain = []
    seen = err.__context__
    while seen is not None:
        chain.append(seen)
        seen = seen.__context__
    stop = next((cause for cause in chain if not isinstance(cause, Exception)), None)
    system = next((cause for cause in chain if isinstance(cause, OSError)), None)
    return stop or (system if not isinstance(err, OSError) else None)


def write_text(path: Path, text: str, overwrite: bool) -> None:
    write_outputs([(path, lambda file: file.write(text.encode("utf-8")))], overwrite)


def write_by_name(path: Path, write: Callable[[str], Any], overwrite: bool) -> None:
    """``write_outputs`` of one file, for a writer that takes its name, not a file (a profiler's trace, a figure)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with signals_held():
        temporary = temporary_beside(path)
    try:
        write(str(temporary))
        with temporary.open("rb") as file:
            os.fsync(file.fileno())
        publish(temporary, path, overwrite)
    finally:
        remove_temporary(temporary)


def save_torch(obj: Any, path: Path, overwrite: bool) -> None:
    import torch  # here, so that commands that save no tensors do not pay for importing torch

    write_outputs([(path, lambda file: torch.save(obj, file))], overwrite)


def rename_into_place(temporary: Path, path: Path) -> None:
    """A file or folder completed under ``temporary`` takes the name ``path`` (a folder must be empty or absent)."""
    os.replace(temporary, path)


def open_log(path: Path, append: bool) -> IO[str]:
    """A log that grows a line at a time (metrics.jsonl, a child's output), so it cannot be renamed into place
    whole: a reader follows it, and leaves out a line cut short by a kill. This run's own file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("a" if append else "w", encoding="utf-8")


def holds_something(folder: Path) -> bool:
    """``folder`` exists and is not an empty folder."""
    return os.path.lexists(folder) and (not os.path.isdir(folder) or any(folder.iterdir()))


@contextmanager
def output_folder(path: Path, overwrite: bool, replaceable: Callable[[Path], bool]) -> Iterator[Path]:
    """A fresh temporary folder beside ``path`` to fill; it becomes ``path`` if the block completes. An earlier
    ``path`` is replaced only with ``overwrite`` where ``replaceable`` allows (else ``OutputExists``), and only
    once the new one is complete: a failure leaves it as it was."""
    path = path.absolute()  # a child that runs elsewhere (torchrun from the repository) fills the same folder
    path.parent.mkdir(parents=True, exist_ok=True)
    with signals_held():
        temporary = temporary_beside(path)
        temporary.unlink()
        temporary.mkdir()
    try:
        yield temporary
        if holds_something(path) and (not overwrite or not replaceable(path)):
            raise OutputExists(path)
        replace_folder(temporary, path)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def replace_folder(new: Path, path: Path) -> None:
    """``new`` takes the name ``path``; what was there is moved aside first and deleted last."""
    if not os.path.lexists(path):
        os.replace(new, path)
        return
    old = temporary_beside(path)
    old.unlink()
    os.replace(path, old)
    try:
        os.replace(new, path)
    except BaseException:
        with suppress(OSError):
            os.replace(old, path)  # put the earlier one back rather than leave nothing
        raise
    if old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)
