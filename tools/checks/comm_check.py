"""Measure all-reduce, all-gather and reduce-scatter across the job's ranks, as nccl-tests reports them.

    torchrun --standalone --nproc_per_node=8 -m tools.checks.comm_check                  # one node
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=check -m tools.checks.comm_check --out comm_check.json                 # two (on each node)
    COMM_CHECK=1 sbatch slurm/fsdp.sbatch                                          # on SLURM, before training
    python -m tools.estimates.estimate_communication --params 7e9 --world-size 16 --comm-check comm_check.json

For each collective and each message size (doubling from --min-bytes to --max-bytes: 1 MiB to 1 GiB
on GPUs, 64 KiB to 4 MiB on the CPU), --warmup untimed iterations, then --iters timed back to back;
a rank's time is their mean, and the slowest rank's time counts: a collective has ended when its
last rank has (nccl-tests' -a 3; its default, -a 1, averages the ranks' times). The figures are
those of nccl-tests (doc/PERFORMANCE.md), with S the whole message: what an all-reduce carries,
what an all-gather assembles, what a reduce-scatter starts from:

    algbw = S / t           busbw = algbw x 2(n-1)/n  (all-reduce)    algbw x (n-1)/n  (the others)

busbw does not depend on the number of ranks n: compare it with the slowest link's rate. The table
goes to the console (rank 0) and, with the job's world size, nodes, backend, device and torch
version, to --out as JSON, which tools.estimates.estimate_communication reads.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from common.bookkeeping import synchronize
from common.cli import HelpFormatter, Parser, add_device_flag
from common.collectives import ring_link_bytes
from common.distributed import (
    DistContext,
    FatalError,
    distributed,
    env_num_nodes,
    env_world_size,
    max_over_ranks,
    print0,
    wants_cuda,
)
from common.flag_checks import check_launch_environment
from common.flags import INTEGER, flag_kind, positive_int, shown, timeout_seconds
from common.outputs import write_text
from tools.command_flags import output_file
from tools.output_checks import add_overwrite_flag, check_output_path

OPS = ("all_reduce", "all_gather", "reduce_scatter")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}  # binary, as nccl-tests reads -b 1M -e 1G
GPU_SIZES = (2**20, 2**30)
CPU_SIZES = (2**16, 4 * 2**20)  # gloo on a CPU moves a few GB/s at best: 1 GiB would take minutes
# gloo has no reduce-scatter of its own: c10d runs one as an all-reduce of the whole input (the
# profiler shows gloo:all_reduce; DESIGN.md). FSDP on gloo runs exactly that, so it is measured as is.
GLOO_REDUCE_SCATTER = (
    "gloo has no reduce-scatter: c10d runs it as an all-reduce of the whole input, which moves twice the "
    "bytes, so its busbw reads about half the link's; FSDP on gloo runs the same"
)


# The single-tensor all-gather and reduce-scatter have new names in recent torch, where the old
# ones warn; the floor, 2.6, has only the old ones.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' correction from algorithm to bus bandwidth, 2(n-1)/n or (n-1)/n: what a ring sends from each
    rank per byte of S, the rule the estimator divides by (one rule, not two)."""
    return ring_link_bytes(op, 1.0, world_size)


# Past this, the buffers of one message (all_gather's output is world size times it) fit no GPU.
MAX_MESSAGE_BYTES = 64 * 2**30


@flag_kind(INTEGER)
def byte_size(text: str) -> int:
    """A byte count such as 65536, 64K, 4M or 1G (powers of 1024)."""
    number, unit = (text[:-1], text[-1].upper()) if text[-1:].upper() in UNITS else (text, "")
    try:
        value = int(number) * UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a whole number of bytes such as 65536, 64K, 4M or 1G, got {shown(text)}"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes, got {shown(text)}")
    if value > MAX_MESSAGE_BYTES:
        raise argparse.ArgumentTypeError(
            f"must be at most 64G: one message's buffers would fit no GPU, got {shown(text)}"
        )
    return value


