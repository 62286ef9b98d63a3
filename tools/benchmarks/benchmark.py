"""How fast DDP, FSDP1 and FSDP2 train the same transformer here: the first thing to run on GPUs.

    python -m tools.benchmarks.benchmark                         # every visible GPU; the gpt2 preset in bf16
    python -m tools.benchmarks.benchmark --nproc 2 --out b.json  # on CPU: the tiny preset, 2 processes
    python -m tools.benchmarks.benchmark --overhead --model tiny --strategy fsdp2 --nproc 2  # what the harness
                                                          # costs a step, beside a bare loop (overhead.py)
    python -m tools.benchmarks.benchmark --speedups --nproc 1  # eager, then one option more a row: compile,
                                                          # fused AdamW, flash attention... (speedups.py)
    python -m tools.benchmarks.benchmark --checkpoint --model tiny --nproc 2  # what checkpoints cost a run,
                                                          # synchronous and in the background (checkpoint_stall.py)

Each strategy trains the same model, in bf16, on the same global batch, for --warmup steps
that are not measured (the first collectives, allocations, compilation) and then --steps
that are. The table gives what each run's final metrics.jsonl record says: tokens per second
over all ranks, MFU (on GPUs whose peak is known), peak memory of the rank that needs most,
and the mean step time, evaluation and checkpoints left out. The table also goes to --out as
JSON. Every run goes through torchrun, like tools.benchmarks.compare_strategies.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from common.cli import HelpFormatter
from common.flags import positive_int
from common.models import GPT_PRESETS
from common.outputs import OutputExists, output_folder, write_text
from tools.benchmarks.checkpoint_stall import measure_stall, stall_table
from tools.benchmarks.compare_strategies import STRATEGIES, Strategy, launch
from tools.benchmarks.overhead import OVERHEAD_STRATEGIES, measure, overhead_table
from tools.benchmarks.speedups import RowFailed, planned_rows, speedup_rows, speedups_table
from tools.command_flags import micro_batch_size, output_file
from tools.output_checks import add_overwrite_flag, check_output_path, check_run_folders, finished_run_in
from tools.processes import exit_code_of

BENCHMARKED = ("ddp", "fsdp1_full_shard", "fsdp2")
GIB = 2**30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(
        prog="python -m tools.benchmarks.benchmark", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "--nproc",
        type=positive_int,
        default=None,
        help="processes (default: the GPUs, else 2; --overhead and --speedups: 1)",
    )
    parser.add_argument(
        "--model",
        choices=sorted(GPT_PRESETS),
        default="gpt2" if on_gpu else "tiny",
        help="--model preset (default: gpt2 on GPUs, else tiny)",
    )
    parser.add_argument(
        "--batch-size",
        type=micro_batch_size,
        default=None,
        help="sequences per process per step (default: 16 on GPUs, else 8)",
    )
    parser.add_argument(
        "--warmup",
        type=positive_int,
        default=None,
        help="steps before the clock starts (default: 5; --overhead: 25; --speedups: 10)",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="measured steps (default: 20; --overhead: 200; --checkpoint: 100; --speedups: 30)",
    )
    parser.add_argument(
        "--overhead",
        action="store_true",
        help="instead: a transformer script's ms per step beside a bare loop of the same training, both under "
        "torchrun, in turns (tools/benchmarks/overhead.py); --nproc, --model, --strategy, --warmup, --steps and "
        "--rounds apply",
    )
    parser.add_argument(
        "--checkpoint",
        action="store_true",
        help="instead: the step's wait per checkpoint and the wall of --steps steps, with a checkpoint every "
        "--checkpoint-every steps written synchronously or in the background, and with none "
        "(tools/benchmarks/checkpoint_stall.py); --nproc, --model, --strategy, --steps and --rounds apply",
    )
    parser.add_argument(
        "--checkpoint-every", type=positive_int, default=None, help="--checkpoint: steps between two (default: 10)"
    )
    parser.add_argument(
        "--strategy",
        choices=OVERHEAD_STRATEGIES,
        default=None,
        help="--overhead: the script and the bare loop's wrap (default: ddp); --checkpoint: the script (default: "
        "fsdp2)",
    )
    parser.add_argument(
        "--no-flight-recorder",
        action="store_true",
        help="--overhead: run the script with --no-flight-recorder (no Flight Recorder, no hang watchdog), to see "
        "what recording the collectives costs a step",
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="--overhead, --checkpoint: runs of each, interleaved (default: %(default)s)",
    )
    parser.add_argument(
        "--speedups",
        action="store_true",
        help="instead: each strategy eager, then with one option more a row (--compile, --fused-adamw, --sdpa-backend "
        "flash, the loss read every --warmup steps, one micro-batch of --larger-batch-size), the same global batch "
        "in every row (tools/benchmarks/speedups.py)",
    )
    parser.add_argument(
        "--larger-batch-size",
        type=micro_batch_size,
        default=None,
        help="--speedups: the last row's one micro-batch, a multiple of --batch-size; the rows above reach the same "
        "global batch in micro-steps of --batch-size (default: 4 x --batch-size)",
    )
    parser.add_argument(
        "--out",
        type=output_file,
        default=None,
        help="the table as JSON; each strategy's run goes beside it, in a folder of its name (default: "
        "runs/benchmark/benchmark.json; with --overhead, --checkpoint or --speedups: overhead.json, checkpoint.json or "
        "speedups.json)",
    )
    add_overwrite_flag(parser)
    args = parser.parse_args(argv)
    modes = [flag for flag in ("--overhead", "--checkpoint", "--speedups") if getattr(args, flag[2:])]
    if len(modes) > 1:
        parser.error(f"{' and '.join(modes)} are benchmarks of their own: give one")
    own = "--overhead" if args.overhead else "--checkpoint"
    if (args.overhead or args.checkpoint) and args.batch_size is not None:
        parser.error(f"{own} runs the script at its own batch: --batch-size does not apply")
    if not args.overhead and args.no_flight_recorder:
        parser.error("--no-flight-recorder applies to --overhead")
    if not (args.overhead or args.checkpoint) and args.strategy is not None:
        parser.error(
            "--strategy applies to --overhead and --checkpoint; the benchmark runs every strategy in its table"
        )
    args.strategy = args.strategy or ("fsdp2" if args.checkpoint else "ddp")
    args.nproc = args.nproc or (1 if args.overhead or args.speedups else torch.cuda.device_count() or 2)
    args.batch_size = args.batch_size or (16 if on_gpu else 8)
    if args.speedups:
        args.larger_batch_size = args.larger_batch_size or 4 * args.batch_size
    check_speedup_flags(parser, args)
    check_checkpoint_flags(parser, args)
    if args.warmup is None:  # --speedups: also the log interval of its later rows
        args.warmup = 25 if args.overhead else 10 if args.speedups else 5
    if args.steps is None:
        args.steps = 200 if args.overhead else 100 if args.checkpoint else 30 if args.speedups else 20
    if args.out is None:
        args.out = Path("runs/benchmark") / f"{mode_of(args)}.json"
    if args.checkpoint and args.checkpoint_every > args.steps:
        parser.error(
            f"--checkpoint-every {args.checkpoint_every} is more than --steps {args.steps}: no checkpoint to time"
        )
    check_output_path(parser, args.out, "--out", overwrite=args.overwrite)
    if not (args.overhead or args.checkpoint):  # their runs go to a temporary folder
        earlier = "an earlier benchmark's runs"
        folders = speedup_run_dirs(args).values() if args.speedups else run_dirs(args.out).values()
        check_run_folders(parser, folders, "--out", args.out, args.overwrite, earlier)
    return args


def mode_of(args: argparse.Namespace) -> str:
    return next((mode for mode in ("overhead", "checkpoint", "speedups") if getattr(args, mode)), "benchmark")


def check_speedup_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--speedups and its --larger-batch-size, which must be a multiple of the rows' micro-batch."""
    if args.larger_batch_size is not None and not args.speedups:
        parser.error("--larger-batch-size is the last row of --speedups: give --speedups too")
    if args.speedups and args.larger_batch_size % args.batch_size:
        parser.error(
            f"--larger-batch-size {args.larger_batch_size} must be a multiple of --batch-size {args.batch_size}: "
            "the rows above it reach the same global batch in micro-steps of --batch-size"
        )


