"""Evaluation that gives the same numbers at any world size.

Each rank scores its own unpadded shard and the ranks add up sums and counts,
never averages of averages, so 3 ranks on 1999 images report exactly what one
process reports.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common.distributed import DistContext, FatalError, max_over_ranks, sum_over_ranks


def _lockstep_batches(loader: DataLoader, ctx: DistContext) -> Iterator[tuple[Any, bool]]:
    """Yield ``(batch, counts)`` for as many batches as the busiest rank has.

    Unpadded shards can differ by one example, and so by one batch. A sharded
    model gathers its parameters inside every forward, so every rank must call
    it equally often: a rank that runs out repeats its first batch and marks it
    as not counted.
    """
    local_batches = len(loader)
    (most_batches,) = max_over_ranks([float(local_batches)], ctx.device)
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


@torch.no_grad()
def evaluate_classifier(model: nn.Module, loader: DataLoader, ctx: DistContext) -> dict[str, float]:
    """Mean cross-entropy and accuracy over every example of the evaluation set."""
    _check_every_rank_has_data(loader, ctx)
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for (images, labels), counts in _lockstep_batches(loader, ctx):
        images, labels = images.to(ctx.device), labels.to(ctx.device)
        logits = model(images)
        if counts:
            loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum").item()
            correct += (logits.argmax(dim=1) == labels).sum().item()
            count += labels.numel()
    model.train()
    loss_sum, correct, count = sum_over_ranks([loss_sum, correct, count], ctx.device)
    return {"loss": loss_sum / count, "accuracy": correct / count, "samples": int(count)}


@torch.no_grad()
def evaluate_language_model(model: nn.Module, loader: DataLoader, ctx: DistContext) -> dict[str, float]:
    """Mean next-token cross-entropy (nats per token) over every held-out sequence."""
    _check_every_rank_has_data(loader, ctx)
    model.eval()
    loss_sum, tokens, sequences = 0.0, 0, 0
    for (inputs, targets), counts in _lockstep_batches(loader, ctx):
        inputs, targets = inputs.to(ctx.device), targets.to(ctx.device)
        logits = model(inputs)
        if counts:
            loss_sum += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum").item()
            tokens += targets.numel()
            sequences += targets.shape[0]
    model.train()
    loss_sum, tokens, sequences = sum_over_ranks([loss_sum, tokens, sequences], ctx.device)
    return {"loss": loss_sum / tokens, "samples": int(sequences), "tokens": int(tokens)}
