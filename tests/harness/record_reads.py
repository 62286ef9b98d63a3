"""Run a training script with its training set writing down every example it reads, and who read it.

    torchrun --standalone --nproc_per_node=2 tests/harness/record_reads.py FOLDER SCRIPT [FLAGS...]

SCRIPT may be another wrapper (inject_fault.py FAULT SCRIPT ...), and flags before FOLDER are passed on.

Each process appends to FOLDER/reads-PID.jsonl: a first line naming the process (rank, world size
and the job it belongs to), a line with the step it resumed at, then one line per example the
training loader reads, its index, as it reads it. ``trained_steps`` puts them back together as the
examples each optimizer step trained on, keeping, for a step trained twice (a crash, then a resume
from an earlier checkpoint), the generation that came later.

The evaluation's examples are not counted: only what ``common.data.train_loader`` is given.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

# What tells two generations of one job's processes apart: a new torchrun (its run id: a later launch may be
# given the port an earlier one let go of), an in-job restart, a requeue.
GENERATION_VARIABLES = (
    *("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"),
    *("SLURM_JOB_ID", "SLURM_RESTART_COUNT"),
)


def generation_of(environ: Mapping[str, str], world_size: int, pid: int) -> list[Any]:
    """This process's generation: what its launcher set, or, for a process alone in its world (`python
    script.py` sets none of the variables), the process itself."""
    return [environ.get(name) for name in GENERATION_VARIABLES] if world_size > 1 else [pid]


class ReadsRecorded(Dataset):
    def __init__(self, dataset: Dataset, log: Callable[[dict[str, Any]], None]) -> None:
        self.dataset, self.log = dataset, log

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        self.log({"read": index})
        return self.dataset[index]


def main() -> None:
    # FOLDER is the argument just before the program; a launcher that puts flags first (the sbatch
    # launchers' --run-dir and --resume) has them passed on after the program, as it would to the script.
    arguments = sys.argv[1:]
    at = next(index for index, argument in enumerate(arguments) if argument.endswith(".py"))
    folder, script = Path(arguments[at - 1]), arguments[at]
    # The checkout's root, as the scripts put it first: a Slurm job's processes have no PYTHONPATH of the tests'.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import common.checkpoint
    import common.data

    folder.mkdir(parents=True, exist_ok=True)
    out = (folder / f"reads-{os.getpid()}.jsonl").open("a", buffering=1)  # a line survives a SIGKILL after it

    def log(record: dict[str, Any]) -> None:
        out.write(json.dumps(record) + "\n")

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    generation = generation_of(os.environ, world_size, os.getpid())
    log({
        "rank": int(os.environ.get("RANK", "0")),
        "world_size": world_size,
        "generation": generation,
        "started": time.time(),
    })  # fmt: skip
    train_loader, resume = common.data.train_loader, common.checkpoint.Checkpointer.resume

    def recorded_loader(dataset: Dataset, *args: Any, **kwargs: Any) -> Any:
        return train_loader(ReadsRecorded(dataset, log), *args, **kwargs)

    def recorded_resume(self: Any, *args: Any, **kwargs: Any) -> Any:
        resumed = resume(self, *args, **kwargs)
        log({"resumed_at": resumed.step})
        return resumed

    common.data.train_loader = recorded_loader  # the scripts import it by name, after this
    common.checkpoint.Checkpointer.resume = recorded_resume  # type: ignore[method-assign]
    sys.argv = [script, *arguments[: at - 1], *arguments[at + 1 :]]
    runpy.run_path(script, run_name="__main__")


def trained_steps(folder: Path, global_batch: int) -> dict[int, list[int]]:
    """Step number (from 1) -> the sorted indices of the examples it trained, all ranks together.

    A process reads global_batch / world_size examples a step, from the step after the one it resumed
    at. Generations are taken in the order they started; each one's steps replace what earlier ones
    read from its own first step on, which an earlier generation may have read and not trained.
    """
    generations: dict[tuple, dict[str, Any]] = {}
    for path in folder.glob("reads-*.jsonl"):
        # A process killed mid-write leaves at most its last line torn.
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
        header, rest = lines[0], lines[1:]
        resumed_at = [line["resumed_at"] for line in rest if "resumed_at" in line]
        reads = [line["read"] for line in rest if "read" in line]
        if not resumed_at:
            assert not reads, f"{path}: reads before the run resumed or started"
            continue  # stopped before training: a refusal, or killed while it started
        generation = generations.setdefault(
            tuple(header["generation"]), {"started": header["started"], "resumed_at": resumed_at[0], "steps": {}}
        )
        assert generation["resumed_at"] == resumed_at[0], f"{path}: the ranks of one generation resumed apart"
        generation["started"] = min(generation["started"], header["started"])
        per_step = global_batch // header["world_size"]
        for offset in range(0, len(reads), per_step):
            step = resumed_at[0] + offset // per_step + 1
            generation["steps"].setdefault(step, []).extend(reads[offset : offset + per_step])
    trained: dict[int, list[int]] = {}
    for generation in sorted(generations.values(), key=lambda generation: generation["started"]):
        trained = {step: indices for step, indices in trained.items() if step <= generation["resumed_at"]}
        trained.update({step: sorted(indices) for step, indices in generation["steps"].items()})
    return trained


def assert_trained_once(reads: Path, reference: Path, global_batch: int, description: str) -> None:
    """The steps recorded in ``reads`` trained, step for step, the examples the uninterrupted run recorded in
    ``reference`` did: the same multiset, each example of an epoch once, whatever stopped the run between."""
    trained, expected = trained_steps(reads, global_batch), trained_steps(reference, global_batch)
    assert expected, f"the uninterrupted run recorded no reads in {reference}"
    assert sorted(trained) == sorted(expected), (
        f"steps trained {sorted(trained)}, by the uninterrupted run {sorted(expected)}\n{description}"
    )
    differing = [step for step in expected if trained[step] != expected[step]]
    assert not differing, (
        f"steps {differing} trained other examples than the uninterrupted run's: step {differing[0]}: "
        f"{trained[differing[0]]} instead of {expected[differing[0]]}\n{description}"
    )


if __name__ == "__main__":
    main()
