"""The run directory: what it holds, under which names (no other module spells them), and the one run that writes it.

RUN_DIR/
    metrics.jsonl       METRICS_FILE: one JSON record a line, the run's whole story
    model.pt            MODEL_FILE: the final weights, a plain state dict
    hf/                 PRETRAINED_DIR: a Hugging Face model's final model as a save_pretrained folder too
    checkpoints/        CHECKPOINTS: step-N.pt (one file) or step-N/ (a sharded DCP folder)
    profile/            PROFILE_DIR: --profile's traces, one file a rank
    tensorboard/        TENSORBOARD_DIR: --tensorboard's event files, metrics.jsonl's numbers as TensorBoard scalars
    STOP                STOP_FILE: made by a user, asks the run to checkpoint and exit (distributed.StopRequest)
    PREEMPTED           PREEMPTED_FILE: left by a run that stopped on request: its step and checkpoint
    .lock               LOCK_FILE: held by the run that writes this folder (RunDirLock)
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from common.flags import output_dir
from common.outputs import TEMPORARY_PREFIX, rename_into_place

if TYPE_CHECKING:
    from common.distributed import DistContext

METRICS_FILE = "metrics.jsonl"
MODEL_FILE = "model.pt"
CHECKPOINTS = "checkpoints"
PROFILE_DIR = "profile"
TENSORBOARD_DIR = "tensorboard"
STOP_FILE = "STOP"
LOCK_FILE = ".lock"
PREEMPTED_FILE = "PREEMPTED"
PRETRAINED_DIR = "hf"
RUN_RESULTS = (METRICS_FILE, MODEL_FILE, PRETRAINED_DIR)  # what a run leaves in its run dir besides checkpoints
CHECKPOINT_NAME = re.compile(r"^step-(\d+)(\.pt)?$")
NO_LOCKS_HERE = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP}  # Lustre without -o flock, some FUSE mounts


def checkpoint_step(path: Path) -> int | None:
    """N for a checkpoint named step-N or step-N.pt; None for anything else."""
    match = CHECKPOINT_NAME.match(path.name)
    return int(match.group(1)) if match else None


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Every complete checkpoint in the run directory, oldest first."""
    folder = run_dir / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [path for path in folder.iterdir() if checkpoint_step(path) is not None]
    return sorted(found, key=checkpoint_step)  # type: ignore[arg-type]


