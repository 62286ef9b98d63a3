"""Run a training script, and hold it still after its optimizer step 5: once per run directory.

    sbatch slurm/ddp.sbatch tests/harness/pause_once.py ddp/train_transformer.py [FLAGS...]

A test that preempts or cancels a job mid-run waits for the trainers to stop themselves (SIGSTOP),
then acts: however fast the steps go, the job is still at step 5 with most of its steps ahead. A
test that stopped them from outside, on seeing step 5 in the log, raced them (one process ran the
rest of 200 steps first). Slurm sends SIGCONT before it signals a job, so preemption and scancel
wake them. A resumed run, finding the marker in its run directory, does not stop again.

The SLURM launchers put ``--run-dir DIR --resume`` right after the program they run, so the script
is the first argument ending in .py, and every other argument is its flag.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from inject_fault import on_call  # beside this file: the folder python puts first on sys.path

PAUSE_AFTER_STEP = 5
MARKER = ".paused-once"


def hold_still_once(marker: Path) -> Callable[[Any], Any]:
    """What the step's result passes through: the first time for this marker, SIGSTOP to this process."""

    def hold(result: Any) -> Any:
        if not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGSTOP)
        return result

    return hold


def main() -> None:
    arguments = sys.argv[1:]
    script = next(argument for argument in arguments if argument.endswith(".py"))
    flags = [argument for argument in arguments if argument is not script]
    run_dir = Path(flags[flags.index("--run-dir") + 1])
    run_dir.mkdir(parents=True, exist_ok=True)
    marker = run_dir / f"{MARKER}-rank{os.environ.get('RANK', '0')}"
    step = torch.optim.AdamW.step
    torch.optim.AdamW.step = on_call(step, PAUSE_AFTER_STEP, hold_still_once(marker))  # type: ignore[method-assign]
    sys.argv = [script, *flags]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
