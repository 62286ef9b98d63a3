"""--init-from: a new run that starts from weights the user has, in every script.

The weights come from one strategy and world size (DDP, one process) and go into another (each
script at 2 processes): with --max-steps 0 the run only loads and evaluates, so its model.pt is
the weights it loaded and its evaluation scores them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness.cases import FSDP2_SCRIPT, NEEDS_FSDP2_ON_CPU
from tests.harness.runs import Run, run_script

SMALL = ["--block-size", "32", "--train-sequences", "320", "--heldout-sequences", "40"]
MNIST = ["--batch-size", "16", "--test-batch-size", "100"]
# Held-out losses of the same weights at 1 and at 2 processes, which sum their parts in another order:
# measured 3.7e-8 (transformer) and 6.7e-8 (MNIST) relative, one float32 rounding step, on the AVX-512
# and the AVX2 kernel alike. Accuracy, a count, is equal.
SAME_LOSS = 1e-6


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_mnist_dir: Path) -> dict[str, Run]:
    """A few steps of each model by DDP in one process: the weights a user starts from."""
    root = tmp_path_factory.mktemp("init_from")
    data = {"transformer": SMALL, "mnist": [*MNIST, "--data-dir", str(tiny_mnist_dir)]}
    return {
        model: run_script(f"ddp/train_{model}.py", [*data[model], "--max-steps", "6"], root / model).check()
        for model in ("transformer", "mnist")
    }


def same_tensors(path_a: Path, path_b: Path) -> bool:
    state_a, state_b = torch.load(path_a, weights_only=True), torch.load(path_b, weights_only=True)
    return state_a.keys() == state_b.keys() and all(torch.equal(state_a[name], state_b[name]) for name in state_a)


@pytest.mark.parametrize(
    "script",
    [
        "ddp/train_mnist.py",
        "fsdp/train_mnist.py",
        "ddp/train_transformer.py",
        pytest.param("fsdp/train_transformer.py", marks=pytest.mark.floor),  # FSDP1's loading differs by release
        pytest.param(FSDP2_SCRIPT, marks=NEEDS_FSDP2_ON_CPU),
    ],
)
def test_weights_from_one_process_of_ddp_evaluate_the_same_in_each_script_at_2(
    script: str, trained: dict[str, Run], tiny_mnist_dir: Path, tmp_path: Path
) -> None:
    source = trained["mnist" if "mnist" in script else "transformer"]
    data = [*MNIST, "--data-dir", str(tiny_mnist_dir)] if "mnist" in script else SMALL
    weights = source.run_dir / "model.pt"
    run = run_script(script, [*data, "--init-from", str(weights), "--max-steps", "0"], tmp_path, nproc=2).check()
    assert run.output.count(f"weights from {weights}") == 1, run.describe()
    assert "Warning" not in run.output, run.describe()  # torch's notes on its own internals stay quiet
    assert same_tensors(weights, tmp_path / "model.pt"), "model.pt is not the weights it started from"
    final, before = run.final(), source.final()
    assert final["steps"] == 0 and final["world_size"] == 2
    assert final["eval_loss"] == pytest.approx(before["eval_loss"], rel=SAME_LOSS), run.describe()
    if "mnist" in script:
        assert final["accuracy"] == before["accuracy"], run.describe()


def test_a_checkpoint_of_the_run_comes_before_the_weights(trained: dict[str, Run], tmp_path: Path) -> None:
    """What a requeued job does: SLURM passes --resume every time, and the user's --init-from stays."""
    weights = trained["transformer"].run_dir / "model.pt"
    flags = [*SMALL, "--init-from", str(weights), "--resume", "--checkpoint-interval", "2"]
    first = run_script("ddp/train_transformer.py", [*flags, "--max-steps", "2"], tmp_path).check()
    assert "weights from" in first.output, first.describe()
    second = run_script("ddp/train_transformer.py", [*flags, "--max-steps", "4"], tmp_path).check()
    assert "weights from" not in second.output, second.describe()
    assert [record["step"] for record in second.events("resume")] == [2], second.describe()


@pytest.mark.parametrize(
    ("model", "flags", "reason"),
    [
        ("transformer", ["--d-model", "32"], "other shapes: tok_emb.weight is [16, 64] there, [16, 32] here"),
        ("mnist", [], "missing: "),
    ],
    ids=["narrower", "another-model"],
)
def test_weights_of_another_model_are_refused_with_one_message(
    model: str, flags: list[str], reason: str, trained: dict[str, Run], tmp_path: Path
) -> None:
    weights = trained[model].run_dir / "model.pt"
    script = "fsdp/train_transformer.py" if model == "transformer" else "ddp/train_transformer.py"
    run = run_script(script, [*SMALL, *flags, "--init-from", str(weights)], tmp_path, nproc=2)
    assert run.returncode == 2, run.describe()
    message = f"error: --init-from {weights} does not fit this model ("
    assert run.output.count(message) == 1 and reason in run.output, run.describe()
    assert "Traceback" not in run.output, run.describe()
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "model.pt").exists()


@NEEDS_FSDP2_ON_CPU
def test_a_safetensors_file_of_this_model_starts_a_run_whatever_lies_beside_it(tmp_path: Path) -> None:
    """The repository's own GPT from one .safetensors file, at 2 processes of FSDP2, each reading its half; a
    broken .safetensors in the same folder (another download cut short) is not read: it was named by no one."""
    from safetensors.torch import save_file

    from common.models import GPT, GPTConfig

    folder = tmp_path / "downloads"
    folder.mkdir()
    state = GPT(GPTConfig(vocab_size=16, block_size=32, n_layer=2, n_head=4, d_model=64), seed=7).state_dict()
    save_file(state, folder / "gpt.safetensors")
    (folder / "cut-short.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    weights = folder / "gpt.safetensors"
    run = run_script(FSDP2_SCRIPT, [*SMALL, "--init-from", str(weights), "--max-steps", "0"], tmp_path / "run", nproc=2)
    assert run.check().output.count(f"weights from {weights} (27 tensors, 0.4 MiB; each rank read at most 5") == 1
    saved = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert saved.keys() == state.keys() and all(torch.equal(saved[name], state[name]) for name in state)
