"""Two gloo ranks reach one of common.distributed's agreements, rank 1 late with bad news; each writes its answer.

    tests/harness/late_agreement.py --case stop|checkpoint --run-dir RUN_DIR   (2 ranks: the warm launcher, or torchrun)

  stop        rank 1 got SIGUSR1 before the first step; each rank asks ``StopRequest.requested()`` at three
              steps. The answer sent at a step is read at the next, so both must say [False, True, True].
  checkpoint  rank 1 cannot write its shards of a sharded ``Checkpointer.save`` (ENOSPC once DCP's collectives
              are done); both must refuse the checkpoint (FatalError "could not write checkpoint") and leave
              no complete one in RUN_DIR.

Why a real backend: on torch's fake process group a collective returns at once and changes nothing, so an
agreement read before its all-reduce completes reads the same as one read after. Here rank 1 enters the
exchange only once rank 0 can no longer go on without it: rank 0 is waiting for it (``Work.wait``), has
reached a barrier, or has read its answer without waiting. The order goes through torchrun's store
(``store.wait`` on a key rank 0 sets), so no sleep decides it: an agreement that is not waited for reads
rank 0's own flag every time.

Each rank writes RUN_DIR/answers-rank{RANK}.json: {"answers": [...]} (stop) or {"answer": "..."} (checkpoint).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from common.checkpoint import Checkpointer
from common.distributed import DistContext, FatalError, StopRequest, distributed, generation_store
from common.run_dir import PREEMPTED_FILE, STOP_FILE

LATE_RANK = 1
RANK_0_CANNOT_GO_ON = "rank-0-cannot-go-on-alone"
STEPS = 3
TIMEOUT_S = 30.0


class RankZeroSignals:
    """On rank 0, once armed: sets the store's key when rank 0 starts to wait for an exchange or reaches a barrier,
    the points past which it cannot go without rank 1. ``release()`` sets it by hand (an answer read without
    waiting). Observes only: each collective runs as it would."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store
        self.armed = False
        all_reduce, barrier = dist.all_reduce, dist.barrier

        def observed_all_reduce(*args: Any, **kwargs: Any) -> Any:
            work = all_reduce(*args, **kwargs)
            return _Announcing(work, self) if kwargs.get("async_op") else work

        def observed_barrier(*args: Any, **kwargs: Any) -> Any:
            self.blocking()
            return barrier(*args, **kwargs)

        dist.all_reduce, dist.barrier = observed_all_reduce, observed_barrier

    def blocking(self) -> None:
        if self.armed:
            self.release()

    def release(self) -> None:
        self.store.set(RANK_0_CANNOT_GO_ON, "1")


class _Announcing:
    """A collective's Work whose wait (or future) tells rank 1 that rank 0 waits."""

    def __init__(self, work: dist.Work, signals: RankZeroSignals) -> None:
        self._work, self._signals = work, signals

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._signals.blocking()
        return self._work.wait(*args, **kwargs)

    def get_future(self) -> Any:
        self._signals.blocking()
        return self._work.get_future()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def wait_for_rank_0(store: dist.Store) -> None:
    store.wait([RANK_0_CANNOT_GO_ON])


def stop_case(ctx: DistContext, run_dir: Path, store: dist.Store, signals: RankZeroSignals | None) -> dict:
    stop = StopRequest(run_dir / STOP_FILE, run_dir / PREEMPTED_FILE, ctx)
    answers = []
    if ctx.rank == LATE_RANK:
        os.kill(os.getpid(), signal.SIGUSR1)  # a stop request on this rank alone: the handler sets a flag
        wait_for_rank_0(store)
    for step in range(1, STEPS + 1):
        if signals is not None and step == 2:
            signals.armed = True  # step 2 reads step 1's answers: the exchange rank 1 is late for
        answers.append(stop.requested())
        if signals is not None and step == 2:
            signals.release()  # read without waiting: rank 1 may come now
    stop.settle()
    return {"answers": answers}


def failing_shard_write(store: dist.Store, signals: RankZeroSignals | None) -> None:
    """dcp.save as it runs, but on rank 1 its write fails once the collectives are done, and only after rank 0 has
    gone as far as it can alone; rank 0 is armed as soon as its own save is done."""
    save = dcp.save

    def save_then(*args: Any, **kwargs: Any) -> Any:
        result = save(*args, **kwargs)
        if signals is not None:
            signals.armed = True
            return result
        wait_for_rank_0(store)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "a shard of rank 1")

    dcp.save = save_then


def checkpoint_case(ctx: DistContext, run_dir: Path, store: dist.Store, signals: RankZeroSignals | None) -> dict:
    model = torch.nn.Linear(4, 2)
    checkpoints = Checkpointer(
        ctx, run_dir, model=model, optimizer=torch.optim.AdamW(model.parameters()), extra={},
        identity={"model": "a test"}, strategy="ddp", settings={}, global_batch_size=1, sharded=True,
        interval=0, keep=1, check_before_save=lambda step: None,
    )  # fmt: skip
    failing_shard_write(store, signals)
    try:
        path = checkpoints.save(STEPS, force=True)
    except FatalError as err:
        return {"answer": "refused", "message": str(err)}
    finally:
        if signals is not None:
            signals.release()
    return {"answer": f"saved {path}"}


CASES: dict[str, Callable[[DistContext, Path, dist.Store, RankZeroSignals | None], dict]] = {
    "stop": stop_case,
    "checkpoint": checkpoint_case,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", choices=CASES, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    args, _ = parser.parse_known_args()  # run_warm's --device and --dist-timeout mean nothing here
    case, run_dir = args.case, args.run_dir
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # A client of torchrun's store of its own, beside the process group's, under a prefix of its own.
    store = dist.PrefixStore("late-agreement", generation_store(rank, world_size, timedelta(seconds=TIMEOUT_S)))
    signals = RankZeroSignals(store) if rank == 0 else None
    answer: dict = {"answer": "none: the case ended in an error (the output has it)"}
    try:
        with distributed("cpu", TIMEOUT_S) as ctx:
            answer = CASES[case](ctx, run_dir, store, signals)
    finally:
        (run_dir / f"answers-rank{rank}.json").write_text(json.dumps(answer))


if __name__ == "__main__":
    main()
