"""End-to-end tests of the FSDP scripts (FSDP1 and FSDP2), launched as a user launches them.

What is checked: the MNIST script trains to a useful model, and its model.pt
is a plain state dict that loads into the unwrapped model and reproduces the
reported evaluation; every option that runs without a GPU trains. GPU-only
options are at the end, marked ``cuda``. Elsewhere: that every strategy
computes what one process computes (so the transformer scripts train as the
DDP one does, which test_ddp.py takes near the loss floor), while a rank holds
about 1/N of the training state, is test_equivalence.py's job; the FSDP
transformers' model.pt and exported checkpoints are checked in
test_checkpoint.py; flag mistakes are test_bad_input.py's.

Each launch belongs to one test, so ``pytest -n auto`` never starts the same
run twice on different workers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

from common.mnist import MNIST_MEAN, MNIST_STD, MnistNet
from common.models import GPT, GPTConfig
from tests.harness.cases import MNIST_ARGS, NEEDS_FSDP2_CPU_OFFLOAD, NEEDS_FSDP2_ON_CPU
from tests.harness.runs import Run, run_script, run_until_stopped
from tests.harness.wrappers import OBSERVE

MNIST = "fsdp/train_mnist.py"
DDP = "ddp/train_transformer.py"
FSDP1 = "fsdp/train_transformer.py"
FSDP2 = "fsdp/train_transformer_fsdp2.py"

# A few steps on little data: every collective runs, and the state of a trained
# step (parameters, gradients, optimizer moments) exists to be measured.
SHORT_ARGS = [
    "--max-steps", "4", "--log-interval", "2", "--eval-interval", "4", "--lr", "1e-2", "--block-size", "32",
    "--train-sequences", "1000", "--heldout-sequences", "200",
]  # fmt: skip
# What every transformer run here trains: the tiny preset at block size 32 over 16 tokens.
GPT_CONFIG = GPTConfig(vocab_size=16, block_size=32, n_layer=2, n_head=4, d_model=64)


def train_losses(run: Run) -> list[float]:
    losses = [record["loss"] for record in run.events("train")]
    assert len(losses) >= 2, run.describe()
    return losses


def load_plain(model: torch.nn.Module, path: Path) -> torch.nn.Module:
    """Load model.pt the way a user would, insisting on the unwrapped model's exact names."""
    state = torch.load(path, weights_only=True)
    # The DDP scripts save the inner module's state_dict(): these names, in this order.
    assert list(state) == list(model.state_dict()), list(state)
    assert all(value.device.type == "cpu" and value.dtype == torch.float32 for value in state.values())
    model.load_state_dict(state)
    return model.eval()


# --- training to a useful model, saved as a plain state dict --------------------------------------


def test_mnist_trains_and_saves_the_plain_model(mnist_dir: Path, tmp_path: Path) -> None:
    run = run_script(MNIST, [*MNIST_ARGS, "--data-dir", str(mnist_dir)], tmp_path, nproc=2).check()
    losses = train_losses(run)
    assert losses[-1] < losses[0], losses
    final = run.final()
    assert final["strategy"] == "fsdp1_full_shard"
    assert final["accuracy"] >= 0.90, run.describe()

    model = load_plain(MnistNet(), tmp_path / "model.pt")
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])
    test_set = datasets.MNIST(str(mnist_dir), train=False, download=False, transform=transform)
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for images, labels in DataLoader(test_set, batch_size=500):
            logits = model(images)
            loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
            correct += (logits.argmax(dim=1) == labels).sum().item()
    assert loss_sum / len(test_set) == pytest.approx(final["eval_loss"], rel=1e-4)
    assert correct / len(test_set) == final["accuracy"]


# --- options that run on a CPU --------------------------------------------------------------------

OPTIONS = [
    pytest.param(FSDP1, ["--mixed-precision", "bf16", "--activation-checkpointing"], id="fsdp1-bf16-checkpointing"),
    # fp16 with ShardedGradScaler runs on CPU too (torch 2.14); accumulation exercises no_sync.
    pytest.param(
        FSDP1,
        ["--mixed-precision", "fp16", "--grad-accum-steps", "2", "--backward-prefetch", "none"],
        id="fsdp1-fp16-accumulation",
    ),
    pytest.param(
        FSDP2,
        [
            "--no-reshard-after-forward",
            "--mixed-precision",
            "bf16",
            "--activation-checkpointing",
            "--grad-accum-steps",
            "2",
        ],
        id="fsdp2-no_reshard-bf16-checkpointing-accumulation",
        marks=NEEDS_FSDP2_ON_CPU,
    ),
]


@pytest.mark.parametrize(("script", "args"), OPTIONS)
def test_option_trains(script: str, args: list[str], tmp_path: Path) -> None:
    run = run_script(script, [*SHORT_ARGS, *args], tmp_path, nproc=2).check()
    losses = train_losses(run)
    assert all(math.isfinite(loss) and loss < 3.5 for loss in losses), losses  # a uniform guess costs 2.77
    final = run.final()
    assert math.isfinite(final["eval_loss"]), run.describe()
    assert final["mixed_precision"] == args[args.index("--mixed-precision") + 1]
    # Low-precision compute leaves the fp32 shards as they were: half of 4 bytes per parameter, plus padding.
    parameters = sum(p.numel() for p in GPT(GPT_CONFIG).parameters())
    assert final["local_state_bytes"]["params"] <= 0.55 * 4 * parameters, final


