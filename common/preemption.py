"""Stopping cleanly when asked: a scheduler's warning signal or a STOP file in the run directory.

Clusters end jobs at their time limit or to make room for others, usually
after a warning: SLURM sends a signal a set time ahead (the launchers in
slurm/ turn it into a STOP file), and torchrun passes SIGTERM on to its
workers. The training loop checks between steps; all ranks agree, save a
checkpoint, leave a PREEMPTED marker and exit, and ``--resume`` continues.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import NoReturn

from common.distributed import DistContext, all_ranks_agree, print0
from common.outputs import write_text
from common.run_dir import STOP_FILE

PREEMPTED_FILE = "PREEMPTED"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Ctrl-C, and a terminal that closes: a stop request too, unless the run was started with them ignored
# (nohup, a background job). A second one does what it would have done: it does not wait for the step.
SECOND_TIME_STOPS_AT_ONCE = {signal.SIGINT: signal.default_int_handler, signal.SIGHUP: signal.SIG_DFL}


class StopRequest:
    """Notices a stop request and makes every rank act on it at the same step."""

    def __init__(self, run_dir: Path, ctx: DistContext) -> None:
        self.ctx = ctx
        self.stop_file = run_dir / STOP_FILE
        self.marker = run_dir / PREEMPTED_FILE
        self.received: str | None = None
        for number in STOP_SIGNALS:
            signal.signal(number, self._on_signal)
        for number in SECOND_TIME_STOPS_AT_ONCE:
            if signal.getsignal(number) is not signal.SIG_IGN:
                signal.signal(number, self._on_signal)
        if ctx.is_main:
            # The marker describes the run this one continues. A STOP file stays: it may have come
            # while this run was starting, and then it is meant for this run. The launchers in slurm/
            # clear a stale one before they start a job, since only they know where a job begins.
            self.marker.unlink(missing_ok=True)

    def _on_signal(self, number: int, frame: object) -> None:
        # Only a flag. Checkpointing inside the handler would run in the middle of
        # whatever was interrupted (a collective, a half-done step) and can hang.
        self.received = signal.Signals(number).name
        if number in SECOND_TIME_STOPS_AT_ONCE:
            signal.signal(number, SECOND_TIME_STOPS_AT_ONCE[number])

    def requested(self) -> bool:
        """True on every rank if any rank got a signal or rank 0 sees the STOP file.

        A collective, so every rank must call it at the same step. It reads no GPU value.
        """
        # Only rank 0 looks at the file: one stat per step instead of one per rank.
        asked = self.received is not None or (self.ctx.is_main and self.stop_file.exists())
        # On the host group (CPU tensors, gloo): the GPU's queue of work is neither read nor waited for.
        return not all_ranks_agree(not asked, self.ctx)

    def exit(self, step: int, checkpoint: Path) -> NoReturn:
        """Leave the PREEMPTED marker and end this process (exit code 0: nothing failed)."""
        reason = self.received or ("a STOP file" if self.stop_file.exists() else "a signal to another rank")
        if self.ctx.is_main:
            marker = {"step": step, "checkpoint": str(checkpoint), "reason": reason}
            write_text(self.marker, json.dumps(marker) + "\n", overwrite=True)  # this run's own
            self._remove_stop_file()
        print0(f"stopped at step {step} on request ({reason}); checkpoint {checkpoint}. Continue with --resume.")
        sys.exit(0)

    def _remove_stop_file(self) -> None:
        """Remove the STOP that was obeyed, so the next run does not stop too; a `mkdir STOP` asks as `touch` does."""
        try:
            if self.stop_file.is_dir():
                self.stop_file.rmdir()
            else:
                self.stop_file.unlink(missing_ok=True)
        except OSError as err:  # a folder with something in it: its contents are not this run's to delete
            print0(f"warning: could not remove {self.stop_file} ({err.strerror}); remove it, or the next run stops")
