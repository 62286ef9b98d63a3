"""Process-group setup, the small helpers every training script needs, and where this repository works around torch.

The one contract is torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT):
a laptop, the CPU tests and SLURM (one torchrun per node) go through it; a plain ``python script.py`` is a world of one.
Tested on torch 2.6 (the floor: the first with the public FSDP2 API) and the newest pip resolves ("Torch's versions").
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import re
import signal
import sys
import traceback
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn

from common.async_checkpoint import finish_in_flight
from common.outputs import write_text


class FatalError(Exception):
    """A problem the user can fix (bad flag, missing data), raised by all ranks at once (see errors_reported_once)."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str
    # Where ranks agree on host-side facts (a stop request, a file that failed to load) with CPU tensors: gloo, in a
    # group of its own beside NCCL on a GPU run (never waiting for the GPU's queue), else None: the default group.
    host_group: dist.ProcessGroup | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def rendezvous_store(self, timeout: timedelta) -> dist.Store:
        """Where the ranks meet for init_process_group: torchrun's store, a generation at a time (generation_store);
        without torchrun, in memory: DDP and FSDP wrap as under torchrun, and no port is taken."""
        if "MASTER_ADDR" not in os.environ:
            return dist.HashStore()
        return generation_store(self.rank, self.world_size, timeout)

    def with_host_group(self) -> DistContext:
        """This context with its host group; every rank creates it right after the process group, in the same order."""
        if self.backend == "gloo":
            return self
        return replace(self, host_group=dist.new_group(backend="gloo"))


def print0(*args: object, **kwargs: object) -> None:
    """Print on global rank 0 only, so N ranks do not print N copies."""
    if env_rank() == 0:
        print(*args, **kwargs, flush=True)  # type: ignore[call-overload]


def wants_cuda(requested: str) -> bool:
    """Whether ``--device`` resolves to a GPU: ``cuda``, or ``auto`` where CUDA is present."""
    return requested == "cuda" or (requested == "auto" and torch.cuda.is_available())


def set_cpu_threads(local_world_size: int) -> None:
    """Share the cores between this node's processes (each would spawn a thread per core), unless OMP_NUM_THREADS
    is set (torchrun sets 1 for several workers, SLURM launchers per task). Where torch already has its share (one
    process, no CPU limit) its count is left alone: setting it, even to the same number, makes MKL use every thread
    on small matrix products: the tiny preset's step took 15% longer (19.2 against 16.5 ms, medians of 5, 2 cores).
    A value OpenMP does not count (empty, 0, a word) counts as unset: OpenMP took it for every core, in each process
    (2 ranks on 2 cores ran the README's job 4.4 times slower); rank 0 says so."""
    given = os.environ.get("OMP_NUM_THREADS")
    if given is not None and re.fullmatch(r"\s*0*[1-9]\d*\s*(,\s*0*[1-9]\d*\s*)*", given):  # a count per nesting level
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    share = max(1, cores // local_world_size)
    if given is not None:
        print0(f"OMP_NUM_THREADS={given!r} is no thread count: taken as unset, {share} thread(s) per process")
        os.environ["OMP_NUM_THREADS"] = str(share)  # what this process's children (data loader workers) read
    if given is not None or torch.get_num_threads() != share:
        torch.set_num_threads(share)


def generation_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The store env:// would build at MASTER_ADDR:MASTER_PORT, seen through a prefix for this generation of workers.

    torchrun --max-restarts starts a new generation after a failure, in the same store: without a prefix, gloo and
    NCCL can read the failed generation's addresses and connect to a dead worker (NCCL: pytorch#167288). Torch 2.14,
    gloo, 2 processes, rank 1 SIGKILLed once: without it 6 of 10 restarts failed ("Connection refused", or a hang in
    init_process_group past 120 s); with it, 13 of 13 resumed and finished."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # torchrun's agent hosts the store and says so; a launcher of one's own leaves it to rank 0.
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0 and not agent_hosts_it, timeout=timeout)
    return dist.PrefixStore(f"restart-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def launch_context(requested_device: str) -> DistContext:
    """This process's place in the job (torchrun's variables) and its device, before the process group exists; and
    the process set up for it: under torchrun it ends with torchrun, on a GPU it takes its own, on a CPU its cores."""
    if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform.startswith("linux"):
        # A torchrun killed outright (SIGKILL, OOM) cannot stop its workers: orphaned, they would train on, holding
        # the SLURM step open. So the kernel sends SIGTERM (a stop request like any other) when torchrun dies.
        pr_set_pdeathsig = 1  # from <linux/prctl.h>
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)
    rank, world_size = env_rank(), env_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    device = torch.device("cpu")
    if wants_cuda(requested_device):
        if not torch.cuda.is_available():
            raise FatalError("--device cuda was asked for, but CUDA is not available here")
        device = torch.device("cuda", local_rank)  # the local rank: rank 9 on a node of 8 GPUs is GPU 1
        torch.cuda.set_device(device)
        # TF32 tensor cores for fp32 matmuls (torch's default is full fp32, a fraction of the speed);
        # --deterministic sets "highest" again (seed_everything).
        torch.set_float32_matmul_precision("high")
    set_cpu_threads(local_world_size)
    backend = "nccl" if device.type == "cuda" else "gloo"
    return DistContext(rank, local_rank, world_size, local_world_size, device, backend)


