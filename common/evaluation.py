"""Evaluation that gives the same numbers at any world size.

Each rank scores its own unpadded shard and the ranks add up sums and counts,
never averages of averages, so 3 ranks on 1999 images report exactly what one
process reports. The sums stay on the device until the end: an evaluation reads
the GPU once, not once per batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common.distributed import DistContext, FatalError, max_over_ranks
from common.tokens import IGNORE_INDEX


def _lockstep_batches(loader: DataLoader, ctx: DistContext) -> Iterator[tuple[Any, bool]]:
    """Yield ``(batch, counts)`` for as many batches as the busiest rank has.

    Unpadded shards can differ by one example, and so by one batch. A sharded
    model gathers its parameters inside every forward, so every rank must call
    it equally often: a rank that runs out repeats its first batch and marks it
    as not counted.
    """
    local_batches = len(loader)
    (most_batches,) = max_over_ranks([float(local_batches)], ctx)
    first = None
    batches = iter(loader)
    for index in range(int(most_batches)):
        if index < local_batches:
            batch = next(batches)
            first = batch if first is None else first
            yield batch, True
        else:
            yield first, False


def _check_every_rank_has_data(loader: DataLoader, ctx: DistContext) -> None:
    if len(loader) == 0:
        # Same dataset size on every rank, so every rank raises together.
        raise FatalError(f"the evaluation set is smaller than the world size ({ctx.world_size} processes)")


def _sum_over_ranks(totals: torch.Tensor) -> list[float]:
    """Add each rank's device totals and read them: the evaluation's one read of the GPU."""
    dist.all_reduce(totals)
    return totals.tolist()


@torch.no_grad()
def evaluate_classifier(
    model: nn.Module, loader: DataLoader, ctx: DistContext, prepare: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, float]:
    """Mean cross-entropy and accuracy over every example of the evaluation set.

    ``prepare`` turns a batch of images, already on the device, into the model's input.
    """
    _check_every_rank_has_data(loader, ctx)
    model.eval()
    # float64: exact counts, and loss sums that lose nothing to the order in which ranks add them.
    loss_sum, correct, count = torch.zeros(3, dtype=torch.float64, device=ctx.device)
    for (images, labels), counts in _lockstep_batches(loader, ctx):
        images, labels = images.to(ctx.device, non_blocking=True), labels.to(ctx.device, non_blocking=True)
        logits = model(prepare(images))
        if counts:
            loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum")
            correct += (logits.argmax(dim=1) == labels).sum()
            count += labels.numel()
    model.train()
    loss_sum, correct, count = _sum_over_ranks(torch.stack([loss_sum, correct, count]))
    return {"loss": loss_sum / count, "accuracy": correct / count, "samples": int(count)}


def logits_of(output: Any) -> torch.Tensor:
    """A language model's logits: its output itself, or the ``logits`` of the output object a Hugging Face
    model returns."""
    return output if isinstance(output, torch.Tensor) else output.logits


@torch.no_grad()
def evaluate_language_model(
    model: nn.Module, loader: DataLoader, ctx: DistContext, autocast: torch.dtype | None = None
) -> dict[str, float]:
    """Mean next-token cross-entropy (nats per token) over every held-out sequence.

    ``autocast``: the dtype a DDP run trains in under torch.autocast, so that it evaluates the same way.
    """
    _check_every_rank_has_data(loader, ctx)
    model.eval()
    loss_sum, tokens, sequences = torch.zeros(3, dtype=torch.float64, device=ctx.device)
    for (inputs, targets), counts in _lockstep_batches(loader, ctx):
        inputs, targets = inputs.to(ctx.device, non_blocking=True), targets.to(ctx.device, non_blocking=True)
        with torch.autocast(ctx.device.type, dtype=autocast, enabled=autocast is not None):
            logits = logits_of(model(inputs))
        if counts:
            # Padding (IGNORE_INDEX) adds nothing to the sum and is not counted.
            loss_sum += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
            tokens += (targets != IGNORE_INDEX).sum()
            sequences += targets.shape[0]
    model.train()
    loss_sum, tokens, sequences = _sum_over_ranks(torch.stack([loss_sum, tokens, sequences]))
    return {"loss": loss_sum / tokens, "samples": int(sequences), "tokens": int(tokens)}