def prune_checkpoints(run_dir: Path, newest: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints up to ``newest``; delete leftovers of killed saves. Called only
    with no save in flight (common.checkpoint waits for a background one first), so its folder is never one of them."""
    folder, step = run_dir / CHECKPOINTS, checkpoint_step(newest)
    older = [path for path in complete_checkpoints(run_dir) if checkpoint_step(path) < step]  # type: ignore[operator]
    doomed = older[: max(0, len(older) - (keep - 1))]
    doomed += [path for path in folder.iterdir() if path.name.startswith(TEMPORARY_PREFIX)]
    for path in doomed:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def set_aside_newer_than(run_dir: Path, resumed: Path) -> str | None:
    """The checkpoints of ``run_dir`` newer than ``resumed``, one of its own, moved to RUN_DIR/abandoned/: a resume
    from an older one starts another branch, and neither a later --resume nor pruning may take them for its own.
    They are never deleted. What moved, said in a line; None if nothing did."""
    step = checkpoint_step(resumed)
    newer = [path for path in complete_checkpoints(run_dir) if checkpoint_step(path) > step]  # type: ignore[operator]
    if not newer:
        return None
    aside = run_dir / "abandoned" / f"after-step-{step}"
    tries = 1
    while aside.exists():
        tries += 1
        aside = aside.with_name(f"after-step-{step}-{tries}")
    aside.mkdir(parents=True)
    for path in newer:
        rename_into_place(path, aside / path.name)
    names = ", ".join(path.name for path in newer)
    return (
        f"{names} went further than {resumed.name}: moved to {aside} (kept; --resume-from there goes back to that run)"
    )


def checkpoint_to_resume(run_dir: Path, resume: bool, resume_from: Path | None) -> Path | None:
    """The checkpoint a start continues: ``--resume-from``'s, or with ``--resume`` the newest complete one in
    ``run_dir``; None for a fresh start."""
    if resume_from is not None:
        return resume_from
    found = complete_checkpoints(run_dir) if resume else []
    return found[-1] if found else None


def check_run_dir(parser: argparse.ArgumentParser, run_dir: Path) -> None:
    """A --run-dir the run cannot write (the default too, which the flag's type never sees) is refused now."""
    try:
        output_dir(str(run_dir))
    except argparse.ArgumentTypeError as err:
        parser.error(f"argument --run-dir: {err}")


def check_run_dir_allows(
    parser: argparse.ArgumentParser, run_dir: Path, *, resume: bool, resume_from: Path | None
) -> None:
    """Refuse a start that would replace or mix with the run ``run_dir`` already holds; ``resume_from`` is a
    checkpoint the caller has already found to exist and to be named like one."""
    if resume_from is not None and run_dir.resolve() in resume_from.resolve().parents:
        return  # back to an earlier point of this run (its own checkpoints, or abandoned/)
    existing = complete_checkpoints(run_dir)
    results = [name for name in RUN_RESULTS if (run_dir / name).exists()]
    if resume_from is not None and (existing or results):
        parser.error(
            f"--resume-from {resume_from} is another run's checkpoint, and --run-dir {run_dir} already "
            "holds a run of its own; continuing there would mix the two. Choose a new --run-dir"
        )
    if not resume and existing:
        parser.error(
            f"--run-dir {run_dir} already holds checkpoints of an earlier run (newest: {existing[-1].name}); "
            "pass --resume to continue it, or choose another --run-dir"
        )
    # A run without checkpoints (the default --checkpoint-interval 0) leaves only these; a fresh
    # run would replace them, and one that then failed would leave neither run's record.
    if not existing and results and not resume:
        parser.error(
            f"--run-dir {run_dir} already holds an earlier run ({', '.join(results)}); a fresh run would replace "
            "it. Choose another --run-dir, or delete those files to start over"
        )
    if not existing and MODEL_FILE in results:
        parser.error(
            f"--resume: {run_dir} holds a finished run's model.pt and no checkpoint to continue from; "
            "starting over would replace it. Choose another --run-dir, or delete model.pt to start over"
        )


def holder_description() -> str:
    """Who holds the lock, for the message a second run prints."""
    job = os.environ.get("SLURM_JOB_ID")
    where = f"pid {os.getpid()} on {socket.gethostname()}" + (f", SLURM job {job}" if job else "")
    return f"{where}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"


def holder_of(fd: int) -> str:
    """What a lock file that another run holds says of that run; ``fd`` is closed."""
    holder = os.read(fd, 4096).decode(errors="replace").strip() or "it has not said who it is yet"
    os.close(fd)
    return holder


class RunDirLock:
    """``with RunDirLock(run_dir, ctx) as lock:`` refuses to run while another run holds ``run_dir``.

    Two runs on one folder would interleave metrics.jsonl and prune or replace each other's files. Rank 0 flocks
    ``RUN_DIR/.lock`` for the run's life and all ranks agree on the answer: one message, one exit on every rank.
    The kernel drops the lock however the process ends (SIGKILL and the OOM killer included), so a killed run
    never leaves the folder locked. flock() works across machines on NFS (emulated with POSIX locks) and on
    Lustre mounted with ``-o flock``; on a file system without locks the run says so once and goes on unguarded.
    """

    def __init__(self, run_dir: Path, ctx: DistContext) -> None:
        self.run_dir = run_dir
        self.path = run_dir / LOCK_FILE
        self.ctx = ctx
        self.created_run_dir = False
        self.fd: int | None = None

    def __enter__(self) -> RunDirLock:
        holder = self._acquire() if self.ctx.is_main else None
        # Imported here: the lock alone needs torch, and tools.checks.preflight's launcher reads the layout without it.
        from common.distributed import FatalError, all_ranks_agree

        if not all_ranks_agree(holder is None, self.ctx):
            raise FatalError(
                f"--run-dir {self.run_dir} is in use by another run ({holder or 'see rank 0'}): one run at a time "
                "writes a run directory. Wait for it to end, or choose another --run-dir"
            )
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.fd is None:
            return
        # A run that wrote nothing leaves nothing, not even the folder it made for the lock. Unlinked before
        # the lock goes: a run that opens the old file in between finds it replaced and tries again (_acquire).
        if [entry.name for entry in self.run_dir.iterdir()] == [LOCK_FILE]:
            self.path.unlink()
            if self.created_run_dir:
                self.run_dir.rmdir()
        os.close(self.fd)
        self.fd = None

    def _acquire(self) -> str | None:
        """Take the lock; None when taken, else what the file says of the run that holds it."""
        self.created_run_dir = not self.run_dir.exists()
        while True:
            fd = self._open_lock_file()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return holder_of(fd)
            except OSError as err:
                os.close(fd)
                if err.errno not in NO_LOCKS_HERE:
                    raise
                print(  # rank 0 alone takes the lock, so this is printed once
                    f"warning: {self.run_dir} is on a file system without locks ({err.strerror}); nothing "
                    "stops a second run from writing into it at the same time",
                    flush=True,
                )
                return None
            if self._still_the_lock_file(fd):
                break
            os.close(fd)  # locked a file that its holder had just removed; take the new one
        os.ftruncate(fd, 0)
        os.write(fd, holder_description().encode())
        self.fd = fd
        return None

    def retake_if_lost(self) -> None:
        """Lock the run dir again if this run holds its lock but the lock file left it (an rm -rf, a rename): else a
        second run finds no lock in the folder made again, and two runs write it. OSError (EBUSY) if another run
        was quicker. What writes into the run dir calls it first (common.bookkeeping.MetricsLog)."""
        if self.fd is None or self._still_the_lock_file(self.fd):
            return
        fd = self._open_lock_file()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            taken = f"another run took the run dir after it was deleted or moved under this one ({holder_of(fd)})"
            raise OSError(errno.EBUSY, taken) from None
        os.write(fd, holder_description().encode())
        os.close(self.fd)
        self.fd = fd

    def _open_lock_file(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)

    def _still_the_lock_file(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False
