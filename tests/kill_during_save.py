"""Run a training script under torchrun, but SIGKILL rank 1 in the middle of its second checkpoint save.

    torchrun --standalone --nproc_per_node=2 tests/kill_during_save.py fsdp/train_transformer_fsdp2.py ARGS

Rank 1 dies after writing its shards and before the checkpoint is complete:
what a node failure or an out-of-memory kill during a save looks like.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

import torch.distributed.checkpoint as dcp

real_save = dcp.save
saves = 0


def save_then_die(*args: object, **kwargs: object) -> object:
    global saves
    saves += 1
    result = real_save(*args, **kwargs)
    if saves == 2 and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return result


dcp.save = save_then_die
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
