"""Run an MNIST script on the classic per-image pipeline, to compare it with the scripts' own.

    tests/harness/per_image_mnist.py SCRIPT [FLAGS...]

The scripts keep MNIST as uint8 tensors and normalise whole batches on the device
(common/mnist.py). This swaps in what they did before and what most examples do: torchvision's
MNIST with ToTensor and Normalize applied image by image, in the training process. Training
must give the same losses, bit for bit.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch
from torchvision import datasets, transforms

import common.mnist

PER_IMAGE = transforms.Compose(
    [transforms.ToTensor(), transforms.Normalize((common.mnist.MNIST_MEAN,), (common.mnist.MNIST_STD,))]
)


def per_image_mnist(data_dir: Path, download: bool) -> tuple[datasets.MNIST, datasets.MNIST]:
    def split(train: bool) -> datasets.MNIST:
        return datasets.MNIST(str(data_dir), train=train, download=download, transform=PER_IMAGE)

    return split(train=True), split(train=False)


def already_normalized(images: torch.Tensor) -> torch.Tensor:
    return images


def main() -> None:
    common.mnist._open_mnist = per_image_mnist  # type: ignore[assignment]
    common.mnist.normalize_images = already_normalized  # before the script imports it
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
