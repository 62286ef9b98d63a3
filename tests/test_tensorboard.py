"""--tensorboard: metrics.jsonl's numbers as TensorBoard scalars, read back with TensorBoard's own reader.

One run, resumed twice at 2 ranks: DDP to step 8, DDP resumed to 16, then FSDP2 resumed from step 10 (a rollback,
at another strategy, with another --lr so that the abandoned steps' losses differ). After each part, what a user
sees in TensorBoard (EventAccumulator, which applies the purges as the TensorBoard server does) must be exactly the
numbers of metrics.jsonl: each at its record's step, once, and nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from common.run_dir import TENSORBOARD_DIR
from tests.harness.cases import NEEDS_FSDP2_ON_CPU
from tests.harness.runs import Run, run_script
from tests.harness.wrappers import OBSERVE

DDP, FSDP2 = "ddp/train_transformer.py", "fsdp/train_transformer_fsdp2.py"
# A checkpoint every 2 steps, the newest 4 kept: step-10 is still there when the run has reached 16.
ARGS = [
    *("--global-batch-size", "8", "--block-size", "16", "--train-sequences", "400", "--heldout-sequences", "16"),
    *("--log-interval", "1", "--eval-interval", "5", "--checkpoint-interval", "2", "--keep-checkpoints", "4"),
    "--tensorboard",
]


def shown(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series TensorBoard shows for the run dir: tag -> (step, value) in the order it draws them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(run_dir / TENSORBOARD_DIR), size_guidance={"scalars": 0})  # 0: keep every point
    reader.Reload()
    return {tag: [(point.step, point.value) for point in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def numbers(run: Run) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl's numbers as the series they should be: EVENT/FIELD -> (step, value as float32), the final
    record at its step count; a scalar event holds float32, so that is the value it can hold."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in run.metrics():
        step = record["step"] if "step" in record else record["steps"]
        for name, value in record.items():
            if name != "step" and type(value) in (int, float):
                series.setdefault(f"{record['event']}/{name}", []).append((step, float(np.float32(value))))
    return series


def assert_shows_metrics(run: Run, parts: int) -> dict[str, list[tuple[int, float]]]:
    series = shown(run.run_dir)
    expected = numbers(run)
    assert {"train/loss", "train/lr", "train/grad_norm", "eval/loss", "final/peak_memory_bytes"} <= expected.keys()
    differ = sorted(tag for tag in series.keys() | expected.keys() if series.get(tag) != expected.get(tag))
    shown_and_held = [f"{tag}: TensorBoard {series.get(tag)}, metrics.jsonl {expected.get(tag)}" for tag in differ]
    assert not differ, f"after part {parts}, TensorBoard and metrics.jsonl disagree:\n" + "\n".join(shown_and_held)
    # Only rank 0 writes: one event file for each start of the run, not one a rank.
    files = sorted((run.run_dir / TENSORBOARD_DIR).glob("events.out.tfevents.*"))
    assert len(files) == parts, [path.name for path in files]
    return series


@NEEDS_FSDP2_ON_CPU
def test_tensorboard_shows_metrics_jsonl_as_one_line_across_resumes_and_a_rollback(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="pip install tensorboard (requirements.txt)")
    run_dir = tmp_path / "run"
    first = run_script(DDP, [*ARGS, "--max-steps", "8"], run_dir, nproc=2).check()
    assert [step for step, _ in assert_shows_metrics(first, parts=1)["train/loss"]] == list(range(1, 9))

    # Resumed at step 8: the first part's final record (at step 8) leaves metrics.jsonl, and TensorBoard too.
    second = run_script(DDP, [*ARGS, "--max-steps", "16", "--resume"], run_dir, nproc=2).check()
    series = assert_shows_metrics(second, parts=2)
    assert [step for step, _ in series["train/loss"]] == list(range(1, 17)), "one line, each step once"
    assert [step for step, _ in series["final/eval_loss"]] == [16]
    abandoned_loss, abandoned_lr = dict(series["train/loss"]), dict(series["train/lr"])

    # Rolled back to step 10 under FSDP2: steps 11 to 16 are trained again, and only the new ones are shown.
    checkpoint = run_dir / "checkpoints" / "step-10.pt"
    rollback = ["--max-steps", "20", "--resume-from", str(checkpoint), "--lr", "3e-3"]
    third = run_script(FSDP2, [*ARGS, *rollback], run_dir, nproc=2).check()
    series = assert_shows_metrics(third, parts=3)
    assert [step for step, _ in series["train/loss"]] == list(range(1, 21)), "one line, each step once"
    loss, lr = dict(series["train/loss"]), dict(series["train/lr"])
    assert all(loss[step] == abandoned_loss[step] for step in range(1, 11)), "the steps before the rollback stay"
    # Gone: the abandoned branch's lr at each of steps 11 to 16, its loss from step 12 (step 11's loss is that of
    # the weights of step 10 in both branches).
    assert all(lr[step] != abandoned_lr[step] for step in range(11, 17)), "an abandoned step's lr is shown"
    assert all(loss[step] != abandoned_loss[step] for step in range(12, 17)), "an abandoned step's loss is shown"


# MNIST on generated images, 2 steps in one process, forked from the launcher (which never loads tensorboard).
SHORT_MNIST = ["--synthetic", "--max-steps", "2", "--batch-size", "16", "--test-batch-size", "100"]


def test_a_run_without_the_flag_never_imports_tensorboard(tmp_path: Path) -> None:
    loaded = {}
    for name, flags in (("without", []), ("with", ["--tensorboard"])):
        run = run_script("ddp/train_mnist.py", [*SHORT_MNIST, *flags], tmp_path / name, wrapper=[OBSERVE, "imports"])
        imports = json.loads((run.check().run_dir / "observed-imports-rank0.json").read_text())["imports"]
        loaded[name] = "tensorboard" in imports
    # With the flag it is loaded: the observation sees the package where a run imports it.
    assert loaded == {"without": False, "with": True}, "a copied script must run without the package"
