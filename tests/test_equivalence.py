"""Is it still the same training? DDP and every FSDP mode against one process.

Each run uses --deterministic (deterministic kernels, no dropout) and the same
--global-batch-size, so step t sees the same examples at any world size and
any split into micro-steps. Then per-step losses and final parameters must
match the single-process reference.

They match to rounding, not bit for bit: the ranks add their gradients in a
different order than one process does (and FSDP reduce-scatters flat shards),
and float addition is not associative. In fp32 that leaves differences of
about 1e-7, far below the tolerances below and far above zero.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from common.compare_runs import compare
from common.estimate_memory import LAYOUTS, between_steps
from tests.conftest import cases, run_script

LOSS_RTOL = 1e-5  # per-step training loss, relative
# Per-step global gradient norm, relative. Looser than the loss: the norm sums
# a million squares in fp32, and FSDP1 sums them per flat shard, in another
# order than one process does (measured: 1.4e-5 on the MNIST CNN). A broken
# average is off by a factor, not by 1e-4.
GRAD_NORM_RTOL = 1e-4
PARAM_ATOL = 1e-5  # final parameters, largest absolute difference

COMMON = ["--deterministic", "--global-batch-size", "24", "--max-steps", "12", "--log-interval", "1"]
MNIST_ARGS = [*COMMON, "--synthetic"]
# Adam divides each step by the gradient's recent size, so where a gradient is
# tiny, rounding differences become visible steps. At the default lr of 1e-2
# they reach 1e-5 within 12 steps; at 1e-3 they stay near 1e-6.
TRANSFORMER_ARGS = [
    *COMMON,
    # 61 held-out sequences: no world size here splits them evenly.
    *("--block-size", "32", "--train-sequences", "600", "--heldout-sequences", "61"),
    *("--warmup-steps", "3", "--eval-interval", "12", "--lr", "1e-3"),
]

# (id, script, processes, extra flags); each is compared with one process of the same family.
# DDP at 2 processes and with accumulation run on the transformer below; the CNN's
# 3 ranks also split its 2000 test images unevenly (667 + 667 + 666).
MNIST_CASES = [
    ("ddp-3", "ddp/train_mnist.py", 3, []),
    ("fsdp1-full_shard-2", "fsdp/train_mnist.py", 2, []),
]
# For the transformer, also how many ranks share one copy of the model state:
# each rank should hold 1/that of DDP's parameters, gradients and optimizer state.
TRANSFORMER_CASES = [
    ("ddp-2", "ddp/train_transformer.py", 2, [], 1),
    ("ddp-3", "ddp/train_transformer.py", 3, [], 1),
    ("ddp-2x2-accum", "ddp/train_transformer.py", 2, ["--grad-accum-steps", "2"], 1),
    ("fsdp1-full_shard-2", "fsdp/train_transformer.py", 2, ["--sharding-strategy", "full_shard"], 2),
    ("fsdp1-full_shard-4", "fsdp/train_transformer.py", 4, ["--sharding-strategy", "full_shard"], 4),
    # Measured between steps, where SHARD_GRAD_OP holds the same shards as
    # full_shard: PyTorch reshards its parameters after backward too. It keeps
    # them whole only from forward to backward, inside a step.
    ("fsdp1-shard_grad_op-2", "fsdp/train_transformer.py", 2, ["--sharding-strategy", "shard_grad_op"], 2),
    ("fsdp1-no_shard-2", "fsdp/train_transformer.py", 2, ["--sharding-strategy", "no_shard"], 1),
    # Two replicas, each sharded two ways: half of the state, not a quarter.
    ("fsdp1-hybrid_shard-4", "fsdp/train_transformer.py", 4, ["--sharding-strategy", "hybrid_shard"], 2),
    ("fsdp2-2", "fsdp/train_transformer_fsdp2.py", 2, [], 2),
    ("fsdp2-3", "fsdp/train_transformer_fsdp2.py", 3, [], 3),
    ("fsdp2-hsdp-2x2", "fsdp/train_transformer_fsdp2.py", 4, ["--replicate-degree", "2"], 2),
]
# The floor pass (the oldest supported torch) runs the cases at 2 processes.
MNIST_FLOOR = {"fsdp1-full_shard-2"}
TRANSFORMER_FLOOR = {
    "ddp-2",
    "ddp-2x2-accum",
    "fsdp1-full_shard-2",
    "fsdp1-shard_grad_op-2",
    "fsdp1-no_shard-2",
    "fsdp2-2",
}
# Sharded state per rank against DDP's / ranks per copy. FSDP1 pads each unit to
# an even split; FSDP2 cuts every parameter by rows, and uneven rows (64 rows in
# 3) leave the first rank up to 2% more.
SHARE_RTOL = 0.05
ESTIMATE_RTOL = 0.02  # common.estimate_memory against the measured bytes, each kind


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One-process DDP runs: the ground truth every distributed run must reproduce.

    Made once for the whole session, even under ``pytest -n``: the first worker
    to take the lock runs them into the directory all workers share.
    """
    # getbasetemp() is per worker under xdist, and its parent is this session's, shared by
    # the workers. Without xdist the parent is shared by every session of this user, other
    # torch versions' too: there the session's own folder is the one to use.
    session = tmp_path_factory.getbasetemp()
    root = (session.parent if "PYTEST_XDIST_WORKER" in os.environ else session) / "equivalence-references"
    runs = {"mnist": ("ddp/train_mnist.py", MNIST_ARGS), "transformer": ("ddp/train_transformer.py", TRANSFORMER_ARGS)}
    with FileLock(f"{root}.lock"):
        if not (root / "done").exists():
            for name, (script, args) in runs.items():
                run_script(script, args, root / name).check()
            (root / "done").touch()
    return {name: root / name for name in runs}


