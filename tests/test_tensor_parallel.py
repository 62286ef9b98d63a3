"""FSDP2 plus tensor parallelism on a 2-D mesh (fsdp/train_transformer_fsdp2_tp.py) trains what one process trains.

The one-process reference and its twins are the session's ``transformer_noise``: the DDP script at one
process, which builds the same weights and trains the same examples as the TP script at one process (a
world of one trains the model unsplit). So each case here costs only its own ranks.

Two cases, the cheapest that cover the acceptance of issue 57: 1 x 2 (tensor parallelism alone, all 20
steps), and 2 x 2 stopped after a few steps, then resumed at 1 x 2 from its sharded checkpoint. The second
is the 2 x 2 equivalence too: the resumed run's history holds the 2 x 2 steps, and the comparison reads
every step. A separate 2 x 2 run of all 20 steps would add about 40 CPU-seconds (four ranks on two cores)
and check nothing these two do not.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.harness.cases import NEEDS_FSDP2_ON_CPU
from tests.harness.noise_floor import TRANSFORMER_ARGS, TRANSFORMER_STEPS, NoiseRuns, assert_same_training
from tests.harness.runs import Run, run_script, run_until_stopped

TP_SCRIPT = "fsdp/train_transformer_fsdp2_tp.py"
TP_2 = ["--tp-degree", "2"]

pytestmark = NEEDS_FSDP2_ON_CPU


def assert_mesh(run: Run, groups: int) -> None:
    line = f"2-D mesh: {groups} data-parallel group(s) of 2 tensor-parallel rank(s)"
    assert run.output.count(line) >= 1, f"no {line!r}\n{run.describe()}"


def assert_scored_once(run: Run, reference: Path) -> None:
    """The ranks of a group score the same sequences: the evaluation must count them once."""
    scored = run.final()["eval_samples"]
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    expected = records[-1]["eval_samples"]
    assert scored == expected, f"eval_samples {scored}, one process {expected}\n{run.describe()}"


def test_tensor_parallel_alone_1x2_matches_one_process(transformer_noise: NoiseRuns, tmp_path: Path) -> None:
    run = run_script(TP_SCRIPT, [*TRANSFORMER_ARGS, *TP_2], tmp_path, nproc=2).check()
    assert_mesh(run, groups=1)
    assert_same_training(transformer_noise, tmp_path, run.describe(), TRANSFORMER_STEPS)
    assert_scored_once(run, transformer_noise.reference)


def test_2x2_stopped_and_resumed_at_1x2_matches_one_process(transformer_noise: NoiseRuns, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    stopped = run_until_stopped(TP_SCRIPT, [*TRANSFORMER_ARGS, *TP_2], run_dir, nproc=4, stop_after=4).check()
    assert_mesh(stopped, groups=2)
    run = run_script(TP_SCRIPT, [*TRANSFORMER_ARGS, *TP_2, "--resume"], run_dir, nproc=2).check()
    assert_mesh(run, groups=1)
    (resume,) = run.events("resume")
    assert resume["world_size"] == 2 and 4 <= resume["step"] < TRANSFORMER_STEPS, resume
    # The 2 x 2 steps before the checkpoint and the 1 x 2 steps after it, against one process.
    assert_same_training(transformer_noise, run_dir, run.describe(), TRANSFORMER_STEPS)
    assert_scored_once(run, transformer_noise.reference)
