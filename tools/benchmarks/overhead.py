"""What the harness costs a step: a training script against a bare loop of the same training, at any world size.

``python -m tools.benchmarks.benchmark --overhead [--model PRESET] [--strategy ddp|fsdp2] [--nproc N]`` runs
both under torchrun, in turns (script, bare, script, bare...), so that a machine that slows down meanwhile
slows both. The bare loop (tools/benchmarks/bare_loop.py) trains the same GPT with the script's own defaults
for the preset, on the same synthetic Markov data, with the same per-rank batch, AdamW, gradient clipping and
wrap, and nothing else. Both time the steps after the same warm-up: the script's final record leaves out its
first log interval, and the bare loop starts its clock after as many steps. One thread per process unless
OMP_NUM_THREADS says otherwise: the ranks share the machine's cores, and a thread count is part of the setup.
"""

from __future__ import annotations

import json
import runpy
import statistics
import sys
from pathlib import Path
from typing import Any

from tools.processes import one_thread_per_rank, output_of, scratch_folder, standalone_torchrun
from tools.records import final_record, read_records
from tools.strategies import BY_NAME, Strategy

REPO = Path(__file__).resolve().parents[2]
BARE_LOOP = "tools/benchmarks/bare_loop.py"
OVERHEAD_STRATEGIES = ("ddp", "fsdp2")  # the bare loop wraps as these scripts do


def script_defaults(strategy: Strategy, model: str, run_dir: Path) -> Any:
    """The script's flags as its parser fills them for ``--model``: the training the bare loop repeats.
    ``run_dir``: a folder that does not exist, so that no earlier run in the default one refuses them."""
    parse_args = runpy.run_path(str(REPO / strategy.script))["parse_args"]
    args, _ = parse_args([*strategy.flags, "--model", model, "--device", "cpu", "--run-dir", str(run_dir)])
    return args


def bare_settings(strategy: Strategy, model: str, warmup: int, steps: int, scratch: Path) -> dict[str, Any]:
    """What the bare loop reads: the script's defaults for the preset, the strategy, and the clock's steps."""
    return bare_settings_of(script_defaults(strategy, model, scratch / "never-written"), strategy.name, warmup, steps)


def bare_settings_of(args: Any, strategy: str, warmup: int, steps: int) -> dict[str, Any]:
    """What the bare loop reads, from a transformer script's parsed flags ``args``."""
    return {
        "strategy": strategy,
        "model": {name: getattr(args, name) for name in ("block_size", "n_layer", "n_head", "d_model", "dropout")},
        **{name: getattr(args, name) for name in ("block_size", "train_sequences", "heldout_sequences", "seed")},
        **{name: getattr(args, name) for name in ("batch_size", "grad_accum_steps", "lr", "weight_decay", "grad_clip")},
        **{name: getattr(args, name) for name in ("warmup_steps", "min_lr_ratio")},
        "warmup": warmup,
        "steps": steps,
    }


def script_run(
    strategy: Strategy, model: str, nproc: int, warmup: int, steps: int, run_dir: Path, flags: list[str]
) -> dict[str, float]:
    """The script's own mean step time: its final record's step_ms, which leaves out the first log interval.
    ``flags``: more of the script's own (--no-flight-recorder), which change what it does, not what it trains."""
    total = warmup + steps
    command = [
        *standalone_torchrun(nproc),
        *(strategy.script, *strategy.flags, "--model", model, "--device", "auto", "--run-dir", str(run_dir)),
        *("--max-steps", str(total), "--log-interval", str(warmup), "--eval-interval", str(total)),
        *flags,
    ]
    returncode, output = output_of(command, env=one_thread_per_rank(), cwd=REPO)
    if returncode != 0:
        sys.exit(f"{' '.join(command)} failed (exit code {returncode}):\n{output}")
    record = final_record(run_dir)
    last_loss = read_records(run_dir).of("train")[-1]["loss"]  # the last step logs
    return {
        "step_ms": record["step_ms"],
        "last_loss": last_loss,
        "parameter_bytes": record["local_state_bytes"]["params"],
    }


def bare_run(settings_file: Path, nproc: int) -> dict[str, float]:
    """The bare loop under torchrun, as the script runs."""
    command = [*standalone_torchrun(nproc), BARE_LOOP, str(settings_file)]
    returncode, output = output_of(command, env=one_thread_per_rank(), cwd=REPO)
    results = [line for line in output.splitlines() if line.startswith('{"rank": 0')]
    if returncode != 0 or len(results) != 1:
        sys.exit(f"{' '.join(command)} failed (exit code {returncode}):\n{output}")
    return json.loads(results[0])


def measure(
    model: str, strategy_name: str, nproc: int, warmup: int, steps: int, rounds: int, script_flags: list[str]
) -> dict[str, Any]:
    """Interleaved runs of the script and the bare loop; their medians and the ratio."""
    strategy = BY_NAME[strategy_name]
    ours, bare, last_losses, parameter_bytes = [], [], [], set()
    with scratch_folder("overhead-") as scratch:
        settings_file = scratch / "bare-loop.json"
        settings_file.write_text(json.dumps(bare_settings(strategy, model, warmup, steps, scratch)))
        for round_ in range(rounds):
            script = script_run(strategy, model, nproc, warmup, steps, scratch / f"script-{round_}", script_flags)
            loop = bare_run(settings_file, nproc)
            last_losses.append(loop["last_loss"])
            ours.append(script["step_ms"])
            bare.append(loop["step_ms"])
            parameter_bytes |= {script["parameter_bytes"], loop["parameter_bytes"]}
            if script["last_loss"] != loop["last_loss"]:
                sys.exit(
                    f"the bare loop trained other numbers than the script: last loss {loop['last_loss']!r} "
                    f"against the script's {script['last_loss']!r}"
                )
            print(f"round {round_ + 1}/{rounds}: script {ours[-1]:.2f} ms/step, bare loop {bare[-1]:.2f}", flush=True)
    if len(parameter_bytes) != 1:
        sys.exit(f"the script and the bare loop trained models of other sizes: {sorted(parameter_bytes)} bytes")
    script_median, bare_median = statistics.median(ours), statistics.median(bare)
    return {
        "model": model,
        "strategy": strategy_name,
        "processes": nproc,
        "script_flags": script_flags,
        "threads_per_process": one_thread_per_rank()["OMP_NUM_THREADS"],  # as given: torch reads it, not this
        "warmup": warmup,
        "steps": steps,
        "script_ms": ours,
        "bare_ms": bare,
        "last_losses": last_losses,  # each round's, the script's and the bare loop's alike
        "script_median_ms": script_median,
        "bare_median_ms": bare_median,
        "ratio": script_median / bare_median,
        "parameter_bytes": parameter_bytes.pop(),
    }


def overhead_table(result: dict[str, Any]) -> str:
    return "\n".join([
        "| model | strategy | processes | script ms/step | bare loop ms/step | ratio |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
        f"| {result['model']} | {result['strategy']} | {result['processes']} | {result['script_median_ms']:.2f} "
        f"| {result['bare_median_ms']:.2f} | {result['ratio']:.3f} |",
    ])  # fmt: skip
