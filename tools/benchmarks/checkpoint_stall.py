"""What checkpoints cost the training, written synchronously and in the background (--async-checkpoint).

``python -m tools.benchmarks.benchmark --checkpoint [--model PRESET] [--strategy ddp|fsdp2] [--nproc N]
[--steps N] [--checkpoint-every K] [--rounds R]`` trains N steps three ways, in turns (synchronous saves, saves
in the background, no saves), so that a machine that slows down meanwhile slows all three: a checkpoint every K
steps in the first two. tools/benchmarks/timed_saves.py times, on rank 0, how long each save held the step (in
the background: the copy of the state, and any wait for the save before it) and the loop's wall, from before
step 1 to the last checkpoint complete. Each figure is the median of R rounds; the blocked time of a round is
the median over its saves.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from tools.processes import one_thread_per_rank, output_of, scratch_folder, standalone_torchrun
from tools.strategies import BY_NAME

REPO = Path(__file__).resolve().parents[2]
TIMED_SAVES = "tools/benchmarks/timed_saves.py"
# (name, the flags that make it); each trains the same steps.
MODES = (("synchronous", []), ("background", ["--async-checkpoint"]), ("never", None))


def timed_run(
    strategy: str, model: str, nproc: int, steps: int, save_flags: list[str] | None, every: int, folder: Path
) -> dict[str, Any]:
    """One run of ``steps`` steps; ``save_flags`` None: it saves nothing."""
    script = BY_NAME[strategy]
    times_file = folder / "times.json"
    interval = "0" if save_flags is None else str(every)
    command = [
        *(*standalone_torchrun(nproc), TIMED_SAVES, str(times_file), script.script, *script.flags),
        *("--model", model, "--device", "auto", "--run-dir", str(folder / "run"), "--max-steps", str(steps)),
        *("--log-interval", str(steps), "--eval-interval", str(steps), "--checkpoint-interval", interval),
        *("--keep-checkpoints", "1", *(save_flags or [])),
    ]
    returncode, output = output_of(command, env=one_thread_per_rank(), cwd=REPO)
    if returncode != 0:
        sys.exit(f"{' '.join(command)} failed (exit code {returncode}):\n{output}")
    return json.loads(times_file.read_text())


def measure_stall(model: str, strategy: str, nproc: int, steps: int, every: int, rounds: int) -> dict[str, Any]:
    """Interleaved runs of each mode; each mode's medians, and its wall against the run that never saves."""
    blocked: dict[str, list[float]] = {name: [] for name, _ in MODES}
    walls: dict[str, list[float]] = {name: [] for name, _ in MODES}
    with scratch_folder("checkpoint-stall-") as scratch:
        for round_ in range(rounds):
            for name, flags in MODES:
                times = timed_run(strategy, model, nproc, steps, flags, every, scratch / f"{name}-{round_}")
                if times["blocked_s"]:
                    blocked[name].append(statistics.median(times["blocked_s"]))
                walls[name].append(times["loop_wall_s"])
            print(f"round {round_ + 1}/{rounds}: " + ", ".join(f"{n} {walls[n][-1]:.2f} s" for n, _ in MODES))
    never = statistics.median(walls["never"])
    return {
        "model": model,
        "strategy": strategy,
        "processes": nproc,
        "steps": steps,
        "checkpoint_every": every,
        "rounds": rounds,
        "blocked_s": blocked,  # each round's median over its saves
        "loop_wall_s": walls,
        "modes": {
            name: {
                "blocked_ms_per_save": 1000 * statistics.median(blocked[name]) if blocked[name] else None,
                "loop_wall_s": statistics.median(walls[name]),
                "wall_over_never": statistics.median(walls[name]) / never,
            }
            for name, _ in MODES
        },
    }


def stall_table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['model']}, {result['strategy']}, {result['processes']} processes, {result['steps']} steps, a "
        f"checkpoint every {result['checkpoint_every']} (medians of {result['rounds']})",
        "",
        "| checkpoints | blocked ms per save | wall s | wall / never |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, mode in result["modes"].items():
        blocked = f"{mode['blocked_ms_per_save']:.1f}" if mode["blocked_ms_per_save"] is not None else "-"
        lines.append(f"| {name} | {blocked} | {mode['loop_wall_s']:.2f} | {mode['wall_over_never']:.3f} |")
    return "\n".join(lines)
