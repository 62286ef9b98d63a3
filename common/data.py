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

import numpy as np
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


# Rounds of the shuffle's Feistel network: TensorFlow's random_index_shuffle uses 4; two more cost little.
SHUFFLE_ROUNDS = 6
# splitmix64's multipliers: odd, so each multiplication is a bijection of 64-bit words.
MIX_1, MIX_2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
SHUFFLE_CHUNK = 1 << 14  # positions computed at a time: a few hundred KiB, whatever the epoch's size


class IndexShuffle:
    """A random order of range(size), computed position by position: no table of ``size`` entries.

    A Feistel network (SHUFFLE_ROUNDS rounds of a hash keyed from ``seed``) is a bijection of the
    numbers of 2 x half_bits bits; a number it sends past ``size`` goes through again until it lands
    inside ("cycle walking"), which keeps it a bijection of range(size). torch.randperm would hold 8
    bytes an example: 134 MB a rank for the 16.8 million windows of a 2 GB token file.
    """

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.half_bits = (max(1, (size - 1).bit_length()) + 1) // 2
        self.mask = np.uint64((1 << self.half_bits) - 1)
        # numpy's PCG64 from the seed: the same keys on every rank and machine, and no torch tensor read back.
        self.keys = list(np.random.default_rng(seed % (1 << 64)).integers(0, 1 << 32, SHUFFLE_ROUNDS, dtype=np.uint64))

    def _mix(self, half: np.ndarray, key: np.uint64) -> np.ndarray:
        # uint64 arithmetic wraps by definition, on every CPU, so every rank computes the same order.
        mixed = (half + key) * MIX_1
        mixed ^= mixed >> np.uint64(31)
        mixed *= MIX_2
        mixed ^= mixed >> np.uint64(29)
        return mixed & self.mask

    def _permute_bits(self, numbers: np.ndarray) -> np.ndarray:
        left, right = numbers >> np.uint64(self.half_bits), numbers & self.mask
        for key in self.keys:
            left, right = right, left ^ self._mix(right, key)
        return (left << np.uint64(self.half_bits)) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The examples at ``positions`` (each below ``size``) of the order."""
        if positions.size and not 0 <= positions.min() <= positions.max() < self.size:
            # Cycle walking from outside range(size) need never come back into it: it would loop forever.
            raise IndexError(f"positions {positions.min()} to {positions.max()} of an order of {self.size}")
        examples = self._permute_bits(positions.astype(np.uint64))
        outside = examples >= self.size
        while outside.any():
            examples[outside] = self._permute_bits(examples[outside])
            outside = examples >= self.size
        return examples.astype(np.int64)


class CompactDistributedSampler(DistributedSampler):
    """torch's DistributedSampler, shuffled and with drop_last (every rank the same number of examples),
    whose order costs no memory and can start anywhere in an epoch.

    Each epoch's order is an IndexShuffle keyed by seed + epoch, as DistributedSampler seeds its
    randperm, and rank r takes the positions r, r + world_size, ... of it. So every global batch is
    a run of consecutive positions, whatever the world size, and ``set_epoch(epoch, start)`` puts a
    resumed run at the position after the last example it trained, at any world size, without
    reading the examples before it.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """``start``: the examples of this epoch, all ranks' together, that the run trained before it was
        resumed; a multiple of the global batch, so a multiple of the world size."""
        super().set_epoch(epoch)
        self.start = start

    def _positions(self) -> range:
        return range(self.start + self.rank, self.total_size, self.num_replicas)

    def __len__(self) -> int:
        return len(self._positions())

    def __iter__(self) -> Iterator[int]:
        shuffle = IndexShuffle(len(self.dataset), self.seed + self.epoch)  # type: ignore[arg-type]
        positions = self._positions()
        for first in range(0, len(positions), SHUFFLE_CHUNK):
            chunk = positions[first : first + SHUFFLE_CHUNK]
            yield from shuffle(np.arange(chunk.start, chunk.stop, chunk.step)).tolist()


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


# A target that counts for nothing (padding): F.cross_entropy's default ignore_index.
IGNORE_INDEX = -100