def check_checkpoint_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--checkpoint times its runs from before step 1, and --checkpoint-every is its own."""
    if args.checkpoint_every is not None and not args.checkpoint:
        parser.error("--checkpoint-every is the interval of --checkpoint's saves: give --checkpoint too")
    if args.checkpoint and args.warmup is not None:
        parser.error("--checkpoint times every step, from before step 1: --warmup does not apply")
    args.checkpoint_every = args.checkpoint_every or 10


def run_dirs(out: Path) -> dict[str, Path]:
    """Where each benchmarked strategy's run goes: beside --out, in a folder of the strategy's name."""
    return {name: out.parent / name for name in BENCHMARKED}


def speedup_run_dirs(args: argparse.Namespace) -> dict[tuple[str, int], Path]:
    """Where each --speedups row's run goes: beside --out, in a folder of --out's name, one per strategy and row."""
    rows = planned_rows(args.warmup, args.batch_size, args.larger_batch_size)
    return {
        (name, row): args.out.parent / args.out.stem / f"{name}-{row}"
        for name in BENCHMARKED
        for row in range(len(rows))
    }


def training_flags(args: argparse.Namespace) -> list[str]:
    total = args.warmup + args.steps
    return [
        *("--device", "auto", "--model", args.model, "--mixed-precision", "bf16", "--batch-size", str(args.batch_size)),
        # The first log interval is the warm-up: the final record's throughput leaves it out.
        *("--max-steps", str(total), "--log-interval", str(args.warmup), "--eval-interval", str(total)),
        # Enough synthetic sequences for every step, and no more: generating them is not what is measured.
        *("--train-sequences", str(total * args.batch_size * args.nproc), "--heldout-sequences", str(args.nproc)),
    ]


def row(record: dict[str, Any]) -> dict[str, Any]:
    return {
        "strategy": record["strategy"],
        "processes": record["world_size"],
        "tokens_per_s": record.get("tokens_per_s"),
        "mfu": record.get("mfu"),
        "peak_memory_gib": record["peak_memory_bytes"] / GIB,
        "step_ms": record.get("step_ms"),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| strategy | processes | tokens/s | MFU | peak memory GiB | step ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        lines.append(
            f"| {r['strategy']} | {r['processes']} | {r['tokens_per_s']:.0f} | {mfu} | {r['peak_memory_gib']:.2f} "
            f"| {r['step_ms']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.overhead:
        return overhead_main(args)
    if args.checkpoint:
        result = measure_stall(args.model, args.strategy, args.nproc, args.steps, args.checkpoint_every, args.rounds)
        return print_and_write(stall_table(result), result, args)
    if args.speedups:
        return speedups_main(args)
    flags = training_flags(args)
    rows = []
    try:
        for strategy in (s for s in STRATEGIES if s.name in BENCHMARKED):
            # Run in a folder of its own, which takes the run dir's name once the run has finished.
            with output_folder(run_dirs(args.out)[strategy.name], args.overwrite, finished_run_in) as run_dir:
                record = launch(strategy, args.nproc, run_dir, flags)
            rows.append(row(record))
    except OutputExists as err:  # another benchmark on the same --out finished a run first
        print(f"error: {err}", file=sys.stderr)
        return 1
    summary = {"model": args.model, "batch_size": args.batch_size, "runs": rows}
    return print_and_write(table(rows), summary, args)


def speedups_main(args: argparse.Namespace) -> int:
    """The --speedups table (tools/benchmarks/speedups.py); --out gets the rows so far after each run."""
    total = args.warmup + args.steps
    every_row = [
        *("--device", "auto", "--model", args.model, "--mixed-precision", "bf16"),
        *("--max-steps", str(total), "--eval-interval", str(total)),
        # Enough synthetic sequences for every step, and no more: generating them is not what is measured.
        *(
            "--train-sequences",
            str(total * args.larger_batch_size * args.nproc),
            "--heldout-sequences",
            str(args.nproc),
        ),
    ]
    folders = speedup_run_dirs(args)

    def run_one(strategy: Strategy, name: str, row: int, flags: list[str]) -> Path:
        print(f"\n{strategy.name}: {name}", flush=True)
        try:
            with output_folder(folders[strategy.name, row], args.overwrite, finished_run_in) as run_dir:
                launch(strategy, args.nproc, run_dir, [*every_row, *flags])
        except SystemExit as failure:  # launch's exit, with the run's output
            raise RowFailed(str(failure.code)) from None
        return folders[strategy.name, row]

    def written(rows: list[dict[str, Any]]) -> None:
        # The first write replaces an earlier --out only under --overwrite (checked before any run); later ones, ours.
        write_text(args.out, json.dumps(summary(rows), indent=2) + "\n", args.overwrite or len(rows) > 1)
        print(speedups_table(rows).splitlines()[-1], flush=True)  # the row, before a timeout can stop the table

    def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
        sizes = {"batch_size": args.batch_size, "larger_batch_size": args.larger_batch_size}
        return {"model": args.model, **sizes, "warmup": args.warmup, "steps": args.steps, "runs": rows}

    # FSDP1 last: the legacy API, which a table stopped at its time limit can do without.
    strategies = sorted((s for s in STRATEGIES if s.name in BENCHMARKED), key=lambda s: s.name.startswith("fsdp1"))
    plan = planned_rows(args.warmup, args.batch_size, args.larger_batch_size)
    try:
        rows = speedup_rows(strategies, plan, run_one, args.warmup, written)
    except OutputExists as err:  # another benchmark on the same --out finished a run first
        print(f"error: {err}", file=sys.stderr)
        return 1
    args.overwrite = True  # --out is this benchmark's own by now
    written_out = print_and_write(speedups_table(rows), summary(rows), args)
    return 1 if any("failed" in row for row in rows) else written_out


def overhead_main(args: argparse.Namespace) -> int:
    script_flags = ["--no-flight-recorder"] if args.no_flight_recorder else []
    result = measure(args.model, args.strategy, args.nproc, args.warmup, args.steps, args.rounds, script_flags)
    return print_and_write(overhead_table(result), result, args)


def print_and_write(shown: str, summary: dict[str, Any], args: argparse.Namespace) -> int:
    """The table on the console, then ``summary`` as JSON in --out; 1 if that cannot be written."""
    print()
    print(shown)
    try:
        write_text(args.out, json.dumps(summary, indent=2) + "\n", args.overwrite)
    except OSError as err:
        print(
            f"error: could not write --out {args.out}: {err.strerror or err}. The table above holds it all",
            file=sys.stderr,
        )
        return 1
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_code_of(main, "python -m tools.benchmarks.benchmark"))
