"""Run a training script with a fault injected into rank 1, the way real jobs fail.

    torchrun --standalone --nproc_per_node=2 tests/harness/inject_fault.py FAULT SCRIPT [FLAGS...]

FAULT is one of:
  kill-mid-save  SIGKILL during the second checkpoint save, after writing its shards and
                 before the checkpoint is complete (a node failure or an OOM kill mid-save)
  kill-in-background-save
                 SIGKILL in the thread that writes the fifth checkpoint of an --async-checkpoint
                 run, after writing its shards, while the training steps go on
  slow-disk      on every rank, each write of an --async-checkpoint run waits for the optimizer step after
                 it began (or for the run to wait for it): a disk slower than a step, so that every
                 step changes the parameters under a checkpoint being written; slow-disk+FAULT adds
                 FAULT
  raise          an exception at optimizer step 3 (a bug that only one rank hits)
  sigkill        SIGKILL at optimizer step 3 (a process the kernel kills)
  sigkill-once   the same, in the first generation of workers only: torchrun --max-restarts
                 starts a second one (TORCHELASTIC_RESTART_COUNT=1) that runs untouched
  nan            a NaN loss at step 3 (a diverging run)
  overflow       an infinite weight right after optimizer step 3 (an update that overflowed: the
                 loss of step 3, computed before it, is still finite)
  fill-disk@S[,leave=K]
                 rank 0 fills the file system of --run-dir after optimizer step S, leaving K KiB
                 free (default 0): every later write meets the kernel's own ENOSPC. Refused on a
                 file system over 1 GiB, so that it only ever fills the small tmpfs a test mounts.
Ranks other than 1 (0 for fill-disk) run the script untouched.
"""

from __future__ import annotations

import errno
import os
import re
import runpy
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

FAULTY_RANK = "1"
FAULTY_STEP = 3
BACKGROUND_SAVE_KILLED = 5


def on_call(function: Callable[..., Any], call: int, fault: Callable[[Any], Any]) -> Callable[..., Any]:
    """``function``, except that its ``call``-th call passes its result through ``fault``."""
    calls = 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        result = function(*args, **kwargs)
        return fault(result) if calls == call else result

    return wrapper


def die(_: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def fail(_: object) -> None:
    raise RuntimeError(f"injected failure on rank {FAULTY_RANK} at step {FAULTY_STEP}")


SMALL_DISK = 2**30
FILL_DISK = re.compile(r"^fill-disk@(\d+)(?:,leave=(\d+))?$")


def fill_disk(folder: Path, leave_bytes: int) -> None:
    """Write zeros beside ``folder`` until its file system is full, then give back ``leave_bytes``."""
    stats = os.statvfs(folder)
    if stats.f_blocks * stats.f_frsize > SMALL_DISK:
        raise SystemExit(f"fill-disk: {folder} is on a file system over 1 GiB; not filling it")
    filler = folder.parent / "filler"
    with filler.open("wb") as file:
        chunk = bytes(2**16)
        try:
            while True:
                file.write(chunk)
                file.flush()
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
    os.truncate(filler, max(0, filler.stat().st_size - leave_bytes))


def slow_disk() -> None:
    """Background writes that start only once the training has moved on: after the next optimizer step, or when
    the run waits for the write (the last save has no next step)."""
    from common.async_checkpoint import BackgroundSave

    moved_on = threading.Condition()
    steps, waiting = 0, False

    def after_step(step: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            nonlocal steps
            result = step(*args, **kwargs)
            with moved_on:
                steps += 1
                moved_on.notify_all()
            return result

        return wrapper

    def waited_for(wait: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            nonlocal waiting
            with moved_on:
                waiting = True
                moved_on.notify_all()
            try:
                return wait(*args, **kwargs)
            finally:
                with moved_on:
                    waiting = False

        return wrapper

    def held(write: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with moved_on:
                began = steps
                moved_on.wait_for(lambda: steps > began or waiting)
            return write(*args, **kwargs)

        return wrapper

    torch.optim.AdamW.step = after_step(torch.optim.AdamW.step)  # type: ignore[method-assign]
    BackgroundSave.wait = waited_for(BackgroundSave.wait)  # type: ignore[method-assign]
    dcp.FileSystemWriter.write_data = held(dcp.FileSystemWriter.write_data)  # type: ignore[method-assign]


def run_dir_of(argv: list[str]) -> Path:
    return Path(argv[argv.index("--run-dir") + 1])


def overflow_after(step: Callable[..., Any], call: int) -> Callable[..., Any]:
    """``optimizer.step``, except that its ``call``-th call leaves the first weight this rank holds infinite."""
    calls = 0

    def wrapper(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        result = step(optimizer, *args, **kwargs)
        if calls == call:
            weight = next(p for group in optimizer.param_groups for p in group["params"] if p.numel() > 0)
            with torch.no_grad():
                weight.view(-1)[0] = float("inf")
        return result

    return wrapper


def main() -> None:
    fault, script = sys.argv[1], sys.argv[2]
    if fault.startswith("slow-disk"):  # alone, or with another fault: slow-disk+nan
        slow_disk()
        fault = fault.removeprefix("slow-disk").removeprefix("+")
    disk = FILL_DISK.match(fault)
    if disk and os.environ.get("RANK", "0") == "0":
        step, leave_kib = int(disk.group(1)), int(disk.group(2) or 0)
        folder = run_dir_of(sys.argv)
        folder.mkdir(parents=True, exist_ok=True)
        for optimizer in (torch.optim.AdamW, torch.optim.Adadelta):
            optimizer.step = on_call(optimizer.step, step, lambda _: fill_disk(folder, leave_kib * 1024))
    elif disk:
        pass
    elif fault and os.environ.get("RANK") == FAULTY_RANK:
        if fault == "kill-mid-save":
            dcp.save = on_call(dcp.save, 2, die)
        elif fault == "kill-in-background-save":
            writer = dcp.FileSystemWriter
            writer.write_data = on_call(writer.write_data, BACKGROUND_SAVE_KILLED, die)  # type: ignore[method-assign]
        elif fault == "sigkill-once" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            pass
        elif fault in ("raise", "sigkill", "sigkill-once"):
            # The optimizer's step is where every script ends a training step.
            torch.optim.AdamW.step = on_call(torch.optim.AdamW.step, FAULTY_STEP, fail if fault == "raise" else die)
        elif fault == "overflow":
            torch.optim.AdamW.step = overflow_after(torch.optim.AdamW.step, FAULTY_STEP)
        elif fault == "nan":
            F.cross_entropy = on_call(F.cross_entropy, FAULTY_STEP, lambda loss: loss * float("nan"))
        else:
            raise SystemExit(f"unknown fault {fault!r}")
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
