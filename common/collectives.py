"""What a training step sends: its collectives, counted as the process issues them, and a trace.

A ``StepObserver`` watches one optimizer step (its micro-steps, clipping and the optimizer step) and records every
collective the process issued in it, whoever issued it (DDP's C++ reducer, FSDP1, FSDP2, DTensor, the script): a
``TorchDispatchMode`` sees each ``c10d::`` operator with its tensors and process group. The final record gets their
message bytes, counts and ring bytes per link by kind (docs/communication.md: what each means, and why this level).
``--profile N`` writes a torch.profiler trace of N steps after a warm-up step, ``RUN_DIR/profile/rank-R.json``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from common.distributed import DistContext, print0
from common.hangs import step_finished
from common.outputs import write_by_name
from common.run_dir import PROFILE_DIR

# Every collective operator of torch.distributed, by the kind it is reported as: the c10d ops are what the
# process-group API (and DDP's reducer) calls, the _c10d_functional ones what DTensor and functional collectives call.
KIND_OF_OP = {
    f"{namespace}::{op}": kind
    for kind, namespace, ops in [
        ("all_reduce", "c10d", "allreduce_ allreduce_coalesced_"),
        ("all_reduce", "_c10d_functional", "all_reduce all_reduce_ all_reduce_coalesced all_reduce_coalesced_"),
        ("all_gather", "c10d", "allgather_ _allgather_base_ allgather_coalesced_ allgather_into_tensor_coalesced_"),
        ("all_gather", "_c10d_functional", "all_gather_into_tensor all_gather_into_tensor_coalesced"),
        ("all_gather", "_c10d_functional", "all_gather_into_tensor_out"),
        ("reduce_scatter", "c10d", "reduce_scatter_ _reduce_scatter_base_ reduce_scatter_tensor_coalesced_"),
        ("reduce_scatter", "_c10d_functional", "reduce_scatter_tensor reduce_scatter_tensor_coalesced"),
        ("reduce_scatter", "_c10d_functional", "reduce_scatter_tensor_out"),
        ("broadcast", "c10d", "broadcast_"),
        ("broadcast", "_c10d_functional", "broadcast broadcast_"),
        ("reduce", "c10d", "reduce_"),
        ("all_to_all", "c10d", "alltoall_ alltoall_base_"),
        ("all_to_all", "_c10d_functional", "all_to_all_single"),
        ("gather", "c10d", "gather_ gather_into_tensor_"),
        ("scatter", "c10d", "scatter_"),
        ("send_recv", "c10d", "send recv_ recv_any_source_"),
        ("send_recv", "_c10d_functional", "isend irecv batch_p2p_ops"),
        ("barrier", "c10d", "barrier monitored_barrier_"),
    ]
    for op in ops.split()
}


def ring_link_bytes(kind: str, message_bytes: float, group_size: int) -> float:
    """Bytes one rank sends over its link for one collective of ``message_bytes`` on a ring of ``group_size``."""
    if group_size <= 1 or kind == "barrier":
        return 0.0
    share = (group_size - 1) / group_size
    if kind == "all_reduce":
        return 2 * share * message_bytes  # a reduce-scatter, then an all-gather
    if kind in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return share * message_bytes
    return float(message_bytes)  # broadcast, reduce, send/recv: the whole message passes every link once


@dataclass(frozen=True)
class Traffic:
    """What the collectives of one optimizer step move, by kind: message bytes, count, ring bytes per link."""

    bytes: dict[str, int]
    counts: dict[str, int]
    ring_bytes: dict[str, float]

    @classmethod
    def of(cls, collectives: Iterable[tuple[str, int, int]]) -> Traffic:
        """From ``(kind, message bytes, group size)`` per collective."""
        sizes, counts, ring = Counter[str](), Counter[str](), Counter[str]()
        for kind, message, group in collectives:
            sizes[kind] += message
            counts[kind] += 1
            ring[kind] += ring_link_bytes(kind, message, group)
        return cls(dict(sorted(sizes.items())), dict(sorted(counts.items())), dict(sorted(ring.items())))

    def __add__(self, other: Traffic) -> Traffic:
        def merged(a: Mapping, b: Mapping) -> dict:
            return {key: a.get(key, 0) + b.get(key, 0) for key in sorted({*a, *b})}

        return Traffic(*(merged(getattr(self, f), getattr(other, f)) for f in ("bytes", "counts", "ring_bytes")))

    @property
    def total_ring_bytes(self) -> float:
        return sum(self.ring_bytes.values())

    def as_record(self) -> dict[str, dict]:
        """The final record's fields."""
        return {
            "comm_bytes_per_step": self.bytes,
            "collectives_per_step": self.counts,
            "comm_ring_bytes_per_step": self.ring_bytes,
        }


@dataclass(frozen=True)
class Collective:
    kind: str
    message_bytes: int
    group_size: int


def named_arguments(schema: torch.FunctionSchema, args: tuple, kwargs: dict) -> dict[str, Any]:
    """An operator's arguments by their schema names."""
    return dict(zip((a.name for a in schema.arguments), args, strict=False)) | kwargs


def is_process_group(value: Any) -> bool:
    return isinstance(value, torch.ScriptObject) and "ProcessGroup" in str(value._type())


