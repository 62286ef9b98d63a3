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

from common.communication import KIND_OF_OP
from common.compare_runs import compare
from common.compare_runs import main as compare_runs_main
from common.estimate_communication import run_estimate
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
# --profile 2 on one run of each script: a trace per rank, while the run still matches one process.
PROFILE = ["--profile", "2"]
MNIST_CASES = [
    ("ddp-3", "ddp/train_mnist.py", 3, PROFILE),
    ("fsdp1-full_shard-2", "fsdp/train_mnist.py", 2, PROFILE),
]
# For the transformer, also how many ranks share one copy of the model state:
# each rank should hold 1/that of DDP's parameters, gradients and optimizer state.
# With --grad-accum-steps 2 (x2-accum), gradients are reduced once per optimizer step.
TRANSFORMER_CASES = [
    ("ddp-2", "ddp/train_transformer.py", 2, PROFILE, 1),
    ("ddp-4", "ddp/train_transformer.py", 4, [], 1),
    ("ddp-2x2-accum", "ddp/train_transformer.py", 2, ["--grad-accum-steps", "2"], 1),
    ("fsdp1-full_shard-2", "fsdp/train_transformer.py", 2, ["--sharding-strategy", "full_shard", *PROFILE], 2),
    (
        "fsdp1-full_shard-4x2-accum",
        "fsdp/train_transformer.py",
        4,
        ["--sharding-strategy", "full_shard", "--grad-accum-steps", "2"],
        4,
    ),
    # Measured between steps, where SHARD_GRAD_OP holds the same shards as
    # full_shard: PyTorch reshards its parameters after backward too. It keeps
    # them whole only from forward to backward, inside a step.
    ("fsdp1-shard_grad_op-2", "fsdp/train_transformer.py", 2, ["--sharding-strategy", "shard_grad_op"], 2),
    ("fsdp1-no_shard-2", "fsdp/train_transformer.py", 2, ["--sharding-strategy", "no_shard"], 1),
    # Two replicas, each sharded two ways: half of the state, not a quarter.
    ("fsdp1-hybrid_shard-4", "fsdp/train_transformer.py", 4, ["--sharding-strategy", "hybrid_shard"], 2),
    ("fsdp2-2", "fsdp/train_transformer_fsdp2.py", 2, PROFILE, 2),
    # Three ranks: 64 rows do not split evenly, so shards and messages carry padding.
    ("fsdp2-3x2-accum", "fsdp/train_transformer_fsdp2.py", 3, ["--grad-accum-steps", "2"], 3),
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
    # The size-based policy makes fc1 the CNN's only unit besides the root.
    assert_communication_as_predicted(run.final(), tmp_path / "model.pt", extra, unit_prefixes=["fc1."])
    if PROFILE[0] in extra:
        assert_traces_show_the_collectives(tmp_path, nproc, run.final()["strategy"])


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
    assert_communication_as_predicted(final, tmp_path / "model.pt", extra)
    if PROFILE[0] in extra:
        assert_traces_show_the_collectives(tmp_path, nproc, final["strategy"])


def assert_state_as_predicted(final: dict, reference: dict, per_copy: int, model_file: Path) -> None:
    """Each rank holds DDP's model state / ranks per copy, as common.estimate_memory predicts."""
    assert final["shard_group_size"] == per_copy, final
    held, full = final["local_state_bytes"], reference["local_state_bytes"]
    assert sum(held.values()) == pytest.approx(sum(full.values()) / per_copy, rel=SHARE_RTOL), (held, full)
    shapes = [tuple(t.shape) for t in torch.load(model_file, weights_only=True).values()]
    predicted = between_steps(shapes, per_copy, LAYOUTS[final["strategy"]]).as_dict()
    assert held == pytest.approx(predicted, rel=ESTIMATE_RTOL), (held, predicted)


def micro_steps(extra: list[str]) -> int:
    return int(extra[extra.index("--grad-accum-steps") + 1]) if "--grad-accum-steps" in extra else 1


def assert_communication_as_predicted(
    final: dict, model_file: Path, extra: list[str], unit_prefixes: list[str] | None = None
) -> None:
    """What one step's collectives moved, by kind, is exactly what common.estimate_communication says.

    Exactly, padding included: FSDP2 at 3 ranks pads 64 rows to 66 in every all-gather and
    reduce-scatter (1.8% more bytes), and the formula pads as FSDP does.
    """
    shapes = {name: tuple(t.shape) for name, t in torch.load(model_file, weights_only=True).items()}
    k = micro_steps(extra)
    world, group, strategy = final["world_size"], final["shard_group_size"], final["strategy"]
    predicted = run_estimate(strategy, shapes, world, group, micro_steps=k, unit_prefixes=unit_prefixes)
    measured = (final["comm_bytes_per_step"], final["collectives_per_step"], final["comm_ring_bytes_per_step"])
    assert measured[:2] == (predicted.bytes, predicted.counts), (measured, predicted)
    assert measured[2] == pytest.approx(predicted.ring_bytes, rel=1e-12), (measured, predicted)
    if k > 1:
        # Measured, not only predicted: under no_sync (DDP) and set_requires_gradient_sync(False)
        # (FSDP2) the gradients are reduced once per optimizer step, as at K = 1, while FSDP gathers
        # the parameters again in every micro-step.
        once = run_estimate(strategy, shapes, world, group, unit_prefixes=unit_prefixes).bytes
        reduced = ("all_reduce", "reduce_scatter")
        assert {kind: measured[0].get(kind) for kind in reduced} == {kind: once.get(kind) for kind in reduced}
        gathered, gathered_once = measured[0].get("all_gather", 0), once.get("all_gather", 0)
        if strategy.startswith("fsdp2"):  # FSDP2 frees every unit after every backward
            assert gathered == k * gathered_once
        elif strategy.startswith("fsdp1"):  # but FSDP1's last layer (SHARD_GRAD_OP) stays through no_sync
            assert gathered_once < gathered < k * gathered_once


def assert_traces_show_the_collectives(run_dir: Path, nproc: int, strategy: str) -> None:
    """--profile 2: one Chrome trace per rank, holding steps 2 and 3 and the strategy's collectives."""
    expected = {"ddp": {"all_reduce"}}.get(strategy, {"all_gather", "reduce_scatter"})
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == [f"rank-{r}.json" for r in range(nproc)]
    for rank in range(nproc):
        trace = json.loads((run_dir / "profile" / f"rank-{rank}.json").read_text())
        names = [event.get("name", "") for event in trace["traceEvents"]]
        assert [n for n in names if n.startswith("optimizer step")] == ["optimizer step 2", "optimizer step 3"]
        assert expected <= {KIND_OF_OP.get(name) for name in names}, (rank, sorted(set(names))[:50])


def assert_throughput_is_the_run_average(final: dict, train_records: list[dict]) -> None:
    """All tokens over all the time the logged steps took after the first (warm-up) interval: not an
    average of per-interval rates, and not diluted by the slow first step."""
    assert [r["step"] for r in train_records] == list(range(1, 13))  # --log-interval 1
    measured = train_records[1:]
    seconds = sum(r["step_ms"] for r in measured) / 1000
    tokens = final["global_batch_size"] * 32 * len(measured)  # --block-size 32
    assert final["tokens_per_s"] == pytest.approx(tokens / seconds, rel=1e-9)
    assert final["step_ms"] == pytest.approx(1000 * seconds / len(measured), rel=1e-9)
    assert "mfu" not in final  # only on a GPU


def test_profiling_changes_no_loss(references: dict[str, Path], tmp_path: Path) -> None:
    """--profile 2 traces steps 2 and 3 and moves the measured step from 3 to 4: the same losses, bit for bit.

    The one launch this file adds for it: one process, four steps. With 3 warm-up steps the
    learning rates of the first four do not depend on --max-steps, so their losses and gradient
    norms must equal the unprofiled reference's first four.
    """
    run = run_script("ddp/train_transformer.py", [*TRANSFORMER_ARGS, "--max-steps", "4", *PROFILE], tmp_path).check()
    reference = [json.loads(line) for line in (references["transformer"] / "metrics.jsonl").read_text().splitlines()]
    expected = [(r["loss"], r["grad_norm"]) for r in reference if r["event"] == "train"][:4]
    assert [(r["loss"], r["grad_norm"]) for r in run.events("train")] == expected, run.describe()
    assert (tmp_path / "profile" / "rank-0.json").exists()
    assert run.final()["comm_bytes_per_step"] == final_record(references["transformer"])["comm_bytes_per_step"]


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


def write_run(run_dir: Path, losses: list[float]) -> Path:
    run_dir.mkdir()
    records = [{"event": "train", "step": step, "loss": loss, "grad_norm": 1.0} for step, loss in enumerate(losses, 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return run_dir


@pytest.mark.parametrize(("other", "code", "verdict"), [([2.0, 1.0], 0, "SAME"), ([2.0, 1.1], 1, "DIFFERENT")])
def test_compare_runs_gives_its_verdict(
    other: list[float], code: int, verdict: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = write_run(tmp_path / "a", [2.0, 1.0]), write_run(tmp_path / "b", other)
    assert compare_runs_main([str(first), str(second), "--loss-rtol", "1e-5"]) == code
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"{verdict}:")