@contextmanager
def clean_teardown() -> Iterator[None]:
    """Around ``dist.destroy_process_group()``: free what still holds the groups first.

    FSDP's modules form reference cycles that hold their process groups: collected at the interpreter's exit, a gloo
    group's threads can outlive the interpreter, find no GIL, and abort a finished run (torch 2.14.1, 1 run in 10).
    A FatalError's traceback frames hold the model too: they drop their locals here (the message is kept). A crash
    keeps its frames: freeing DDP sooner let a crashed rank's peer report first, and torchrun blamed the wrong rank.
    Collected before the destroy: on torch < 2.8 a group the collector frees holds the GIL while it waits for gloo's
    threads (gloo_destroyed_without_gil)."""
    failure = sys.exc_info()[1]
    # A checkpoint still being written uses a group of its own, which the destroy would pull from under it.
    if (written := finish_in_flight()) is not None:
        print0(written, file=sys.stderr)
    if isinstance(failure, FatalError):
        traceback.clear_frames(failure.__traceback__)
    gc.collect()
    with gloo_destroyed_without_gil():
        yield


def teardown_distributed() -> None:
    """``dist.destroy_process_group()`` as the scripts do it, if a process group is up."""
    if dist.is_initialized():
        with clean_teardown():
            dist.destroy_process_group()


@contextmanager
def errors_reported_once() -> Iterator[None]:
    """A FatalError becomes one message from rank 0 and the same exit code on every rank, instead of a
    traceback from each of them; so does a Ctrl-C that comes before training starts, or a second one."""
    try:
        yield
    except FatalError as err:
        print0(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        # The first Ctrl-C during training asks for a stop instead (common.bookkeeping).
        print0(
            "interrupted (SIGINT); what was saved before is intact, the steps since the newest checkpoint are not "
            "saved. Continue with --resume",
            file=sys.stderr,
        )
        sys.exit(128 + signal.SIGINT)


@contextmanager
def distributed(requested_device: str, timeout_s: float) -> Iterator[DistContext]:
    """The process group's life as every training script spells it out, for the commands and tests that
    need one: started, and always torn down, however the block ends; errors reported once."""
    with errors_reported_once():
        ctx = launch_context(requested_device)
        timeout = timedelta(seconds=timeout_s)
        device_id = ctx.device if ctx.device.type == "cuda" else None
        store = ctx.rendezvous_store(timeout)
        dist.init_process_group(
            ctx.backend, store=store, rank=ctx.rank, world_size=ctx.world_size, timeout=timeout, device_id=device_id
        )
        try:
            yield ctx.with_host_group()
        finally:
            teardown_distributed()


def all_ranks_agree(ok: bool, ctx: DistContext) -> bool:
    """True only if ``ok`` holds on every rank: one rank's failure stops them all. An ``AgreementInFlight`` read at
    once. A world of one skips it: it cost 0.5 to 0.9 ms of an 18 ms step (tiny preset, 2-core CPU)."""
    if ctx.world_size == 1:
        return ok
    return AgreementInFlight(ok, ctx).all_agree()


class AgreementInFlight:
    """``all_ranks_agree`` sent now and read later, so that no step waits for a round trip between every host.
    On the host group, reading no GPU value: every rank starts one at the same point and reads it before leaving."""

    def __init__(self, ok: bool, ctx: DistContext) -> None:
        self.flag = torch.tensor([1 if ok else 0])
        self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MIN, group=ctx.host_group, async_op=True)

    def all_agree(self) -> bool:
        self.work.wait()
        return bool(self.flag.item())


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# Ctrl-C, and a terminal that closes: a stop request too, unless the run was started with them ignored
# (nohup, a background job). A second one does what it would have done: it does not wait for the step.
SECOND_TIME_STOPS_AT_ONCE = {signal.SIGINT: signal.default_int_handler, signal.SIGHUP: signal.SIG_DFL}


