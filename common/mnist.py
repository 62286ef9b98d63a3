"""MNIST's files (or generated images for smoke tests), the CNN and its evaluation. Images stay uint8 (all of MNIST is
47 MB), normalised a batch at a time on the device: a per-image PIL transform costs more than a GPU's training step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from common.distributed import DistContext, FatalError, all_ranks_agree
from common.training import lockstep_batches, sum_over_ranks

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # of MNIST's training pixels, as everyone normalises them
# What torchvision's MNIST reads from DATA_DIR/MNIST/raw/ (unpacked).
MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def _open_mnist(data_dir: Path, download: bool) -> tuple[TensorDataset, TensorDataset]:
    # Imported here: torchvision takes seconds to import, and a --synthetic run or tools.estimates never needs it.
    from torchvision import datasets

    train, test = (datasets.MNIST(str(data_dir), train=is_train, download=download) for is_train in (True, False))
    # .data: (N, 28, 28) uint8, as in the files; a channel dimension for the CNN, no copy.
    return TensorDataset(train.data.unsqueeze(1), train.targets), TensorDataset(test.data.unsqueeze(1), test.targets)


def normalize_images(images: torch.Tensor) -> torch.Tensor:
    """uint8 pixels (a batch, on any device) to the CNN's input: ToTensor and Normalize's float32 operations, so the
    same bits (torchvision's normalize checks its std on the device: on a GPU the host would wait every batch)."""
    return images.float().div(255).sub(MNIST_MEAN).div(MNIST_STD)


def load_mnist(data_dir: Path, ctx: DistContext) -> tuple[TensorDataset, TensorDataset]:
    """Open MNIST under ``data_dir``, downloaded once per node (local rank 0) if missing; a failure stops every rank."""
    ok, failure = True, ""
    raw = data_dir / "MNIST" / "raw"
    if ctx.local_rank == 0:
        created = [folder for folder in (data_dir, data_dir / "MNIST", raw) if not folder.exists()]
        try:
            _open_mnist(data_dir, download=True)
        except (RuntimeError, OSError, AssertionError, ValueError) as err:  # torchvision asserts headers, checks sizes
            ok, failure = False, str(err) or type(err).__name__
            # A failed download leaves empty folders that look like a data set; remove what it made.
            for folder in reversed(created):
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
    if not all_ranks_agree(ok, ctx):
        if all((raw / name).is_file() for name in MNIST_FILES):
            raise FatalError(
                f"MNIST is in --data-dir {data_dir}, but its files cannot be read ({failure}): damaged or cut "
                f"short? Replace the four files in {raw}, or pass --synthetic to train on generated images."
            )
        raise FatalError(
            f"MNIST is not in --data-dir {data_dir} and could not be downloaded. "
            "Put the four MNIST files in DATA_DIR/MNIST/raw/, or pass --synthetic to train on generated images."
        )
    return _open_mnist(data_dir, download=False)


def synthetic_mnist(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Generated 28x28 uint8 images in 10 classes, learnable but not MNIST: noise on each class's fixed random
    pattern, so a smoke test sees the loss fall. Every rank builds the same tensors from the same seed."""
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 1, 28, 28, generator=generator)
    splits = []
    for count in (10_000, 2_000):  # train, test
        labels = torch.randint(0, 10, (count,), generator=generator)
        noisy = patterns[labels] + 1.5 * torch.randn(count, 1, 28, 28, generator=generator)
        # Pixels like MNIST's: 0..255, so both kinds of data go through normalize_images.
        splits.append(TensorDataset((noisy * 40 + 128).clamp(0, 255).to(torch.uint8), labels))
    return splits[0], splits[1]


class MnistNet(nn.Module):
    """Two conv layers and two linear layers, the shape pytorch/examples made familiar."""

    def __init__(self, dropout: bool = True) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 32, 3, 1), nn.Conv2d(32, 64, 3, 1)
        self.dropout1, self.dropout2 = nn.Dropout(0.25 if dropout else 0.0), nn.Dropout(0.5 if dropout else 0.0)
        self.fc1, self.fc2 = nn.Linear(9216, 128), nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = F.relu(self.fc1(torch.flatten(self.dropout1(x), 1)))
        return self.fc2(self.dropout2(x))  # logits; the loss applies log-softmax itself


@torch.no_grad()
def evaluate_classifier(
    model: nn.Module, loader: DataLoader, ctx: DistContext, prepare: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, float]:
    """Mean cross-entropy and accuracy over the evaluation set; ``prepare`` makes a batch on the device the input."""
    model.eval()
    # float64: exact counts, and loss sums that lose nothing to the order in which ranks add them.
    loss_sum, correct, count = torch.zeros(3, dtype=torch.float64, device=ctx.device)
    for (images, labels), counts in lockstep_batches(loader, ctx):
        images, labels = images.to(ctx.device, non_blocking=True), labels.to(ctx.device, non_blocking=True)
        logits = model(prepare(images))
        if counts:
            loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum")
            correct += (logits.argmax(dim=1) == labels).sum()
            count += labels.numel()
    model.train()
    loss_sum, correct, count = sum_over_ranks(torch.stack([loss_sum, correct, count]))
    return {"loss": loss_sum / count, "accuracy": correct / count, "samples": int(count)}
