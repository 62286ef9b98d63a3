"""How the ranks share their data (the sampler and loaders; evaluation shards without padding, so a distributed
score equals one process's), and the transformer's synthetic tokens: a fixed random Markov source, whose known
transition probabilities give the lowest loss any model can reach on it. Real text is common.tokens'."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset

from common.distributed import DistContext

# Rounds of the shuffle's Feistel network: TensorFlow's random_index_shuffle uses 4; two more cost little.
SHUFFLE_ROUNDS = 6
# splitmix64's multipliers: odd, so each multiplication is a bijection of 64-bit words.
MIX_1, MIX_2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
SHUFFLE_CHUNK = 1 << 14  # positions computed at a time: a few hundred KiB, whatever the epoch's size


class IndexShuffle:
    """A random order of range(size), computed position by position: no table of ``size`` entries.
    A Feistel network (SHUFFLE_ROUNDS rounds of a hash keyed from ``seed``) is a bijection of 2 x half_bits
    bits; a number sent past ``size`` goes through again until it lands inside ("cycle walking"). torch.randperm
    would hold 8 bytes an example: 134 MB a rank for the 16.8 million windows of a 2 GB token file."""

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.half_bits = (max(1, (size - 1).bit_length()) + 1) // 2
        self.mask = np.uint64((1 << self.half_bits) - 1)
        # numpy's PCG64 from the seed: the same keys on every rank and machine, and no torch tensor read back.
        self.keys = list(np.random.default_rng(seed % (1 << 64)).integers(0, 1 << 32, SHUFFLE_ROUNDS, dtype=np.uint64))

    def _permute_bits(self, numbers: np.ndarray) -> np.ndarray:
        left, right = numbers >> np.uint64(self.half_bits), numbers & self.mask
        for key in self.keys:
            # A hash of right and the key; uint64 arithmetic wraps by definition, so every rank computes the same order.
            mixed = (right + key) * MIX_1
            mixed ^= mixed >> np.uint64(31)
            mixed *= MIX_2
            mixed ^= mixed >> np.uint64(29)
            left, right = right, left ^ (mixed & self.mask)
        return (left << np.uint64(self.half_bits)) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The examples at ``positions`` (each below ``size``) of the order."""
        if positions.size and not 0 <= positions.min() <= positions.max() < self.size:
            # Cycle walking from outside range(size) need never come back into it: it would loop forever.
            raise IndexError(f"positions {positions.min()} to {positions.max()} of an order of {self.size}")
        examples = self._permute_bits(positions.astype(np.uint64))
        while (outside := examples >= self.size).any():
            examples[outside] = self._permute_bits(examples[outside])
        return examples.astype(np.int64)


class CompactDistributedSampler(DistributedSampler):
    """torch's DistributedSampler, shuffled and with drop_last, whose order costs no memory and can start anywhere.
    Each epoch's order is an IndexShuffle keyed by seed + epoch (as DistributedSampler seeds its randperm), and rank
    r takes its positions r, r + world_size, ... So at any world size every global batch is a run of consecutive
    positions, and ``set_epoch(epoch, start)`` resumes after the epoch's first ``start`` examples (all ranks'; a
    multiple of the global batch)."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
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
    # drop_last: every rank runs the same number of steps, so none waits forever in an all-reduce the others never
    # join. The loader's own generator: else every iter(loader) draws from torch's global RNG, and a run resumed
    # mid-epoch (one iter fewer) would draw other dropout masks. Pinned memory on GPUs: only from there is
    # .to(device, non_blocking=True) a copy the GPU does while the host goes on.
    generator = torch.Generator().manual_seed(sampler.seed)
    pin = ctx.device.type == "cuda"
    return DataLoader(dataset, batch_size, sampler=sampler, drop_last=True, generator=generator, pin_memory=pin)


def eval_shard(dataset: Dataset, ctx: DistContext) -> Subset:
    """Every world_size-th example from this rank's: each counted once, where DistributedSampler would pad the
    last round with repeats (right for training, wrong for a score)."""
    return Subset(dataset, range(ctx.rank, len(dataset), ctx.world_size))


def eval_loader(dataset: Dataset, batch_size: int, ctx: DistContext) -> DataLoader:
    generator = torch.Generator().manual_seed(0)  # as train_loader's, for the same reasons
    shard = eval_shard(dataset, ctx)
    return DataLoader(shard, batch_size, shuffle=False, generator=generator, pin_memory=ctx.device.type == "cuda")


IGNORE_INDEX = -100  # a target that counts for nothing (padding): F.cross_entropy's default ignore_index
MARKOV_SEED = 1234  # the source is the task's, not the run's: the same whatever --seed, so runs are comparable


@dataclass
class TokenData:
    train: Dataset  # (input, target) pairs of shape (block_size,)
    heldout: Dataset
    vocab_size: int
    entropy_floor: float | None  # nats per token; None for real text
    description: str
    # How tools.runs.sample turns ids back into text: {"characters": "..."} or {"tokenizer": "bytes"}; {} for ids only.
    decoding: dict[str, Any] = field(default_factory=dict)
    # Whether a target can be IGNORE_INDEX. Only data that never pads lets a step know its token count in
    # advance (common.training.TokenCount); yours is counted, step by step, unless you say otherwise.
    padded: bool = True


def _entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy in nats along the last dimension, treating 0 log 0 as 0."""
    return -(probs * probs.clamp_min(1e-300).log()).sum(-1)