class StopRequest:
    """Notices a stop request and makes every rank act on it at the same step."""

    def __init__(self, stop_file: Path, marker: Path, ctx: DistContext) -> None:
        self.ctx, self.stop_file, self.marker = ctx, stop_file, marker
        self.received: str | None = None
        self.answers: AgreementInFlight | None = None  # the ranks' answers of the last call, on their way
        for number in STOP_SIGNALS:
            signal.signal(number, self._on_signal)
        for number in SECOND_TIME_STOPS_AT_ONCE:
            if signal.getsignal(number) is not signal.SIG_IGN:
                signal.signal(number, self._on_signal)
        if ctx.is_main:
            # The marker describes the run this one continues. A STOP file stays: it may have come while this run
            # was starting, and then it is meant for it. slurm/'s launchers clear a stale one before a job starts.
            self.marker.unlink(missing_ok=True)

    def _on_signal(self, number: int, frame: object) -> None:
        # Only a flag: checkpointing inside the handler would run in the middle of whatever was interrupted (a
        # collective, a half-done step) and can hang.
        self.received = signal.Signals(number).name
        if number in SECOND_TIME_STOPS_AT_ONCE:
            signal.signal(number, SECOND_TIME_STOPS_AT_ONCE[number])

    def requested(self) -> bool:
        """True on every rank at the same step, once any rank got a signal or rank 0 saw the STOP file. A collective
        once a step, on no GPU value: each call sends this step's answer and reads the one sent a step before, so the
        exchange runs beside the step and a stop comes a step later, on every rank alike."""
        # Only rank 0 looks at the file: one stat per step instead of one per rank.
        asked = self.received is not None or (self.ctx.is_main and self.stop_file.exists())
        if self.ctx.world_size == 1:
            return asked
        answers, self.answers = self.answers, AgreementInFlight(not asked, self.ctx)
        return answers is not None and not answers.all_agree()

    def settle(self) -> None:
        """Read the last answers sent, so that no exchange is left in flight when the ranks part."""
        if self.answers is not None:
            self.answers.all_agree()
            self.answers = None

    def exit(self, step: int, checkpoint: Path | None) -> NoReturn:
        """Leave the PREEMPTED marker and end this process (exit code 0: nothing failed)."""
        self.settle()
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


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def max_over_ranks(values: list[float], ctx: DistContext) -> list[float]:
    """The largest of each number held on the host, over the ranks."""
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=ctx.host_group)
    return tensor.tolist()


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank stores of ``tensor``: the shard of an FSDP2 parameter (a DTensor), else all of it."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def local_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state that this rank holds."""

    def size(tensors: Iterable[torch.Tensor]) -> int:
        return sum(part.numel() * part.element_size() for part in map(local_part, tensors))

    params = list(model.parameters())
    states = (value for state in optimizer.state.values() for value in state.values())
    return {
        "params": size(params),
        "grads": size(p.grad for p in params if p.grad is not None),
        "optimizer": size(value for value in states if isinstance(value, torch.Tensor)),
    }


