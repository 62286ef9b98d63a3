"""The table of speed-ups: ``python -m tools.benchmarks.benchmark --speedups``, one step of the way at a time.

Each strategy (DDP, FSDP1 full_shard, FSDP2) trains the same model in bf16, on the same global batch, once per
row, and each row adds one option to the row above it:

    eager                      as a plain loop runs: the host reads the loss every step (--log-interval 1), and
                               the global batch comes in micro-steps of --batch-size (--grad-accum-steps)
    + compile                  --compile: torch.compile per Block, before the wrap
    + fused AdamW              --fused-adamw
    + flash attention          --sdpa-backend flash
    + loss read every W steps  --log-interval W (W: --warmup): the host lets the GPU run ahead in between
    + one micro-batch of N     --batch-size N (--larger-batch-size), one micro-step: the same global batch

Every row trains the same examples in the same order, so a row's gain is speed alone: tests/test_speedups.py
shows on CPU that each option changes no number it should not. Each row's figures are the mean over the
steps after --warmup: tokens per second, ms per step, MFU (on a GPU whose peak is known) and the gain over
the row above.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.records import final_record, read_records

# (the row's name, the flags it adds to every row from it on); the last two rows are built in planned_rows.
OPTIONS = (
    ("eager", []),
    ("+ compile", ["--compile"]),
    ("+ fused AdamW", ["--fused-adamw"]),
    ("+ flash attention", ["--sdpa-backend", "flash"]),
)


class RowFailed(Exception):
    """A row's run failed; its text is the run's output. The strategy's later rows, which add to it, are skipped."""


def planned_rows(warmup: int, batch_size: int, larger_batch_size: int) -> list[tuple[str, list[str]]]:
    """Each row's name and the flags that make it, cumulative; ``larger_batch_size`` is a multiple of
    ``batch_size``, so the first rows accumulate micro-batches to the same global batch as the last."""
    micro_steps = ["--batch-size", str(batch_size), "--grad-accum-steps", str(larger_batch_size // batch_size)]
    options: list[str] = []
    rows = []
    for name, added in OPTIONS:
        options = [*options, *added]
        rows.append((name, [*options, *micro_steps, "--log-interval", "1"]))  # a host read of the loss each step
    # The warm-up is the first log interval, as in the rows above: the measured steps start after it either way.
    rows.append((f"+ loss read every {warmup} steps", [*options, *micro_steps, "--log-interval", str(warmup)]))
    one_micro_batch = ["--batch-size", str(larger_batch_size), "--log-interval", str(warmup)]
    rows.append((f"+ one micro-batch of {larger_batch_size}", [*options, *one_micro_batch]))
    return rows


def measured(run_dir: Path, warmup: int) -> dict[str, Any]:
    """Tokens/s, ms per step and MFU over the steps after ``warmup``, from the run's train records (each one the
    mean of its log interval, evaluation and logging left out), and the peak memory of the final record."""
    records = read_records(run_dir).of("train")
    final = final_record(run_dir)
    steps = seconds = tokens = 0.0
    for before, record in zip([{"step": 0}, *records], records, strict=False):
        if record["step"] > warmup:
            interval_steps = record["step"] - before["step"]
            interval_seconds = record["step_ms"] * interval_steps / 1000
            steps, seconds = steps + interval_steps, seconds + interval_seconds
            tokens += record["tokens_per_s"] * interval_seconds
    tokens_per_s = tokens / seconds
    # MFU is proportional to the throughput: the run's own figure (its peak, its FLOPs per token), rescaled.
    mfu = final["mfu"] * tokens_per_s / final["tokens_per_s"] if final.get("mfu") is not None else None
    return {
        "processes": final["world_size"],
        "tokens_per_s": tokens_per_s,
        "step_ms": 1000 * seconds / steps,
        "mfu": mfu,
        "peak_memory_gib": final["peak_memory_bytes"] / 2**30,
        "steps": int(steps),
    }


def speedup_rows(
    strategies: list[Any],
    rows: list[tuple[str, list[str]]],
    run_one: Callable[[Any, str, int, list[str]], Path],
    warmup: int,
    written: Callable[[list[dict[str, Any]]], None],
) -> list[dict[str, Any]]:
    """Every strategy's rows in turn; ``run_one(strategy, row name, row index, flags)`` trains one and says where
    its run is, and ``written`` gets the table so far after each: a run stopped later keeps the rows before. A row
    that fails is a row with its error, and the strategy's later rows are skipped; the other strategies still run
    (one GPU session, one chance)."""
    table: list[dict[str, Any]] = []
    for strategy in strategies:
        before = None
        for index, (name, flags) in enumerate(rows):
            try:
                figures = measured(run_one(strategy, name, index, flags), warmup)
            except RowFailed as failure:
                print(failure, file=sys.stderr, flush=True)
                table.append({"strategy": strategy.name, "step": name, "failed": last_error(str(failure))})
                written(table)
                break
            gain = figures["tokens_per_s"] / before if before else None
            table.append({"strategy": strategy.name, "step": name, **figures, "gain": gain})
            before = figures["tokens_per_s"]
            written(table)
    return table


def last_error(output: str) -> str:
    """The line of a failed run's output that names its error (the last such), or its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line]
    return (errors or lines or ["no output"])[-1]


def speedups_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| strategy | step | tokens/s | step ms | MFU | gain | peak memory GiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['strategy']} | {r['step']} | failed: {r['failed'][:200]} | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        gain = f"x{r['gain']:.2f}" if r["gain"] is not None else ""
        lines.append(
            f"| {r['strategy']} | {r['step']} | {r['tokens_per_s']:.0f} | {r['step_ms']:.1f} | {mfu} | {gain} "
            f"| {r['peak_memory_gib']:.2f} |"
        )
    return "\n".join(lines)
