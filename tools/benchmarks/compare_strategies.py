"""Train the transformer under DDP, every FSDP mode and FSDP2 + TP, and show what each rank holds and sends.

    python -m tools.benchmarks.compare_strategies --model tiny --world-sizes 1 2 4
    python -m tools.benchmarks.compare_strategies --model small --world-sizes 2 4 --steps 50 --png memory.png
    python -m tools.benchmarks.compare_strategies --world-sizes 4 --strategies ddp fsdp2 -- --batch-size 8
    python -m tools.benchmarks.compare_strategies --from-runs runs/compare_strategies --png memory.svg

Each configuration runs through torchrun for a few steps; its final metrics.jsonl record gives the
per-rank bytes of parameters, gradients and optimizer state (the rank holding the most), the peak
memory, the throughput, and what one optimizer step's collectives moved, by kind. Beside each
figure, in parentheses, is what ``tools.estimates.estimate_memory`` and ``tools.estimates.estimate_communication``
predict from the shapes in the run's model.pt. Hybrid modes need an even world size of at least 4 (2 replicas
of at least 2 shards) and are skipped elsewhere; FSDP2 + TP, with a line saying why, where its script refuses.
--png draws model state and peak memory per rank, measured (solid) beside estimated (dashed; the
peak's estimate is the model state at its peak, without activations or the runtime's own memory),
and step time, by world size, one line per strategy. --from-runs trains nothing: it reads the
finished runs an earlier comparison left in its --out-dir, prints their table and draws them.
Arguments after ``--`` go to every training script unchanged, after (so overriding) the ones this
command passes: --device, --model, --max-steps, --log-interval, --eval-interval, and a smaller
synthetic data set (--train-sequences 2000 --heldout-sequences 200).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import runpy
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from common.cli import HelpFormatter
from common.flags import output_dir, positive_int
from common.models import GPT_PRESETS
from common.outputs import OutputExists, output_folder
from common.run_dir import MODEL_FILE
from tools.command_flags import existing_dir, output_file, refuse_outputs_on_one_path
from tools.estimates.estimate_memory import LAYOUTS, Estimate
from tools.estimates.in_flight import gathered_units, in_flight_bytes
from tools.estimates.modelled_collectives import run_estimate
from tools.estimates.shard_sizes import StateBytes, between_steps
from tools.estimates.tensor_parallel import TensorParallel, as_fsdp2, refused_world_sizes
from tools.output_checks import (
    add_overwrite_flag,
    check_output_folder,
    check_output_path,
    check_run_folders,
    finished_run_in,
)
from tools.processes import exit_code_of, output_of, standalone_torchrun
from tools.records import UnreadableRecord, final_record, read_records
from tools.runs.plot import FORMATS as FIGURE_FORMATS
from tools.runs.plot import PlotError, pyplot, save_figure_or_exit
from tools.strategies import BY_NAME, Strategy
from tools.strategies import STRATEGIES as ALL_STRATEGIES

if TYPE_CHECKING:
    from matplotlib.figure import Figure

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20


# fsdp1_no_shard is left out: it holds and sends what DDP does, through FSDP1's machinery.
STRATEGIES = [strategy for strategy in ALL_STRATEGIES if strategy.name != "fsdp1_no_shard"]


def launch(strategy: Strategy, world_size: int, run_dir: Path, common_flags: list[str]) -> dict:
    """One torchrun; the final record of its metrics.jsonl. Exits with the run's output if it fails."""
    command = [
        *standalone_torchrun(world_size),
        strategy.script,
        *strategy.flags,
        *("--run-dir", str(run_dir)),
        *common_flags,
    ]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # the ranks share this machine's cores
    print(f"$ {' '.join(command)}", flush=True)
    returncode, output = output_of(command, env=env, cwd=REPO)  # nothing of it outlives this command
    if returncode != 0:
        sys.exit(f"{strategy.name} at {world_size} failed (exit code {returncode}):\n{output}")
    return final_record(run_dir)


def parameter_shapes(run_dir: Path) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the whole model's parameters, from the plain state dict every run saves."""
    state = torch.load(run_dir / MODEL_FILE, map_location="cpu", weights_only=True, mmap=True)
    return {name: tuple(tensor.shape) for name, tensor in state.items()}


def _mib(measured: float, estimated: float) -> str:
    return f"{measured / MIB:.3f} ({estimated / MIB:.3f})"


COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def communication_cells(record: dict, shapes: Mapping[str, Sequence[int]], micro_steps: int) -> list[str]:
    """Measured (estimated) MiB per optimizer step: each kind's messages, then what a ring sends per link."""
    if "comm_bytes_per_step" not in record:  # a run too short to measure a step
        return ["n/a"] * (len(COMM_KINDS) + 1)
    predicted = run_estimate(
        record["strategy"],
        shapes,
        record["world_size"],
        record["shard_group_size"],
        record.get("mixed_precision", "fp32"),
        micro_steps,
        tp=tensor_parallel_of(record, micro_steps),
    )
    sent = record["comm_bytes_per_step"]
    cells = [_mib(sent.get(kind, 0), predicted.bytes.get(kind, 0)) for kind in COMM_KINDS]
    return [*cells, _mib(sum(record["comm_ring_bytes_per_step"].values()), predicted.total_ring_bytes)]


def markdown_table(runs: Sequence[tuple[dict, Mapping[str, Sequence[int]]]], micro_steps: int = 1) -> str:
    """One row per (final record, parameter shapes by name); measured values with the estimate in parentheses."""
    ddp_totals = {
        record["world_size"]: sum(record["local_state_bytes"].values())
        for record, _ in runs
        if record["strategy"] == "ddp"
    }
    lines = [
        "| strategy | ranks | ranks per copy | params MiB | grads MiB | optimizer MiB | model state MiB "
        "| vs DDP | peak memory MiB | step ms | tokens/s | all-gather MiB | reduce-scatter MiB | all-reduce MiB "
        "| sent per link MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for record, shapes in runs:
        held = record["local_state_bytes"]
        predicted = estimated_state(record, shapes)
        total = sum(held.values())
        ddp_total = ddp_totals.get(record["world_size"])
        ratio = f"{total / ddp_total:.2f}" if ddp_total else "n/a"
        step_ms = f"{record['step_ms']:.1f}" if "step_ms" in record else "n/a"
        rate = f"{record['tokens_per_s']:.0f}" if "tokens_per_s" in record else "n/a"
        lines.append(
            f"| {record['strategy']} | {record['world_size']} | {ranks_per_copy(record)} "
            f"| {_mib(held['params'], predicted.params)} | {_mib(held['grads'], predicted.grads)} "
            f"| {_mib(held['optimizer'], predicted.optimizer)} | {_mib(total, predicted.total)} | {ratio} "
            f"| {record['peak_memory_bytes'] / MIB:.0f} | {step_ms} | {rate} | "
            + " | ".join(communication_cells(record, shapes, micro_steps))
            + " |"
        )
    return "\n".join(lines)


MARKERS = ("o", "s", "^", "v", "D", "P")


def tensor_parallel_of(record: dict, micro_steps: int = 1) -> TensorParallel | None:
    """An FSDP2 + TP run's tensor parallelism, from its final record: its groups are its ranks over FSDP's shard
    group (the script has no HSDP), and each group trains one micro-batch of the global batch."""
    if LAYOUTS[record["strategy"]] != "tp":
        return None
    config, dp = record["model_config"], record["shard_group_size"]
    batch = record["global_batch_size"] // dp // micro_steps
    return TensorParallel(record["world_size"] // dp, batch, config["block_size"], config["d_model"])


def ranks_per_copy(record: dict) -> int:
    """The ranks that hold one copy of the model between them: FSDP's shard group, and under tensor parallelism
    each of its ranks' groups too (the record's shard_group_size counts the data-parallel groups only)."""
    tp = tensor_parallel_of(record)
    return record["shard_group_size"] * (tp.degree if tp else 1)


def sharded_shapes(record: dict, shapes: Mapping[str, Sequence[int]]) -> tuple[dict[str, tuple[int, ...]], str]:
    """The shapes FSDP shards in this run, and how: the model's, or under tensor parallelism each rank's pieces."""
    tp = tensor_parallel_of(record)
    return as_fsdp2(shapes, LAYOUTS[record["strategy"]], tp.degree if tp else 1)


def estimated_state(record: dict, shapes: Mapping[str, Sequence[int]]) -> StateBytes:
    pieces, layout = sharded_shapes(record, shapes)
    return between_steps(pieces.values(), record["shard_group_size"], layout)


def estimated_peak_state(record: dict, shapes: Mapping[str, Sequence[int]]) -> float:
    """Model state at its peak in a step, as tools.estimates.estimate_memory counts it without a model's activations:
    held during the step plus the units gathered, and one unit's gradients. Activations and the runtime's
    own memory are not in it, so it is a floor of the peak."""
    precision = "bf16" if record.get("mixed_precision") in ("bf16", "fp16") else "fp32"  # 2 bytes either way
    strategy = BY_NAME[record["strategy"]].textbook
    group = record["shard_group_size"]
    pieces, layout = sharded_shapes(record, shapes)
    units = gathered_units(pieces, layout, group, precision)
    in_flight = in_flight_bytes(strategy, units, precision, gradients=True)
    state = estimated_state(record, shapes)
    return Estimate(0, strategy, group, state, in_flight).peak


def comparison_figure(runs: Sequence[tuple[dict, Mapping[str, Sequence[int]]]]) -> Figure:
    """Model state and peak memory per rank (measured solid, estimated dashed) and step time, by world size:
    one line per strategy."""
    plt = pyplot()
    figure, (state_axes, peak_axes, time_axes) = plt.subplots(1, 3, figsize=(13, 4.2))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    strategies = list(dict.fromkeys(record["strategy"] for record, _ in runs))
    for index, strategy in enumerate(strategies):
        points = sorted(
            ((r, shapes) for r, shapes in runs if r["strategy"] == strategy), key=lambda run: run[0]["world_size"]
        )
        sizes = [record["world_size"] for record, _ in points]
        # Strategies that hold the same bytes draw over each other: smaller markers on top keep each in sight.
        style = {"color": colours[index % len(colours)], "gid": strategy}
        measured = {**style, "marker": MARKERS[index % len(MARKERS)], "markersize": 9 - index % len(MARKERS)}
        estimated = {**style, "marker": "x", "linestyle": "--", "linewidth": 0.8}
        held = [sum(record["local_state_bytes"].values()) / MIB for record, _ in points]
        state_axes.plot(sizes, held, label=strategy, **measured)
        state_axes.plot(sizes, [estimated_state(*run).total / MIB for run in points], label="_estimated", **estimated)
        peaks = [record["peak_memory_bytes"] / MIB for record, _ in points]
        peak_axes.plot(sizes, peaks, label=strategy, **measured)
        peak_axes.plot(sizes, [estimated_peak_state(*run) / MIB for run in points], label="_estimated", **estimated)
        timed = [(record["world_size"], record["step_ms"]) for record, _ in points if "step_ms" in record]
        time_axes.plot([size for size, _ in timed], [ms for _, ms in timed], label=strategy, **measured)
    world_sizes = sorted({record["world_size"] for record, _ in runs})
    titles = (
        (state_axes, "model state per rank", "MiB (dashed: estimated)"),
        (peak_axes, "peak memory per rank", "MiB (dashed: estimated state at its peak)"),
        (time_axes, "step time", "ms per optimizer step"),
    )
    for axes, title, ylabel in titles:
        axes.set_title(title, fontsize=10)
        axes.set_xlabel("world size (ranks)")
        axes.set_ylabel(ylabel, fontsize=8)
        axes.set_xscale("log", base=2)
        axes.set_xticks(world_sizes, [str(size) for size in world_sizes])
        axes.minorticks_off()
        axes.grid(alpha=0.3)
    peak_axes.set_yscale("log")  # on a CPU the measured peak is the whole process, far above the model's state
    state_axes.legend(fontsize=7)
    figure.tight_layout()
    return figure


def saved_runs(out_dir: Path) -> list[tuple[dict, dict[str, tuple[int, ...]]]]:
    """The finished runs of an earlier comparison in ``out_dir`` (its STRATEGY-WORLDSIZE folders), in the order
    this command makes them: by world size, then strategy."""
    order = {strategy.name: index for index, strategy in enumerate(STRATEGIES)}
    runs = []
    for run_dir in sorted(out_dir.iterdir()):
        strategy, _, size = run_dir.name.rpartition("-")
        if strategy in order and size.isdigit() and finished_run_in(run_dir) and (run_dir / MODEL_FILE).is_file():
            final = read_records(run_dir).final  # UnreadableRecord for a damaged file: main's one message
            if final is None:  # stopped or killed before its end: nothing to compare, and the others still are
                print(f"{run_dir}: left out, no final record (the run did not finish)", file=sys.stderr)
                continue
            runs.append((final, parameter_shapes(run_dir)))
    return sorted(runs, key=lambda run: (run[0]["world_size"], order[run[0]["strategy"]]))


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:] if argv is None else argv
    passed_on = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="python -m tools.benchmarks.compare_strategies",
        usage="%(prog)s [options] [-- FLAGS FOR EVERY TRAINING SCRIPT]",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--model",
        choices=sorted(GPT_PRESETS),
        default="tiny",
        help="the scripts' --model preset (default: %(default)s)",
    )
    parser.add_argument(
        "--world-sizes", type=positive_int, nargs="+", default=[1, 2, 4], metavar="N", help="(default: %(default)s)"
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        choices=[s.name for s in STRATEGIES],
        default=[s.name for s in STRATEGIES],
        help="(default: all)",
    )
    parser.add_argument("--steps", type=positive_int, default=20, help="optimizer steps per run (default: %(default)s)")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda", "auto"],
        default="auto",
        help="as the scripts' --device: auto takes the GPUs if CUDA is available (default: %(default)s)",
    )
    parser.add_argument(
        "--out-dir",
        type=output_dir,
        default=Path("runs/compare_strategies"),
        help="each run's folder goes in here, as STRATEGY-WORLDSIZE (default: %(default)s)",
    )
    parser.add_argument(
        "--png",
        type=output_file,
        help="also draw model state and peak memory per rank (measured beside estimated) and step time by world "
        "size, one line per strategy, in this file (.png, or .svg)",
    )
    parser.add_argument(
        "--from-runs",
        type=existing_dir,
        metavar="OUT_DIR",
        help="train nothing: table (and with --png draw) the finished runs an earlier comparison left in its "
        "--out-dir, every one there, assuming one micro-step per optimizer step",
    )
    add_overwrite_flag(parser)
    args = parser.parse_args(own)
    if args.png is not None:
        if args.png.suffix.lower() not in FIGURE_FORMATS:
            parser.error(
                f"--png {args.png}: the name must end in {' or '.join(FIGURE_FORMATS)}, which picks the format"
            )
        check_output_path(parser, args.png, "--png", overwrite=args.overwrite)
    if args.from_runs is not None:
        check_saved_runs(parser, args.from_runs, passed_on)
        return args, passed_on
    refuse_outputs_on_one_path(parser, args)  # --out-dir is an output only when this command trains
    scripts = sorted({strategy.script for strategy in STRATEGIES if strategy.name in args.strategies})
    settings = check_script_flags(parser, scripts, script_flags(args, passed_on))
    args.tp_refused = refused_world_sizes(args.world_sizes, settings.get(BY_NAME["fsdp2_tp"].script))
    if not planned_runs(args):  # every run skipped: nothing to compare
        why = [f"fsdp2_tp at {world}: {reason}" for world, reason in args.tp_refused.items()]
        why += ["hybrid sharding needs an even world of 4 or more"] * any(BY_NAME[n].hybrid for n in args.strategies)
        parser.error(f"no run of --strategies can start at --world-sizes {args.world_sizes} ({'; '.join(why)})")
    check_out_dir(parser, args)
    return args, passed_on