def final_record(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records[-1]


def assert_same_training(reference: Path, candidate: Path, description: str) -> None:
    """The same loss, gradient norm and parameters at every step, and the same evaluation."""
    result = compare(reference, candidate)
    assert result.steps == 12, description
    assert result.max_loss_rel_diff <= LOSS_RTOL, f"step {result.worst_step} differs\n{description}"
    assert result.max_grad_norm_rel_diff <= GRAD_NORM_RTOL, description
    assert result.max_param_abs_diff is not None
    assert result.max_param_abs_diff <= PARAM_ATOL, f"{result.worst_param} differs\n{description}"
    # Each rank scores its own unpadded share of the held-out set; the sums over ranks
    # must count every example once and agree with one process to rounding.
    expected, final = final_record(reference), final_record(candidate)
    assert final["eval_samples"] == expected["eval_samples"], description
    assert final["eval_loss"] == pytest.approx(expected["eval_loss"], rel=LOSS_RTOL), description


@pytest.mark.parametrize(("case", "script", "nproc", "extra"), cases(MNIST_CASES, floor=MNIST_FLOOR))
def test_mnist_matches_one_process(
    case: str, script: str, nproc: int, extra: list[str], references: dict[str, Path], tmp_path: Path
) -> None:
    run = run_script(script, [*MNIST_ARGS, *extra], tmp_path, nproc=nproc).check()
    assert_same_training(references["mnist"], tmp_path, run.describe())


@pytest.mark.parametrize(
    ("case", "script", "nproc", "extra", "per_copy"), cases(TRANSFORMER_CASES, floor=TRANSFORMER_FLOOR)
)
def test_transformer_matches_one_process(
    case: str,
    script: str,
    nproc: int,
    extra: list[str],
    per_copy: int,
    references: dict[str, Path],
    tmp_path: Path,
) -> None:
    run = run_script(script, [*TRANSFORMER_ARGS, *extra], tmp_path, nproc=nproc).check()
    assert_same_training(references["transformer"], tmp_path, run.describe())
    final = run.final()
    assert_state_as_predicted(final, final_record(references["transformer"]), per_copy, tmp_path / "model.pt")
    assert_throughput_is_the_run_average(final, run.events("train"))


def assert_state_as_predicted(final: dict, reference: dict, per_copy: int, model_file: Path) -> None:
    """Each rank holds DDP's model state / ranks per copy, as common.estimate_memory predicts."""
    assert final["shard_group_size"] == per_copy, final
    held, full = final["local_state_bytes"], reference["local_state_bytes"]
    assert sum(held.values()) == pytest.approx(sum(full.values()) / per_copy, rel=SHARE_RTOL), (held, full)
    shapes = [tuple(t.shape) for t in torch.load(model_file, weights_only=True).values()]
    predicted = between_steps(shapes, per_copy, LAYOUTS[final["strategy"]]).as_dict()
    assert held == pytest.approx(predicted, rel=ESTIMATE_RTOL), (held, predicted)


def assert_throughput_is_the_run_average(final: dict, train_records: list[dict]) -> None:
    """All tokens over all the time the logged steps took: not an average of per-interval rates."""
    assert [r["step"] for r in train_records] == list(range(1, 13))  # --log-interval 1
    seconds = sum(r["step_ms"] for r in train_records) / 1000
    tokens = final["global_batch_size"] * 32 * 12  # --block-size 32, 12 steps
    assert final["tokens_per_s"] == pytest.approx(tokens / seconds, rel=1e-9)
    assert final["step_ms"] == pytest.approx(1000 * seconds / 12, rel=1e-9)
    assert "mfu" not in final  # only on a GPU


BREAKAGES = {
    # One rank's gradient counts double: the ranks no longer average fairly.
    "one-rank-doubled": "(loss * (2.0 if ctx.rank == 1 else 1.0)).backward()",
    # Gradients summed over ranks instead of averaged, as some releases did for
    # FSDP2 on gloo; Adam hides it from the loss, the gradient norm does not.
    "summed-not-averaged": "(loss * ctx.world_size).backward()",
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_broken_gradient_averaging_is_caught(breakage: str, references: dict[str, Path], tmp_path: Path) -> None:
    """The comparison has teeth: a copy of the DDP script with its averaging broken must fail it."""
    source = (Path(__file__).resolve().parents[1] / "ddp/train_transformer.py").read_text()
    healthy = "loss.backward()"
    assert source.count(healthy) == 1
    broken = tmp_path / "train_transformer_broken.py"
    broken.write_text(source.replace(healthy, BREAKAGES[breakage]))

    run = run_script(str(broken), TRANSFORMER_ARGS, tmp_path / "run", nproc=2).check()
    result = compare(references["transformer"], tmp_path / "run")
    assert result.max_grad_norm_rel_diff > 100 * GRAD_NORM_RTOL, run.describe()
    if breakage == "one-rank-doubled":
        assert result.max_loss_rel_diff > 100 * LOSS_RTOL, run.describe()
        assert result.max_param_abs_diff is not None
        assert result.max_param_abs_diff > 100 * PARAM_ATOL, run.describe()