def shard_group_size(model: nn.Module) -> int:
    """Ranks that share one copy of the model state: 1 when every rank holds all of it (DDP, no_shard)."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    if isinstance(model, FullyShardedDataParallel):
        if model.sharding_strategy == ShardingStrategy.NO_SHARD:
            return 1
        # For hybrid_shard this is the group inside one replica, not the world.
        return dist.get_world_size(model.process_group)
    for param in model.parameters():
        placements = getattr(param, "placements", None)  # FSDP2: a DTensor on a 1-D or 2-D (HSDP) mesh
        if placements is not None:
            sizes = param.device_mesh.mesh.shape
            return math.prod(size for size, placement in zip(sizes, placements, strict=True) if placement.is_shard())
    return 1


LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def env_rank() -> int:
    """Global rank; 0 for a plain ``python script.py``."""
    return int(os.environ.get("RANK", "0"))


def env_world_size() -> int:
    """Processes in the job; 1 for a plain ``python script.py``."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_num_nodes() -> int:
    """Machines in the job: one torchrun (LOCAL_WORLD_SIZE workers) per node."""
    world_size = env_world_size()
    return max(1, world_size // int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))))


# ---- Torch's versions: what depends on them, and torch's bugs that the scripts avoid ----------------------------
# Each helper says which releases need it; a part that needs a later release stops first (require_torch).

# FSDP2 on the CPU (gloo) needs torch 2.9:
# - 2.6: the first forward fails ('Stream' object has no attribute 'record_event'): torch.cpu.Stream got its no-op
#   record_event/wait_event in 2.7 (pytorch/pytorch#145935);
# - 2.7 and 2.8: gloo's reduce_scatter_tensor takes ReduceOp.AVG, which FSDP2 uses for fp32 gradients, and sums:
#   every gradient is world-size times too large, silently (pytorch/pytorch#162338; checked with a 2-rank
#   reduce-scatter on 2.6 to 2.14.1).
FSDP2_ON_CPU = (2, 9)
# FSDP2 --cpu-offload gives the mesh a CPU backend beside NCCL, through init_device_mesh(backend_override=...), which
# torch 2.9 added (pytorch/pytorch#159371).
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
    """Stop with one line (exit code 2, from rank 0 only) if this torch is older than ``release``; called while the
    flags are checked, so nothing has been started or written yet."""
    if not torch_at_least(release):
        needed = ".".join(map(str, release))
        parser.exit(2, f"error: {feature} needs torch {needed} or newer; this is torch {torch.__version__}\n")


@contextmanager
def gloo_destroyed_without_gil() -> Iterator[None]:
    """Around ``dist.destroy_process_group()``, which with gloo can deadlock on torch < 2.8."""
    if torch_at_least((2, 8)):
        yield
        return
    # torch < 2.8: destroying a ProcessGroup from Python runs ProcessGroupGloo's destructor with the GIL held, and it
    # joins gloo's worker threads. A worker that is just then freeing a finished collective's tensor needs the GIL to
    # drop that tensor's Python object, so both wait forever: after the final record, at random (pytorch/pytorch#154976
    # releases the GIL there, in 2.8). ProcessGroupGloo's own Python binding releases the GIL in its destructor:
    # holding it here moves its destruction to the `del` below, without the GIL. (No reference to a ProcessGroup may
    # outlive destroy_process_group here, or its destruction, with the GIL held, would come later and deadlock.)
    cpu = torch.device("cpu")
    gloo = [
        group._get_backend(cpu) for group in dist.distributed_c10d._world.pg_map if "gloo" in dist.get_backend(group)
    ]
    yield
    del gloo


@contextmanager
def quiet_internal_warnings() -> Iterator[None]:
    """Silence warnings about torch's own internals that a user cannot act on: FSDP1's sharded state dict still goes
    through ShardedTensor, which warns about its deprecated helpers on every save and load (torch 2.14)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*_get_pg_default_device.*will be deprecated")
        warnings.filterwarnings("ignore", message="Multiple backends are registered with this ProcessGroup")
        yield
