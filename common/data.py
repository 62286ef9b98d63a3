"""Data for the MNIST scripts: torchvision's MNIST, or generated images for smoke tests.

Training batches come from a DistributedSampler, so each rank sees its own
slice of every epoch. Evaluation shards are built without padding (see
``eval_shard``), so distributed accuracy equals single-process accuracy.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset

from common.distributed import DistContext, FatalError, all_ranks_agree

# Mean and standard deviation of MNIST's training pixels, as everyone normalises them.
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
SYNTHETIC_TRAIN_SIZE, SYNTHETIC_TEST_SIZE = 10_000, 2_000


def _open_mnist(data_dir: Path, download: bool) -> tuple[Dataset, Dataset]:
    # Imported here: torchvision takes seconds to import, and the transformer
    # scripts, which share this module's loaders, never need it.
    from torchvision import datasets, transforms

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])
    train = datasets.MNIST(str(data_dir), train=True, download=download, transform=transform)
    test = datasets.MNIST(str(data_dir), train=False, download=download, transform=transform)
    return train, test


def load_mnist(data_dir: Path, ctx: DistContext) -> tuple[Dataset, Dataset]:
    """Open MNIST under ``data_dir``, downloading it once per node if it is missing.

    Only local rank 0 downloads; the others wait at the barrier and then read
    the files it wrote. A failure anywhere stops every rank with one message.
    """
    ok = True
    if ctx.local_rank == 0:
        try:
            _open_mnist(data_dir, download=True)
        except (RuntimeError, OSError):
            ok = False
    if not all_ranks_agree(ok, ctx.device):
        raise FatalError(
            f"MNIST is not in --data-dir {data_dir} and could not be downloaded. "
            "Put the four MNIST files in DATA_DIR/MNIST/raw/, or pass --synthetic to train on generated images."
        )
    return _open_mnist(data_dir, download=False)


def synthetic_mnist(seed: int = 0) -> tuple[Dataset, Dataset]:
    """Generated 28x28 images in 10 classes, learnable but not MNIST.

    Each class is a fixed random pattern and each image adds noise to its
    class's pattern, so a smoke test can see the loss fall. Every rank builds
    the same tensors from the same seed, so nothing needs to be shared.
    """
    generator = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 1, 28, 28, generator=generator)

    def make(count: int) -> TensorDataset:
        labels = torch.randint(0, 10, (count,), generator=generator)
        images = patterns[labels] + 1.5 * torch.randn(count, 1, 28, 28, generator=generator)
        return TensorDataset(images, labels)

    return make(SYNTHETIC_TRAIN_SIZE), make(SYNTHETIC_TEST_SIZE)


def train_loader(dataset: Dataset, batch_size: int, ctx: DistContext, seed: int) -> DataLoader:
    """Shuffled batches for this rank; call ``loader.sampler.set_epoch(e)`` every epoch."""
    # drop_last keeps every rank at the same number of steps, so no rank
    # waits forever in a gradient all-reduce that the others never join.
    sampler = DistributedSampler(
        dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=seed, drop_last=True
    )
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, generator=own_generator(seed))


def eval_shard(dataset: Dataset, ctx: DistContext) -> Subset:
    """Every world_size-th example, starting at this rank: each example counted exactly once.

    DistributedSampler pads the last round with repeated examples so every rank
    gets the same count; that is right for training and wrong for a score.
    """
    return Subset(dataset, range(ctx.rank, len(dataset), ctx.world_size))


def eval_loader(dataset: Dataset, batch_size: int, ctx: DistContext) -> DataLoader:
    return DataLoader(eval_shard(dataset, ctx), batch_size=batch_size, shuffle=False, generator=own_generator(0))


def own_generator(seed: int) -> torch.Generator:
    """A generator for a DataLoader's own draws, so iterating it leaves torch's global RNG alone.

    Without one, every ``iter(loader)`` takes a number from the global RNG, so a
    run resumed mid-epoch (one ``iter`` fewer) would draw different dropout masks.
    """
    return torch.Generator().manual_seed(seed)
