"""Each stop signal asks a run to stop as a STOP file does: a checkpoint of the step it reached, a
PREEMPTED marker that names the signal, and exit code 0.

SIGTERM is what torchrun passes on to its workers and what scancel or a preemption sends; SIGUSR1 is
the warning that ``sbatch --signal=USR1@SECONDS`` sends ahead of a time limit. Left to its default
action either one ends the process at once, and everything since the last checkpoint is lost.

In process, in a world of one: the script's loop reduced to what it does with a stop request.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.bookkeeping import StopRequest
from common.checkpoint import Checkpointer
from common.distributed import DistContext, distributed
from common.run_dir import complete_checkpoints

# Listed here, not read from common.bookkeeping: a signal dropped from there must still be tried.
STOP_SIGNALS = [signal.SIGTERM, signal.SIGUSR1]
STEP = 3


@pytest.fixture
def default_action_caught() -> Iterator[list[str]]:
    """Stands in for each stop signal's default action (ending this process, pytest with it): the names of
    the signals that would have ended the run. What StopRequest installs is put back after the test."""
    numbers = (*STOP_SIGNALS, signal.SIGINT, signal.SIGHUP)
    saved = {number: signal.getsignal(number) for number in numbers}
    killed_by: list[str] = []
    for number in STOP_SIGNALS:
        signal.signal(number, lambda received, frame: killed_by.append(signal.Signals(received).name))
    yield killed_by
    for number, handler in saved.items():
        signal.signal(number, handler)


def tiny_checkpointer(ctx: DistContext, run_dir: Path) -> Checkpointer:
    """A one-layer model's full checkpoints in ``run_dir``, as a script's Checkpointer writes them."""
    model = torch.nn.Linear(4, 2)
    return Checkpointer(
        ctx,
        run_dir,
        model=model,
        optimizer=torch.optim.AdamW(model.parameters()),
        extra={},
        identity={"model": "a test"},
        strategy="ddp",
        settings={},
        global_batch_size=1,
        sharded=False,
        interval=0,
        keep=1,
    )


@pytest.mark.parametrize("number", STOP_SIGNALS, ids=[number.name for number in STOP_SIGNALS])
def test_a_stop_signal_ends_the_run_with_a_checkpoint(
    number: signal.Signals, default_action_caught: list[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exit_info, distributed("cpu", 60) as ctx:
        checkpoints = tiny_checkpointer(ctx, tmp_path)
        stop = StopRequest(tmp_path, ctx)
        assert not stop.requested()
        os.kill(os.getpid(), number)  # os.kill runs the handler before it returns
        assert not default_action_caught, f"{number.name} would have killed the run, with no checkpoint"
        assert stop.requested(), f"{number.name} was handled but asked for no stop"
        stop.exit(STEP, checkpoints.save(STEP))  # the scripts' loop: checkpoint, then exit
    assert exit_info.value.code == 0
    (checkpoint,) = complete_checkpoints(tmp_path)
    marker = json.loads((tmp_path / "PREEMPTED").read_text())
    assert marker == {"step": STEP, "checkpoint": str(checkpoint), "reason": number.name}
