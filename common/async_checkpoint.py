"""A sharded checkpoint written while training goes on (--async-checkpoint, docs/checkpoints.md).

``dcp.async_save`` first copies the state off the model and optimizer (staging, while the step waits: the next
optimizer step changes those tensors in place), then writes the copy from a thread of its own. That thread meets the
other ranks over a gloo group that nothing else uses: on a group that training's collectives also use, the save hung
(torch 2.14.1, gloo), and no other call may meet that thread's collectives there. Rank 0 renames the folder into place
once DCP has written its metadata, so a checkpoint is complete as soon as it is written, and never before.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.utils._pytree import tree_leaves, tree_map_only

from common.outputs import replace_folder


class CloneStager(BlockingAsyncStager):
    """On the CPU, a clone of each tensor: a third of the time torch's stager takes to build a new state dict and
    copy into it (the tiny preset under FSDP2: 7 against 25 ms a save, torch 2.14.1), which the step waits for.
    FSDP1's ShardedTensors and a GPU's tensors go to torch's stager (on a GPU: into page-locked host memory)."""

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        tensors = tree_leaves(state_dict)
        if self.cache_staged_state_dict or any(isinstance(leaf, ShardedTensor) for leaf in tensors):
            return super().stage(state_dict)
        return tree_map_only(torch.Tensor, lambda tensor: tensor.detach().clone(), state_dict)


class BackgroundSave:
    """At most one checkpoint in flight per process. Every rank makes one, together (it creates a process group)."""

    in_flight: BackgroundSave | None = None  # the one a failed run's teardown still waits for

    def __init__(self, device: torch.device) -> None:
        self.group = dist.new_group(backend="gloo")  # DISTRIBUTED: the writing thread's own, used by nothing else
        # The copy is made here, while the step waits (the next optimizer step changes those tensors in place): of
        # every tensor, on the CPU too (pytorch#144657: an async save of CPU tensors once wrote later steps' values).
        # On a GPU, one page-locked host copy kept for every save: it moves off the GPU faster, and one save is in
        # flight at most.
        self.stager = CloneStager(cache_staged_state_dict=device.type == "cuda")
        self.path: Path | None = None  # the checkpoint being written, under its final name
        self.written = threading.Event()
        self.failure: BaseException | None = None

    def start(self, state: dict[str, Any], temporary: Path, path: Path, renames: bool) -> None:
        """Stage ``state`` (the step waits for that copy), then write it into ``temporary`` in the background; rank 0
        (``renames``) moves it to ``path`` once every rank's shards and DCP's metadata are on disk."""
        self.path, self.failure = path, None
        self.written.clear()
        upload = dcp.async_save(state, checkpoint_id=temporary, process_group=self.group, async_stager=self.stager)
        BackgroundSave.in_flight = self
        upload.add_done_callback(lambda done: self._finish(done, (temporary, path) if renames else None))

    def _finish(self, upload: Future, rename: tuple[Path, Path] | None) -> None:
        """In the writing thread, once DCP is done: the rename into place where it succeeded, on rank 0."""
        try:
            upload.result()
            if rename is not None:
                replace_folder(*rename)  # a step-N of an abandoned run that went further is replaced
        except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is one; the waiter reports it
            self.failure = err
        finally:
            self.written.set()

    def wait(self) -> Path | None:
        """The checkpoint in flight, once written (None if there is none); raises what stopped this rank's part."""
        path, self.path = self.path, None
        if path is None:
            return None
        self.written.wait()
        BackgroundSave.in_flight = None
        if self.failure is not None:
            raise self.failure
        return path


def finish_in_flight() -> str | None:
    """Before the process groups go (a run that failed): the background write to its end, and one line on it."""
    save = BackgroundSave.in_flight
    if save is None or save.path is None:
        return None
    path = save.path
    try:
        save.wait()
    except BaseException as err:  # noqa: BLE001 - reported, the run's own failure goes on
        return f"the checkpoint being written, {path}, is incomplete: {err}"
    return f"the checkpoint being written when the run failed, {path}, is complete"