def operator_group(schema: torch.FunctionSchema, args: tuple, kwargs: dict) -> dist.ProcessGroup:
    """The process group an operator runs on: a ProcessGroup argument, or a group's name."""
    for name, value in named_arguments(schema, args, kwargs).items():
        if is_process_group(value):
            return dist.ProcessGroup.unbox(value)
        if name == "group_name" and isinstance(value, str):
            return dist.distributed_c10d._resolve_process_group(value)
    return dist.group.WORLD


def _tensor_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def message_bytes(args: tuple, kwargs: dict, result: Any) -> int:
    """A collective's whole message (nccl-tests' size): the larger of what goes in and what comes out (what an
    all-gather assembles, what a reduce-scatter starts from, what an all-reduce or a broadcast carries)."""
    return max(_tensor_bytes(part) for part in [*args, *kwargs.values(), result])


class CollectiveRecorder(TorchDispatchMode):
    """Records each collective operator that runs while it is active. Tensor subclasses (FSDP2's and DTensor's) are
    let through first, so that the collectives they turn into reach this mode as plain operators and count once.
    Counting here, not in the backend, matters: gloo has no reduce-scatter and runs one as an all-reduce."""

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[Collective] = []

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Let torch.compile run its compiled code during the measured step too, instead of falling
        # back to eager: the mode then sees what that code dispatches, collectives included.
        return True

    def __torch_dispatch__(
        self, func: torch._ops.OpOverload, types: tuple[type, ...], args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if any(_is_dispatching_subclass(t) for t in types):
            return NotImplemented
        kind = KIND_OF_OP.get(func._schema.name)
        if kind is None:
            return func(*args, **kwargs)
        group = operator_group(func._schema, args, kwargs)
        self.before_collective(func, kind, group, args, kwargs)
        result = func(*args, **kwargs)
        self.collectives.append(Collective(kind, message_bytes(args, kwargs, result), group.size()))
        return result

    def before_collective(
        self, func: torch._ops.OpOverload, kind: str, group: dist.ProcessGroup, args: tuple, kwargs: dict
    ) -> None:
        """Called before a collective is issued; subclasses check it here (tools/checks/lockstep.py)."""


def _is_dispatching_subclass(cls: type) -> bool:
    # FakeTensor is left to this mode: DTensor runs ops on fake tensors to learn their shapes, and
    # some torch releases (2.10) do it with this mode active, where deferring to FakeTensor failed
    # ("all __torch_dispatch__ handlers returned NotImplemented") and ended the measured step.
    if issubclass(cls, FakeTensor):
        return False
    return cls is not torch.Tensor and getattr(cls, "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__


def measured_step(profile_steps: int) -> int:
    """Which step of a run (1 = the first it trains) is measured: the mode costs Python time per operator, so one
    step, the third (the first two do one-time work: FSDP's lazy initialisation, DDP's rebuilding of its buckets),
    or the first after the trace."""
    return max(3, profile_steps + 2)


class StepObserver:
    """Measures one optimizer step's collectives and, with ``--profile N``, traces N steps. The loop calls
    ``begin_step(step)`` (``step``: steps done so far) before an optimizer step's first micro-step and ``end_step()``
    after the optimizer (and scheduler) step, every step; ``record()`` gives the final record's fields. Steps count
    from this run's first one, so a resumed run skips its own one-time work too."""

    def __init__(self, run_dir: Path, ctx: DistContext, profile_steps: int = 0) -> None:
        self.ctx = ctx
        self.profile_steps = profile_steps
        self.profile_dir = run_dir / PROFILE_DIR
        self.measure_at = measured_step(profile_steps)
        self._begun = 0  # steps this run has begun
        self._recorder: CollectiveRecorder | None = None
        self._profiler: torch.profiler.profile | None = None
        self._step_range: torch.profiler.record_function | None = None
        self._traffic: Traffic | None = None

    def begin_step(self, step: int) -> None:
        self._begun += 1
        if self.profile_steps and self._begun == 2:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.ctx.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            # Input shapes recorded: a collective's message size.
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profiler.start()
        if self._profiler is not None:
            # A named range per step in the trace, so that each step's collectives are easy to find.
            self._step_range = torch.profiler.record_function(f"optimizer step {step + 1}")
            self._step_range.__enter__()
        if self._begun == self.measure_at:
            self._recorder = CollectiveRecorder()
            self._recorder.__enter__()

    def end_step(self) -> None:
        step_finished()  # the hang watchdog's heartbeat
        if self._recorder is not None:
            self._recorder.__exit__(None, None, None)
            self._traffic = Traffic.of((c.kind, c.message_bytes, c.group_size) for c in self._recorder.collectives)
            self._recorder = None
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if self._profiler is not None and self._begun == 1 + self.profile_steps:
            self._finish_profile()

    def _finish_profile(self) -> None:
        """Stop the profiler and write this rank's Chrome-format trace, renamed into place (never half a file)."""
        assert self._profiler is not None
        self._profiler.stop()
        path = self.profile_dir / f"rank-{self.ctx.rank}.json"
        write_by_name(path, self._profiler.export_chrome_trace, overwrite=True)  # this run's own trace
        self._profiler = None
        print0(f"profile: {self.profile_steps} step(s) after a warm-up step in {path.parent}/ (one file per rank)")

    def record(self) -> dict[str, Any]:
        """Fields for the final record: none if the run ended before the measured step."""
        if self._profiler is not None:  # the run ended inside the window: keep what it traced
            self._finish_profile()
        return {} if self._traffic is None else self._traffic.as_record()