def message_sizes(low: int, high: int) -> list[int]:
    """``low``, doubled until past ``high``: nccl-tests' -b LOW -e HIGH -f 2."""
    sizes = []
    size = low
    while size <= high:
        sizes.append(size)
        size *= 2
    return sizes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = Parser(description=__doc__, formatter_class=HelpFormatter, prog="python -m tools.checks.comm_check")
    add_device_flag(parser)
    parser.add_argument(
        "--min-bytes", type=byte_size, help="smallest message, e.g. 1M (default: 1M on GPUs, 64K on the CPU)"
    )
    parser.add_argument(
        "--max-bytes", type=byte_size, help="largest message, e.g. 1G (default: 1G on GPUs, 4M on the CPU)"
    )
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="collectives to measure")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="element type of the messages")
    parser.add_argument("--warmup", type=positive_int, default=5, help="untimed iterations per size")
    parser.add_argument("--iters", type=positive_int, default=20, help="timed iterations per size")
    parser.add_argument(
        "--out", type=output_file, default=Path("runs/comm_check/comm_check.json"), help="where rank 0 writes the JSON"
    )
    parser.add_argument(
        "--dist-timeout",
        type=timeout_seconds,
        default=600.0,
        metavar="SECONDS",
        help="how long a collective waits for the other ranks before failing",
    )
    add_overwrite_flag(parser)
    args = parser.parse_args(argv)
    check_launch_environment(parser)
    check_sizes(parser, args)
    # Before the measurement, not with a traceback after it (a folder, a path under a file, /proc, a taken name).
    check_output_path(parser, args.out, "--out", overwrite=args.overwrite)
    args.ops = list(dict.fromkeys(args.ops))  # each once, in the order given
    return args


def check_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill in the device's default range; every message must split evenly into one element per rank at least."""
    low, high = GPU_SIZES if wants_cuda(args.device) else CPU_SIZES
    args.min_bytes = args.min_bytes or min(low, args.max_bytes or low)
    args.max_bytes = args.max_bytes or max(high, args.min_bytes)
    if args.min_bytes > args.max_bytes:
        parser.error(f"--min-bytes {args.min_bytes} is larger than --max-bytes {args.max_bytes}")
    smallest = env_world_size() * DTYPES[args.dtype].itemsize
    if args.min_bytes < smallest:
        parser.error(
            f"--min-bytes {args.min_bytes} is less than one {args.dtype} element per rank "
            f"({env_world_size()} ranks: {smallest} bytes)"
        )


@dataclass(frozen=True)
class Result:
    """One collective at one message size; ``bytes`` is S, the whole message."""

    op: str
    bytes: int
    elements: int
    time_s: float
    algbw_gbps: float
    busbw_gbps: float

    @classmethod
    def of(cls, op: str, size: int, elements: int, seconds: float, world_size: int) -> Result:
        algbw = size / seconds / 1e9  # GB/s of 10^9 bytes, as nccl-tests
        return cls(op, size, elements, seconds, algbw, algbw * bus_factor(op, world_size))


def collective(op: str, elements: int, dtype: torch.dtype, ctx: DistContext) -> Callable[[], None]:
    """One call of ``op`` on a message of ``elements`` in all (S), its buffers allocated once.

    Zeros: sums of them stay finite however often they are reduced, in every dtype.
    """
    shard = elements // ctx.world_size
    if op == "all_reduce":
        whole = torch.zeros(elements, dtype=dtype, device=ctx.device)
        return lambda: dist.all_reduce(whole)
    if op == "all_gather":
        gathered = torch.zeros(elements, dtype=dtype, device=ctx.device)
        piece = torch.zeros(shard, dtype=dtype, device=ctx.device)
        return lambda: all_gather_single(gathered, piece)
    scattered = torch.zeros(elements, dtype=dtype, device=ctx.device)
    piece = torch.zeros(shard, dtype=dtype, device=ctx.device)
    return lambda: reduce_scatter_single(piece, scattered)