class MarkovSource:
    """Tokens that each depend on the ``order`` tokens before (a state, in base ``vocab_size``), drawn from a softmax
    of random logits per state: a larger ``logit_scale`` makes it more peaked, predictable but not trivially so."""

    def __init__(self, vocab_size: int = 16, order: int = 2, logit_scale: float = 3.0) -> None:
        generator = torch.Generator().manual_seed(MARKOV_SEED)
        self.vocab_size, self.order = vocab_size, order
        self.num_states = vocab_size**order
        logits = logit_scale * torch.randn(self.num_states, vocab_size, dtype=torch.float64, generator=generator)
        self.transition = logits.softmax(-1)
        # pi = pi T for the chain on states, solved exactly: (T^t - I) pi = 0, one equation swapped for sum(pi) = 1.
        states = torch.arange(self.num_states).repeat_interleave(self.vocab_size)
        tokens = torch.arange(self.vocab_size).repeat(self.num_states)
        chain = torch.zeros(self.num_states, self.num_states, dtype=torch.float64)
        chain.index_put_((states, self._next_state(states, tokens)), self.transition.flatten(), accumulate=True)
        system = chain.T - torch.eye(self.num_states, dtype=torch.float64)
        system[-1] = 1.0
        rhs = torch.zeros(self.num_states, dtype=torch.float64)
        rhs[-1] = 1.0
        self.stationary = torch.linalg.solve(system, rhs)

    def _next_state(self, state: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        return (state % (self.num_states // self.vocab_size)) * self.vocab_size + token

    def entropy_rate(self) -> float:
        """Nats per token of an ideal predictor that sees the full ``order`` tokens of context."""
        return float((self.stationary * _entropy(self.transition)).sum())

    def loss_floor(self, block_size: int) -> float:
        """Lowest mean loss over the ``block_size`` targets of a fresh sequence, whose first targets have less than
        ``order`` tokens of context: by the chain rule, H(first block_size + 1 tokens) - H(first token)."""
        first_tokens = self.stationary.view(self.vocab_size, -1).sum(-1)
        whole_sequence = float(_entropy(self.stationary)) + (block_size + 1 - self.order) * self.entropy_rate()
        return (whole_sequence - float(_entropy(first_tokens))) / block_size

    def sample(self, num_sequences: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """Independent sequences, each started from the stationary distribution."""
        state = torch.multinomial(self.stationary, num_sequences, replacement=True, generator=generator)
        tokens = torch.empty(num_sequences, length, dtype=torch.long)
        for position in range(self.order):  # the first `order` tokens are the digits of the starting state
            tokens[:, position] = (state // self.vocab_size ** (self.order - 1 - position)) % self.vocab_size
        cumulative = self.transition.cumsum(-1)
        for position in range(self.order, length):
            uniform = torch.rand(num_sequences, 1, dtype=torch.float64, generator=generator)
            token = torch.searchsorted(cumulative[state], uniform).squeeze(1).clamp_max(self.vocab_size - 1)
            tokens[:, position] = token
            state = self._next_state(state, token)
        return tokens


def _pairs(sequences: torch.Tensor, lengths: torch.Tensor | None = None) -> TensorDataset:
    """Next-token pairs (the target is the input shifted by one). With ``lengths``, sequence i keeps lengths[i]
    targets; the rest are padding: IGNORE_INDEX targets, and 0 inputs that only padded positions' predictions read."""
    inputs, targets = sequences[:, :-1].clone(), sequences[:, 1:].clone()
    if lengths is not None:
        padding = torch.arange(targets.shape[1]) >= lengths[:, None]
        inputs[padding], targets[padding] = 0, IGNORE_INDEX
    return TensorDataset(inputs, targets)


def markov_data(
    block_size: int, train_sequences: int, heldout_sequences: int, variable_length: bool = False
) -> TokenData:
    """``variable_length``: each sequence cut to 1 to block_size tokens, drawn from the data's seed, and padded."""
    source = MarkovSource()
    generator = torch.Generator().manual_seed(MARKOV_SEED + 1)
    count = train_sequences + heldout_sequences
    sequences = source.sample(count, block_size + 1, generator)
    train_lengths = heldout_lengths = None
    if not variable_length:
        floor = source.loss_floor(block_size)
        shape = f"loss floor {floor:.4f} at block size {block_size}"
    else:
        lengths = torch.randint(1, block_size + 1, (count,), generator=generator)
        train_lengths, heldout_lengths = lengths.split([train_sequences, heldout_sequences])
        # The held-out loss is a mean over tokens: each sequence's floor weighs by its length.
        heldout = heldout_lengths.tolist()
        floor = sum(length * source.loss_floor(length) for length in heldout) / sum(heldout)
        shape = f"lengths 1 to {block_size} (padded), held-out loss floor {floor:.4f}"
    description = (
        f"synthetic Markov tokens: vocab {source.vocab_size}, order {source.order}, {train_sequences} train / "
        f"{heldout_sequences} held-out sequences; entropy rate {source.entropy_rate():.4f} nats/token, {shape}"
    )
    train = _pairs(sequences[:train_sequences], train_lengths)
    heldout_pairs = _pairs(sequences[train_sequences:], heldout_lengths)
    return TokenData(train, heldout_pairs, source.vocab_size, floor, description, padded=variable_length)