def script_flags(args: argparse.Namespace, passed_on: list[str]) -> list[str]:
    """The flags every training script gets: this command's settings, then the user's after ``--``."""
    return [
        *("--device", args.device, "--model", args.model, "--max-steps", str(args.steps)),
        *("--log-interval", str(max(1, args.steps // 4)), "--eval-interval", str(args.steps)),
        # Memory and speed do not depend on how much data there is; generating less starts faster.
        *("--train-sequences", "2000", "--heldout-sequences", "200"),
        *passed_on,  # last, so that they win over the flags above
    ]


def check_script_flags(parser: argparse.ArgumentParser, scripts: list[str], flags: list[str]) -> dict[str, Any]:
    """Each script's own parser reads the flags now, in this process at one rank: a typo after ``--`` is one line
    before any run, not a failed torchrun later. What each made of them, as its parse_args returns it: the flags
    resolved and as given (TP's after its row's flags, as launched)."""
    parsed = {}
    with tempfile.TemporaryDirectory() as scratch:
        for script in scripts:
            said = io.StringIO()
            own = BY_NAME["fsdp2_tp"].flags if script == BY_NAME["fsdp2_tp"].script else ()
            try:
                with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
                    parse = runpy.run_path(str(REPO / script))["parse_args"]
                    parsed[script] = parse([*own, *flags, "--run-dir", f"{scratch}/run"])
            except SystemExit as stop:
                if stop.code:
                    lines = [line for line in said.getvalue().splitlines() if "error: " in line]
                    error = lines[-1].split("error: ", 1)[1] if lines else said.getvalue().strip()
                    parser.error(f"the flags for {script}: {error}")
    return parsed


def planned_runs(args: argparse.Namespace) -> list[tuple[Strategy, int, Path]]:
    """Each run this command starts: its strategy, world size and run dir, in order. A TP row runs where its
    script accepts the world size (``args.tp_refused``), any other where ``Strategy.runs_at`` says it can."""
    return [
        (strategy, world_size, args.out_dir / f"{strategy.name}-{world_size}")
        for world_size in args.world_sizes
        for strategy in STRATEGIES
        if strategy.name in args.strategies
        and (world_size not in args.tp_refused if strategy.layout == "tp" else strategy.runs_at(world_size))
    ]


def check_out_dir(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--out-dir is a folder this command can write in, and holds no earlier run unless --overwrite says so."""
    check_output_folder(parser, args.out_dir, "--out-dir")
    run_dirs = [run_dir for _, _, run_dir in planned_runs(args)]
    check_run_folders(parser, run_dirs, "--out-dir", args.out_dir, args.overwrite)


def check_saved_runs(parser: argparse.ArgumentParser, out_dir: Path, passed_on: list[str]) -> None:
    """--from-runs names a folder that holds a comparison's runs, and no flags for training scripts come with it."""
    if passed_on:
        parser.error("--from-runs trains nothing: the flags after -- would go to no script")
    names = {f"{strategy.name}-" for strategy in STRATEGIES}
    found = [d for d in out_dir.iterdir() if d.name.rstrip("0123456789") in names and finished_run_in(d)]
    if not found:
        parser.error(
            f"--from-runs {out_dir} holds no finished run of a comparison (STRATEGY-WORLDSIZE folders with "
            "metrics.jsonl): give the --out-dir of an earlier python -m tools.benchmarks.compare_strategies"
        )


def micro_steps(flags: Sequence[str]) -> int:
    """--grad-accum-steps among the flags passed to the scripts (the last one wins, as in argparse)."""
    values = [flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag == "--grad-accum-steps"]
    return int(values[-1]) if values else 1


def main(argv: list[str] | None = None) -> None:
    args, passed_on = parse_args(argv)
    common_flags = script_flags(args, passed_on)
    try:
        runs = saved_runs(args.from_runs) if args.from_runs is not None else train_runs(args, common_flags)
    except UnreadableRecord as err:
        sys.exit(f"python -m tools.benchmarks.compare_strategies: {err}")
    if not runs:
        sys.exit(
            f"python -m tools.benchmarks.compare_strategies: no run in {args.from_runs} finished: nothing to compare"
        )
    print()
    print(markdown_table(runs, micro_steps(common_flags)))
    print(
        "\nmeasured (estimated): bytes held between steps by the rank that holds the most; the estimate is "
        "tools.estimates.estimate_memory's.\npeak memory: CUDA's peak allocation on a GPU; on CPU the process's peak "
        "resident set, Python and torch included.\nall-gather, reduce-scatter, all-reduce: message bytes of one "
        "optimizer step's collectives (rank 0's; the third step);\nsent per link: what a ring algorithm sends "
        "from each rank for them. Estimates: tools.estimates.estimate_communication's."
    )
    if args.png is not None:
        try:
            figure = comparison_figure(runs)
        except PlotError as err:
            sys.exit(f"no chart: {err}; the table above holds it all")
        save_figure_or_exit(figure, args.png, args.overwrite, "--png", "; the table above holds it all")
        print(f"chart: {args.png}")


def train_runs(args: argparse.Namespace, common_flags: list[str]) -> list[tuple[dict, dict[str, tuple[int, ...]]]]:
    """Each planned run, trained now: its final record and parameter shapes."""
    for world_size, why in args.tp_refused.items():  # said before the first run, so not missed as a failure
        print(f"fsdp2_tp at {world_size} rank(s) skipped: its script would refuse it ({why})", flush=True)
    runs = []
    try:
        for strategy, world_size, final_dir in planned_runs(args):
            # Run in a folder of its own, which takes the run dir's name once the run has finished.
            with output_folder(final_dir, args.overwrite, finished_run_in) as run_dir:
                runs.append((launch(strategy, world_size, run_dir, common_flags), parameter_shapes(run_dir)))
    except OutputExists as err:  # another comparison in the same --out-dir finished a run first
        sys.exit(f"error: {err}")
    return runs


if __name__ == "__main__":
    sys.exit(exit_code_of(main, "python -m tools.benchmarks.compare_strategies"))
