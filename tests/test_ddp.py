"""End-to-end tests of the DDP scripts, launched as a user launches them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.mnist import MnistNet
from common.models import GPT, GPTConfig
from tests.harness.cases import CONVERGE_ARGS, MNIST_ARGS, NEAR_FLOOR
from tests.harness.runs import Run, run_script

MNIST = "ddp/train_mnist.py"
TRANSFORMER = "ddp/train_transformer.py"


def first_and_last_train_loss(metrics: list[dict]) -> tuple[float, float]:
    losses = [record["loss"] for record in metrics if record["event"] == "train"]
    assert len(losses) >= 2, metrics
    return losses[0], losses[-1]


def test_mnist_trains(mnist_dir: Path, tmp_path: Path) -> None:
    """Three processes: an odd world size, where uneven splits would show. One process runs in
    test_equivalence.py and test_checkpoint.py."""
    nproc = 3
    run = run_script(MNIST, [*MNIST_ARGS, "--data-dir", str(mnist_dir)], tmp_path, nproc=nproc).check()
    final = run.final()
    first, last = first_and_last_train_loss(run.metrics())
    assert last < 0.5 * first, run.describe()
    assert final["accuracy"] >= 0.90, run.describe()
    assert final["world_size"] == nproc
    assert final["global_batch_size"] == 32 * nproc
    assert final["eval_samples"] == 1999

    state = torch.load(tmp_path / "model.pt", weights_only=True)
    MnistNet().load_state_dict(state)  # strict: same keys, no "module." prefix
    check_metrics_contract(run, nproc)


def check_metrics_contract(run: Run, world_size: int) -> None:
    """The fields that tools and users' plots rely on, in metrics.jsonl."""
    train_records = run.events("train")
    assert [record["step"] for record in train_records][:3] == [10, 20, 30]
    for record in train_records:
        assert {"step", "epoch", "loss", "grad_norm", "lr", "samples_per_s", "step_ms"} <= record.keys()
    assert [record["epoch"] for record in run.events("eval")] == [1, 2]
    assert {"step", "loss", "accuracy", "samples"} <= run.events("eval")[-1].keys()
    final = run.final()
    expected = {"script", "strategy", "world_size", "global_batch_size", "steps", "eval_loss", "accuracy",
                "eval_samples", "peak_memory_bytes", "wall_s", "local_state_bytes"}  # fmt: skip
    assert expected <= final.keys()
    assert final["steps"] == train_records[-1]["step"] == 2 * (3000 // (32 * world_size))
    assert final["peak_memory_bytes"] > 0
    tensors = list(MnistNet().parameters())
    parameters = sum(p.numel() for p in tensors)
    # DDP keeps full fp32 parameters and gradients on every rank. Adadelta keeps
    # two fp32 running averages per parameter and a float32 step count per tensor.
    assert final["local_state_bytes"] == {
        "params": 4 * parameters,
        "grads": 4 * parameters,
        "optimizer": 8 * parameters + 4 * len(tensors),
    }


def test_transformer_trains_close_to_floor(tmp_path: Path) -> None:
    """One process; test_equivalence.py shows that 2, 3 and 4 train the same, DDP and FSDP alike."""
    run = run_script(TRANSFORMER, CONVERGE_ARGS, tmp_path).check()
    final = run.final()
    first, last = first_and_last_train_loss(run.metrics())
    assert last < first - 0.8, run.describe()
    # A uniform guess costs log(16) = 2.77 nats; at block size 32 the floor is 1.19.
    assert final["entropy_floor"] == pytest.approx(1.1911, abs=1e-3)
    assert final["eval_loss"] - final["entropy_floor"] < NEAR_FLOOR, run.describe()

    state = torch.load(tmp_path / "model.pt", weights_only=True)
    config = GPTConfig(vocab_size=16, block_size=32, n_layer=2, n_head=4, d_model=64)
    GPT(config).load_state_dict(state)
