"""Where this repository works around torch: what depends on its version, and its bugs.

The scripts are tested on torch 2.6 (the floor: the first release with the
public FSDP2 API, ``torch.distributed.fsdp.fully_shard``) and on the newest
torch pip resolves (2.14.1 when this was written). Each function below says
which releases need it. Where a part cannot work on an older torch, it stops
with one line that names the version it needs, before any process group starts.
"""

from __future__ import annotations

import argparse
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions

# FSDP2 on the CPU (gloo) needs torch 2.9:
# - 2.6: the first forward fails ('Stream' object has no attribute 'record_event'):
#   torch.cpu.Stream got its no-op record_event/wait_event in 2.7 (pytorch/pytorch#145935);
# - 2.7 and 2.8: gloo's reduce_scatter_tensor takes ReduceOp.AVG, which FSDP2 uses for
#   fp32 gradients, and sums: every gradient is world-size times too large, silently
#   (pytorch/pytorch#162338; checked with a 2-rank reduce-scatter on 2.6 to 2.14.1).
FSDP2_ON_CPU = (2, 9)
# FSDP2 --cpu-offload gives the mesh a CPU backend beside NCCL, through
# init_device_mesh(backend_override=...), which torch 2.9 added (pytorch/pytorch#159371).
FSDP2_CPU_OFFLOAD = (2, 9)


def torch_release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version``, by default the installed torch's (2.6.0+cu124 gives (2, 6))."""
    text = version if version is not None else torch.__version__
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:
        raise ValueError(f"not a torch version: {text!r}")
    return int(match.group(1)), int(match.group(2))


def torch_at_least(release: tuple[int, int]) -> bool:
    return torch_release() >= release


def require_torch(parser: argparse.ArgumentParser, release: tuple[int, int], feature: str) -> None:
    """Stop with one line (exit code 2, from rank 0 only) if this torch is older than ``release``.

    Called while the flags are checked, so nothing has been started or written yet.
    """
    if not torch_at_least(release):
        needed = ".".join(map(str, release))
        parser.exit(2, f"error: {feature} needs torch {needed} or newer; this is torch {torch.__version__}\n")


def full_state_dict_options(device: torch.device) -> StateDictOptions:
    """Options that gather the whole model (and optimizer) state, as plain tensors, for rank 0 to save.

    On a GPU the gathered tensors are copied to the CPU and only rank 0 keeps
    them (``cpu_offload=True``; the other ranks get empty dicts). A CPU run has
    nothing to offload: every rank gathers the full state in host memory, and
    the ranks other than 0 drop it.
    """
    # Not only pointless on a CPU run: FSDP1's offload paths take the move to
    # the CPU for a copy, and on the CPU it is none.
    # - torch < 2.14: FlatParamHandle.to_cpu() frees the gathered parameters
    #   after "moving" them, so the model state dict reads freed memory and
    #   rank 0 dies with a segmentation fault (pytorch/pytorch#188989, fixed in
    #   2.14 by #188990).
    # - every release from 2.6 to 2.14.1: the gathered optimizer state is copied
    #   out of a reused buffer only by `.cpu()`, so every exp_avg comes back as a
    #   view that the next state, exp_avg_sq, overwrites: the checkpoint holds
    #   exp_avg_sq twice and a resumed run silently trains differently.
    return StateDictOptions(full_state_dict=True, cpu_offload=device.type != "cpu")


@contextmanager
def gloo_destroyed_without_gil() -> Iterator[None]:
    """Around ``dist.destroy_process_group()``, which with gloo can deadlock on torch < 2.8."""
    if torch_at_least((2, 8)):
        yield
        return
    # torch < 2.8: destroying a ProcessGroup from Python runs ProcessGroupGloo's
    # destructor with the GIL held, and it joins gloo's worker threads. A worker
    # that is just then freeing a finished collective's tensor needs the GIL to
    # drop that tensor's Python object, so both wait forever: after the final
    # record, at random (pytorch/pytorch#154976 releases the GIL there, in 2.8).
    # ProcessGroupGloo's own Python binding releases the GIL in its destructor:
    # holding it here moves its destruction to the `del` below, without the GIL.
    # (No reference to a ProcessGroup may outlive destroy_process_group here, or
    # its destruction, with the GIL held, would come later and deadlock as before.)
    cpu = torch.device("cpu")
    gloo = [
        group._get_backend(cpu) for group in dist.distributed_c10d._world.pg_map if "gloo" in dist.get_backend(group)
    ]
    yield
    del gloo


@contextmanager
def quiet_internal_warnings() -> Iterator[None]:
    """Silence warnings about torch's own internals that a user cannot act on.

    FSDP1's sharded state dict still goes through ShardedTensor, which warns
    about its deprecated helpers on every save and load (torch 2.14).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*_get_pg_default_device.*will be deprecated")
        warnings.filterwarnings("ignore", message="Multiple backends are registered with this ProcessGroup")
        yield
