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
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from common.checkpoint import Checkpointer
from common.distributed import DistContext, StopRequest, distributed
from common.run_dir import PREEMPTED_FILE, STOP_FILE, complete_checkpoints

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
        check_before_save=lambda step: None,  # nothing to check: no loss was ever taken
    )


@pytest.mark.parametrize("number", STOP_SIGNALS, ids=[number.name for number in STOP_SIGNALS])
def test_a_stop_signal_ends_the_run_with_a_checkpoint(
    number: signal.Signals, default_action_caught: list[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exit_info, distributed("cpu", 60) as ctx:
        checkpoints = tiny_checkpointer(ctx, tmp_path)
        stop = StopRequest(tmp_path / STOP_FILE, tmp_path / PREEMPTED_FILE, ctx)
        assert not stop.requested()
        os.kill(os.getpid(), number)  # os.kill runs the handler before it returns
        assert not default_action_caught, f"{number.name} would have killed the run, with no checkpoint"
        assert stop.requested(), f"{number.name} was handled but asked for no stop"
        stop.exit(STEP, checkpoints.save(STEP, force=True))  # the scripts' loop: checkpoint, then exit
    assert exit_info.value.code == 0
    (checkpoint,) = complete_checkpoints(tmp_path)
    marker = json.loads((tmp_path / "PREEMPTED").read_text())
    assert marker == {"step": STEP, "checkpoint": str(checkpoint), "reason": number.name}


def test_the_ranks_answers_travel_during_a_step_and_every_rank_stops_one_step_after_the_request(
    tmp_path: Path,
) -> None:
    """Rank 0 of a world of 2 (torch's fake backend: a collective returns at once and leaves this rank's
    tensor as it was, so each answer read is the one this rank sent). The step after the STOP file
    appears only sends the request; the step after that reads it back and stops. No step waits for the
    exchange it started, and before the run leaves, the last exchange is read (``settle``). Whether every rank
    reads the same answer needs a real backend: tests/test_agreements.py."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        ctx = DistContext(0, 0, 2, 2, torch.device("cpu"), "fake")
        stop = StopRequest(tmp_path / STOP_FILE, tmp_path / PREEMPTED_FILE, ctx)
        assert not stop.requested()
        (tmp_path / "STOP").touch()
        assert not stop.requested(), "the answers of the step just begun cannot be known yet"
        assert stop.requested()
        assert stop.answers is not None, "each step sends its own answers"
        stop.settle()
        assert stop.answers is None
    finally:
        dist.destroy_process_group()