def seconds_per_call(run: Callable[[], None], warmup: int, iters: int, ctx: DistContext) -> float:
    """This rank's mean time per call of ``run``, timed back to back after ``warmup`` calls."""
    for _ in range(warmup):
        run()
    synchronize(ctx.device)
    dist.barrier()  # every rank starts the clock together: one arriving late would stretch the others' time
    synchronize(ctx.device)
    start = time.perf_counter()
    for _ in range(iters):
        run()
    synchronize(ctx.device)
    return (time.perf_counter() - start) / iters


def measure(args: argparse.Namespace, ctx: DistContext) -> list[Result]:
    """Every op at every size; the slowest rank's time of each, agreed in one collective at the end."""
    dtype = DTYPES[args.dtype]
    plan = []
    for op in args.ops:
        for size in message_sizes(args.min_bytes, args.max_bytes):
            # Whole elements, the same number on every rank: S rounds down to a multiple of n elements.
            elements = size // dtype.itemsize // ctx.world_size * ctx.world_size
            plan.append((op, elements))
    local = [seconds_per_call(collective(op, n, dtype, ctx), args.warmup, args.iters, ctx) for op, n in plan]
    slowest = max_over_ranks(local, ctx)
    return [
        Result.of(op, n * dtype.itemsize, n, seconds, ctx.world_size)
        for (op, n), seconds in zip(plan, slowest, strict=True)
    ]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def report(args: argparse.Namespace, ctx: DistContext, results: Sequence[Result]) -> dict[str, Any]:
    """The JSON: what was measured, on what, and each result."""
    notes = [GLOO_REDUCE_SCATTER] if ctx.backend == "gloo" and "reduce_scatter" in args.ops else []
    if ctx.world_size == 1:
        notes.append("one rank: nothing crossed a link, so busbw is 0 by its definition; start several with torchrun")
    return {
        "world_size": ctx.world_size,
        "local_world_size": ctx.local_world_size,
        "nodes": env_num_nodes(),
        "backend": ctx.backend,
        "device": ctx.device.type,
        "device_name": device_name(ctx.device),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "warmup": args.warmup,
        "iters": args.iters,
        "time": "mean of the timed iterations, the slowest rank's",
        "bus_factor": {op: bus_factor(op, ctx.world_size) for op in args.ops},
        "notes": notes,
        "results": [asdict(result) for result in results],
    }


def table(summary: dict[str, Any]) -> str:
    """nccl-tests' columns, as a Markdown table."""
    lines = [
        f"{summary['world_size']} ranks on {summary['nodes']} node(s), {summary['backend']} on "
        f"{summary['device_name']}, {summary['dtype']}, torch {summary['torch']}, "
        f"{summary['iters']} timed iterations after {summary['warmup']}",
        "",
        "| collective | size (B) | count (elements) | time (us) | algbw (GB/s) | busbw (GB/s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in summary["results"]:
        lines.append(
            f"| {row['op']} | {row['bytes']} | {row['elements']} | {row['time_s'] * 1e6:.1f} | "
            f"{row['algbw_gbps']:.3f} | {row['busbw_gbps']:.3f} |"
        )
    lines += [f"\nnote: {note}" for note in summary["notes"]]
    return "\n".join(lines)


def write_json(summary: dict[str, Any], path: Path, overwrite: bool) -> None:
    """Through common.outputs: a reader (the estimator, a test, a job's next step) never sees half a file.

    If it cannot be written after all (a full disk, a file that took its name meanwhile), the figures
    are not lost: the table printed above holds them, and the message says so.
    """
    try:
        write_text(path, json.dumps(summary, indent=2) + "\n", overwrite)
    except OSError as err:
        raise FatalError(
            f"could not write --out {path}: {err.strerror or err}. The table above holds every figure measured",
            exit_code=1,
        ) from None


@record  # a crash's traceback reaches torchrun's error summary
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with distributed(args.device, args.dist_timeout) as ctx:
        summary = report(args, ctx, measure(args, ctx))
        if ctx.is_main:
            print0(table(summary))
            write_json(summary, args.out, args.overwrite)
            print0(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