# --- GPU-only options: one CUDA process with NCCL -------------------------------------------------

FASTEST = ["--compile", "--fused-adamw", "--sdpa-backend", "flash"]
CUDA_CASES = [
    pytest.param(MNIST, ["--synthetic", "--epochs", "1"], id="fsdp1-mnist"),
    pytest.param("ddp/train_mnist.py", ["--synthetic", "--epochs", "1"], id="ddp-mnist"),
    pytest.param(DDP, [*SHORT_ARGS, "--mixed-precision", "bf16", "--activation-checkpointing"], id="ddp-bf16-ac"),
    pytest.param(DDP, [*SHORT_ARGS, "--compile", "--mixed-precision", "bf16"], id="ddp-compile-bf16"),
    pytest.param(FSDP1, [*SHORT_ARGS, "--mixed-precision", "bf16"], id="fsdp1-bf16"),
    pytest.param(FSDP1, [*SHORT_ARGS, "--mixed-precision", "fp16"], id="fsdp1-fp16-sharded_grad_scaler"),
    pytest.param(FSDP1, [*SHORT_ARGS, "--cpu-offload"], id="fsdp1-cpu_offload"),
    pytest.param(FSDP1, [*SHORT_ARGS, "--activation-checkpointing", "--mixed-precision", "bf16"], id="fsdp1-ac-bf16"),
    pytest.param(FSDP2, [*SHORT_ARGS, "--mixed-precision", "bf16"], id="fsdp2-bf16"),
    pytest.param(FSDP2, [*SHORT_ARGS, "--cpu-offload"], id="fsdp2-cpu_offload", marks=NEEDS_FSDP2_CPU_OFFLOAD),
    pytest.param(FSDP2, [*SHORT_ARGS, "--compile"], id="fsdp2-compile"),
    pytest.param(
        FSDP2, [*SHORT_ARGS, "--compile", "--mixed-precision", "bf16", "--activation-checkpointing"], id="fsdp2-all"
    ),
    # The speed-ups table's last row (tools/benchmarks/speedups.py): flash attention needs bf16 on a GPU.
    pytest.param(DDP, [*SHORT_ARGS, *FASTEST, "--mixed-precision", "bf16"], id="ddp-compile-fused-flash-bf16"),
    pytest.param(FSDP2, [*SHORT_ARGS, *FASTEST, "--mixed-precision", "bf16"], id="fsdp2-compile-fused-flash-bf16"),
]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("script", "args"), CUDA_CASES)
def test_cuda_option_trains(script: str, args: list[str], tmp_path: Path) -> None:
    # run_script passes --device cpu first; the later --device cuda wins.
    run = run_script(script, [*args, "--device", "cuda"], tmp_path, nproc=1).check()
    assert "(nccl)" in run.output
    assert all(math.isfinite(loss) for loss in train_losses(run))
    assert math.isfinite(run.final()["eval_loss"])


# --- a model larger than one device: each rank builds only its share -----------------------------

# 25.2M parameters, 96 MiB in fp32: large enough to see in a process's memory.
BIG_MODEL = ["--n-layer", "8", "--d-model", "512", "--n-head", "8", "--block-size", "16"]
BIG_MODEL_BYTES = 4 * 25_232_384
ONE_STEP = ["--batch-size", "1", "--train-sequences", "64", "--heldout-sequences", "8", "--max-steps", "1"]


@pytest.mark.parametrize("script", [FSDP1, pytest.param(FSDP2, marks=NEEDS_FSDP2_ON_CPU)])
def test_building_the_model_takes_each_rank_about_its_share(script: str, tmp_path: Path) -> None:
    """Built on the meta device and initialised shard by shard, a model must never be whole on a rank:
    each rank's memory grows by about a quarter of the model at 4 ranks (FSDP1 also holds one unit
    whole, and its flattened copy, while it shards it), not by the whole of it."""
    run = run_script(
        script,
        [*BIG_MODEL, *ONE_STEP],
        tmp_path,
        nproc=4,
        wrapper=[OBSERVE, "build-memory"],
        timeout=300,
    ).check()
    for rank in range(4):
        record = json.loads((tmp_path / f"observed-build-memory-rank{rank}.json").read_text())
        share = record["peak_growth_bytes"] / BIG_MODEL_BYTES
        assert 0.25 <= share <= 0.6, f"rank {rank} grew by {share:.2f} of the model\n{run.describe()}"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("script", [DDP, FSDP2])
def test_cuda_resume_restores_the_dropout_stream(script: str, tmp_path: Path) -> None:
    """Stopped and resumed on a GPU, with dropout on: the CUDA random state must come back with the
    checkpoint, or the resumed steps draw other masks. GPU kernels are not bit-reproducible here
    (no --deterministic, which turns dropout off), so the losses must agree to rounding, which other
    masks would exceed by far."""
    args = [*SHORT_ARGS, "--max-steps", "12", "--log-interval", "1", "--dropout", "0.1", "--device", "cuda"]
    reference = run_script(script, args, tmp_path / "reference", nproc=1).check()
    stopped_dir = tmp_path / "stopped"
    run_until_stopped(script, args, stopped_dir, nproc=1, stop_after=4).check()
    resumed = run_script(script, [*args, "--resume"], stopped_dir, nproc=1).check()
    expected = {r["step"]: r["loss"] for r in reference.events("train")}
    for record in resumed.events("train"):
        assert record["loss"] == pytest.approx(expected[record["step"]], rel=1e-4), record
