"""Data for the MNIST scripts: torchvision's MNIST, or generated images for smoke tests.

Training batches come from a DistributedSampler, so each rank sees its own
slice of every epoch. Evaluation shards are built without padding (see
``eval_shard``), so distributed accuracy equals single-process accuracy.

The images stay as the uint8 tensors torchvision reads from the files (all of
MNIST is 47 MB that way), and a whole batch is normalised on the device
(``normalize_images``). The usual per-image PIL transform would cost more than a
GPU's whole training step; this gives the same numbers, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset

from common.distributed import DistContext, FatalError, all_ranks_agree

# Mean and standard deviation of MNIST's training pixels, as everyone normalises them.
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
SYNTHETIC_TRAIN_SIZE, SYNTHETIC_TEST_SIZE = 10_000, 2_000


# What torchvision's MNIST reads from DATA_DIR/MNIST/raw/ (unpacked).
MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def _open_mnist(data_dir: Path, download: bool) -> tuple[TensorDataset, TensorDataset]:
    # Imported here: torchvision takes seconds to import, and the transformer
    # scripts, which share this module's loaders, never need it.
    from torchvision import datasets

    def images_and_labels(train: bool) -> TensorDataset:
        mnist = datasets.MNIST(str(data_dir), train=train, download=download)
        # .data: (N, 28, 28) uint8, as in the files; a channel dimension for the CNN, no copy.
        return TensorDataset(mnist.data.unsqueeze(1), mnist.targets)

    return images_and_labels(train=True), images_and_labels(train=False)


def normalize_images(images: torch.Tensor) -> torch.Tensor:
    """uint8 pixels (a batch, on any device) to the CNN's input: what ToTensor and Normalize do per image,
    with the same float32 operations, so the same bits. (torchvision's normalize checks its std on the
    device, which on a GPU makes the host wait for every batch.)"""
    return images.float().div(255).sub(MNIST_MEAN).div(MNIST_STD)


def load_mnist(data_dir: Path, ctx: DistContext) -> tuple[TensorDataset, TensorDataset]:
    """Open MNIST under ``data_dir``, downloading it once per node if it is missing.

    Only local rank 0 downloads; the others wait at the barrier and then read
    the files it wrote. A failure anywhere stops every rank with one message.
    """
    ok, failure = True, ""
    raw = data_dir / "MNIST" / "raw"
    if ctx.local_rank == 0:
        created = [folder for folder in (data_dir, data_dir / "MNIST", raw) if not folder.exists()]
        try:
            _open_mnist(data_dir, download=True)
        # torchvision checks a file's header with assert, and its size when it reads the data.
        except (RuntimeError, OSError, AssertionError, ValueError) as err:
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
    """Generated 28x28 uint8 images in 10 classes, learnable but not MNIST.

    Each class is a fixed random pattern and each image adds noise to its
    class's pattern, so a smoke test can see the loss fall. Every rank builds
    the same tensors from the same seed, so nothing needs to be shared.
    """
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 1, 28, 28, generator=generator)

    def make(count: int) -> TensorDataset:
        labels = torch.randint(0, 10, (count,), generator=generator)
        noisy = patterns[labels] + 1.5 * torch.randn(count, 1, 28, 28, generator=generator)
        # Pixels like MNIST's: 0..255, so both kinds of data go through normalize_images.
        images = (noisy * 40 + 128).clamp(0, 255).to(torch.uint8)
        return TensorDataset(images, labels)

    return make(SYNTHETIC_TRAIN_SIZE), make(SYNTHETIC_TEST_SIZE)


class CompactDistributedSampler(DistributedSampler):
    """torch's DistributedSampler, shuffled and with drop_last (every rank the same number of examples), in
    the same order, holding each epoch's order as one tensor (8 bytes an example) instead of a Python list
    (about 45 bytes an example, and copied twice): a corpus of millions of windows costs a rank megabytes,
    not hundreds of them."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)  # as DistributedSampler seeds each epoch
        order = torch.randperm(len(self.dataset), generator=generator)  # type: ignore[arg-type]
        mine = order[self.rank : self.total_size : self.num_replicas]
        for chunk in mine.split(4096):
            yield from chunk.tolist()


def train_loader(dataset: Dataset, batch_size: int, sampler: DistributedSampler, ctx: DistContext) -> DataLoader:
    """Batches of ``sampler``'s examples for this rank; call ``loader.sampler.set_epoch(e)`` every epoch."""
    # drop_last keeps every rank at the same number of steps, so no rank
    # waits forever in a gradient all-reduce that the others never join.
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=True,
        generator=own_generator(sampler.seed),
        pin_memory=pinned(ctx),
    )


def pinned(ctx: DistContext) -> bool:
    """Batches in page-locked memory on GPU runs: only from there is ``.to(device, non_blocking=True)``
    a copy the GPU does while the host goes on; from ordinary memory it waits for the copy."""
    return ctx.device.type == "cuda"


def eval_shard(dataset: Dataset, ctx: DistContext) -> Subset:
    """Every world_size-th example, starting at this rank: each example counted exactly once.

    DistributedSampler pads the last round with repeated examples so every rank
    gets the same count; that is right for training and wrong for a score.
    """
    return Subset(dataset, range(ctx.rank, len(dataset), ctx.world_size))


def eval_loader(dataset: Dataset, batch_size: int, ctx: DistContext) -> DataLoader:
    return DataLoader(
        eval_shard(dataset, ctx),
        batch_size=batch_size,
        shuffle=False,
        generator=own_generator(0),
        pin_memory=pinned(ctx),
    )


def own_generator(seed: int) -> torch.Generator:
    """A generator for a DataLoader's own draws, so iterating it leaves torch's global RNG alone.

    Without one, every ``iter(loader)`` takes a number from the global RNG, so a
    run resumed mid-epoch (one ``iter`` fewer) would draw different dropout masks.
    """
    return torch.Generator().manual_seed(seed)
