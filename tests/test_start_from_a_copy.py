"""Start your own project from a script: the README's steps, done as a user does them, in its order.

Each test copies a script and common/ into a new folder outside the repository, puts a model
that is not this repository's at the places the script marks (YOUR MODEL, YOUR LAYERS, YOUR
CHECKPOINT IDENTITY), checks with tools.checks.check_equivalence that two processes train the copy as
one does, at the copy's natural settings, and loads model.pt into the new model.

The copies run from their own folder and must stand alone: nothing of this repository may be
importable in their processes. Each copy's check runs through check_equivalence's own check, with
its ranks forked from the test launcher's warm processes, started in the copy's folder with this
repository's modules dropped (tests/harness/launcher.py): every run a new interpreter would pay seconds of
CPU to import torch (and torchvision), and a check starts six to eight of them. One more test runs
the README's command itself, with python and torchrun, at a size that costs little.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.harness.cases import NEEDS_FSDP2_ON_CPU
from tests.harness.copies import check_warm, copy_common, project_env
from tests.harness.runs import REPO, Run, run_command

# Step 2 of the README, the model in a file of its own beside the script.
RESNET = '''
import torch.nn as nn
from torchvision.models import resnet18


def digit_resnet() -> nn.Module:
    """torchvision's ResNet-18 for 1-channel 28x28 digits. GroupNorm, not BatchNorm: BatchNorm
    normalises by each rank's own slice of the batch, so N processes would not compute what one does."""
    model = resnet18(num_classes=10, norm_layer=lambda channels: nn.GroupNorm(8, channels))
    model.conv1 = nn.Conv2d(1, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model
'''

LANGUAGE_MODEL = '''
import torch
import torch.nn as nn


class Layer(nn.Module):
    """A pre-norm transformer layer on torch's own MultiheadAttention: not this repository's Block."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, bias=False, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.feed_forward = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=causal, is_causal=True, need_weights=False)[0]
        return x + self.feed_forward(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, width: int = 64, heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(block_size, width)
        self.layers = nn.ModuleList(Layer(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))
'''


def copy_project(script: str, project: Path) -> Path:
    """Step 1: common/ and the script, the script one folder below common/'s parent."""
    return Path(shutil.copy(REPO / script, copy_common(project) / "train.py"))


def put_in(train_py: Path, model_source: str, edits: dict[str, str]) -> None:
    """Step 2: the model in train/model.py, and the marked lines of train.py changed to use it."""
    (train_py.parent / "model.py").write_text(model_source)
    source = train_py.read_text()
    for marked, replacement in edits.items():
        assert source.count(marked) == 1, f"the script no longer has this marked line: {marked}"
        source = source.replace(marked, replacement)
    train_py.write_text(source)


def check_the_copy(project: Path, args: list[str]) -> Run:
    """Step 3: ``PYTHONPATH=REPO python -m tools.checks.check_equivalence --nproc 2 train/train.py FLAGS`` from
    the copy's folder: one process, its twins and two processes, each started by python or torchrun itself.
    Returns the two-process run, once the check has given its verdict (SAME or DIFFERENT)."""
    command = [
        sys.executable,
        "-m",
        "tools.checks.check_equivalence",
        "--nproc",
        "2",
        "train/train.py",
        "--device",
        "cpu",
    ]
    # As the README gives it: this repository on PYTHONPATH for its tools/; the copy's folder (the working
    # directory, first on python -m's path) for its common/, which the copy's runs import too.
    env = {**project_env(project), "PYTHONPATH": str(REPO)}
    check = run_command([*command, *args], project / "runs" / "equivalence" / "train-2" / "candidate", 600,
                        env, project)  # fmt: skip
    verdict = check.output.splitlines()[-1] if check.output else ""
    assert (check.returncode, verdict.split(":")[0]) in {(0, "SAME"), (1, "DIFFERENT")}, check.describe()
    return check


def check_the_copy_warm(project: Path, args: list[str], capsys: pytest.CaptureFixture[str]) -> Run:
    """Step 3 as ``check_the_copy``, with the runs' ranks forked from the warm launcher in the copy's folder."""
    return check_warm(project, "train/train.py", args, project / "runs" / "equivalence" / "train-2", capsys)


def load(path: Path) -> ModuleType:
    """A module of the copy, from its file: each test's copy has its own, under a name of its own."""
    spec = importlib.util.spec_from_file_location(f"copy_{path.stem}_{id(path)}", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]  # dataclasses look their module up there
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_the_fsdp1_cnn_script_trains_a_torchvision_resnet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    project = tmp_path / "project"
    train_py = copy_project("fsdp/train_mnist.py", project)
    model_line = "    model = MnistNet(dropout=not args.deterministic).to(ctx.device)  # YOUR MODEL"
    identity = '"model": "MnistNet"},  # YOUR CHECKPOINT IDENTITY'
    imports = "from common.run_dir import RunDirLock\n"
    data_line = "    train_set, test_set = synthetic_mnist() if args.synthetic else load_mnist(args.data_dir, ctx)\n"
    put_in(
        train_py,
        RESNET,
        {
            model_line: "    model = digit_resnet().to(ctx.device)  # YOUR MODEL",
            identity: '"model": "digit_resnet"},  # YOUR CHECKPOINT IDENTITY',
            imports: f"{imports}from model import digit_resnet\n",
            # Your data too: a test set of 200 images. The ResNet's evaluation of 2,000 was a third of each run, and
            # 500 cost the test 5 CPU-seconds more than 200 (40.8 against 35.6, on the AMD EPYC kind).
            data_line: f"{data_line}    test_set = torch.utils.data.Subset(test_set, range(200))\n",
        },
    )
    # lr 0.05, 12 steps: where fixed tolerances had failed. A global batch of 16 has three twins (2, 4 and 8
    # micro-steps): each run here evaluates 200 images on a ResNet-18, and 24 would take two runs more.
    flags = ["--synthetic", "--lr", "0.05", "--global-batch-size", "16", "--max-steps", "12"]
    check = check_the_copy_warm(project, flags, capsys)
    assert "12 steps compared" in check.output, check.describe()
    two = check.final()
    assert two["world_size"] == 2 and two["strategy"] == "fsdp1_full_shard"
    digit_resnet = load(train_py.parent / "model.py").digit_resnet
    digit_resnet().load_state_dict(torch.load(check.run_dir / "model.pt", weights_only=True))  # strict


def tiny_lm_copy(project: Path) -> Path:
    """The FSDP2 script with TinyLM, a transformer of torch's own layers, in place of GPT."""
    train_py = copy_project("fsdp/train_transformer_fsdp2.py", project)
    layers_line = "    layers = model.blocks  # YOUR LAYERS: the ones that repeat; each becomes one FSDP unit"
    identity = '"model": config.shape()},  # YOUR CHECKPOINT IDENTITY'
    imports = "from common.run_dir import RunDirLock\n"
    put_in(
        train_py,
        LANGUAGE_MODEL,
        {
            "model = GPT(config, seed=None)  # YOUR MODEL": "model = TinyLM(data.vocab_size, args.block_size)",
            layers_line: layers_line.replace("model.blocks", "model.layers"),
            identity: '"model": "TinyLM"},  # YOUR CHECKPOINT IDENTITY',
            imports: f"{imports}from model import TinyLM\n",
        },
    )
    return train_py


TINY_LM_DATA = ["--block-size", "32", "--train-sequences", "600", "--heldout-sequences", "61"]


@NEEDS_FSDP2_ON_CPU
def test_the_fsdp2_script_shards_a_transformer_of_other_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = tmp_path / "project"
    train_py = tiny_lm_copy(project)
    # The script's lr, 20 steps. A global batch of 20 has four twins (2, 4, 5 and 10 micro-steps), two
    # fewer than 24 would have.
    check = check_the_copy_warm(project, [*TINY_LM_DATA, "--global-batch-size", "20"], capsys)
    assert "20 steps compared" in check.output, check.describe()
    final = check.final()
    assert final["strategy"] == "fsdp2" and final["shard_group_size"] == 2
    tiny_lm = load(train_py.parent / "model.py").TinyLM(vocab_size=16, block_size=32)
    tiny_lm.load_state_dict(torch.load(check.run_dir / "model.pt", weights_only=True))  # strict


@NEEDS_FSDP2_ON_CPU
def test_the_readme_command_runs_the_copy_with_python_and_torchrun(tmp_path: Path) -> None:
    """Step 3 exactly as the README gives it, from the copy's folder: every run a new interpreter, the
    candidate's ranks started by torchrun. Only the plumbing is checked here, at a size that costs
    little (one twin, 4 steps, too few for a trustworthy band); the verdict at full size is the test above's.
    """
    project = tmp_path / "project"
    tiny_lm_copy(project)
    check = check_the_copy(project, [*TINY_LM_DATA, "--global-batch-size", "4", "--max-steps", "4"])
    assert "4 steps compared; noise floor from 1 twin run(s)" in check.output, check.describe()
    runs = project / "runs" / "equivalence" / "train-2"
    assert sorted(path.name for path in runs.iterdir() if path.is_dir()) == ["candidate", "reference", "twin-2"]
    for run in ("reference", "twin-2", "candidate"):
        final = Run(check.command, check.returncode, check.output, runs / run).final()
        assert final["world_size"] == (2 if run == "candidate" else 1), check.describe()
