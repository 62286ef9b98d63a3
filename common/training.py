"""The training loop's pieces that do not depend on the strategy: the schedule, the loss's checks and token
counts, the evaluation, seeding and the random state a checkpoint keeps."""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

from common.data import IGNORE_INDEX
from common.distributed import DistContext, FatalError, local_part, max_over_ranks


def plan_total_steps(steps_per_epoch: int, epochs: int | None, max_steps: int | None) -> int:
    """Optimizer steps to run: the end of the last epoch or --max-steps, whichever is first."""
    if steps_per_epoch == 0:
        raise FatalError(
            "the training set is too small for one optimizer step per epoch at this batch size, "
            "world size and --grad-accum-steps: lower the batch size or use fewer processes"
        )
    by_epochs = steps_per_epoch * epochs if epochs is not None else None
    return min(n for n in (by_epochs, max_steps) if n is not None)


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_ratio: float) -> LambdaLR:
    """Linear warmup to the peak lr, then a cosine decay to ``min_ratio`` of it."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def global_token_count(micro_batches: list[tuple[torch.Tensor, torch.Tensor]], ctx: DistContext) -> torch.Tensor:
    """The targets that count in one optimizer step, over its micro-batches and every rank: what its summed loss
    is divided by, so every token weighs the same (a mean per micro-batch would weigh a token by how many share
    its micro-batch, which changes with the world size and accumulation). Counted on the host where the batches
    were loaded, added up over the ranks on the device: the step never waits to read it."""
    local = sum((targets != IGNORE_INDEX).sum() for _, targets in micro_batches)
    count = local.to(ctx.device, non_blocking=True)
    dist.all_reduce(count)
    return count


class TokenCount:
    """What each step's summed loss is divided by: ``global_token_count``, or, for data that never pads, every
    step's number of targets, known before the run: on a GPU one NCCL collective a step fewer, and no host sum.
    ``copies``: ranks that train on the same batches (a tensor-parallel group), each target counted that often."""

    def __init__(self, padded: bool, targets_per_step: int, ctx: DistContext, copies: int = 1) -> None:
        self.padded, self.ctx, self.copies = padded, ctx, copies
        self.every_target = torch.tensor(targets_per_step, device=ctx.device)  # int64, as the count is

    def __call__(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        if not self.padded:
            return self.every_target
        return global_token_count(micro_batches, self.ctx) // self.copies


def lockstep_batches(loader: DataLoader, ctx: DistContext) -> Iterator[tuple[Any, bool]]:
    """Yield ``(batch, counts)`` for as many batches as the busiest rank has: unpadded shards can differ by a
    batch, and a sharded model gathers its parameters in every forward, so every rank must call it equally
    often. A rank that runs out repeats its first batch and marks it as not counted."""
    local_batches = len(loader)
    if local_batches == 0:  # the same dataset size on every rank, so every rank raises together
        raise FatalError(f"the evaluation set is smaller than the world size ({ctx.world_size} processes)")
    (most_batches,) = max_over_ranks([float(local_batches)], ctx)
    first = None
    for batch in loader:
        first = batch if first is None else first
        yield batch, True
    for _ in range(int(most_batches) - local_batches):
        yield first, False


def sum_over_ranks(totals: torch.Tensor) -> list[float]:
    """Add each rank's device totals and read them: the evaluation's one read of the GPU."""
    dist.all_reduce(totals)
    return totals.tolist()


@torch.no_grad()
def evaluate_language_model(
    model: nn.Module, loader: DataLoader, ctx: DistContext, copies: int = 1
) -> dict[str, float]:
    """Mean next-token cross-entropy (nats per token) over every held-out sequence. ``copies``: ranks that evaluate
    the same sequences (a tensor-parallel group), whose sums hold each sequence that many times."""
    model.eval()
    loss_sum, tokens, sequences = torch.zeros(3, dtype=torch.float64, device=ctx.device)
    for (inputs, targets), counts in lockstep_batches(loader, ctx):
        inputs, targets = inputs.to(ctx.device, non_blocking=True), targets.to(ctx.device, non_blocking=True)
        output = model(inputs)
        logits = output if isinstance(output, torch.Tensor) else output.logits  # a Hugging Face model's output
        if counts:
            # Padding (IGNORE_INDEX) adds nothing to the sum and is not counted.
            # Logits split over a tensor-parallel group, under loss_parallel, give a DTensor, alike on its ranks.
            loss_sum += local_part(F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum"))
            tokens += (targets != IGNORE_INDEX).sum()
            sequences += targets.shape[0]
    model.train()
    totals = sum_over_ranks(torch.stack([loss_sum, tokens, sequences]))
    loss_sum, tokens, sequences = (total / copies for total in totals)
    return {"loss": loss_sum / tokens, "samples": int(sequences), "tokens": int(tokens)}


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed Python and torch (CPU and every GPU) so a run can be repeated. ``deterministic`` also makes torch pick
    kernels that give the same bits every run (failing loudly where none exists), at some cost in speed."""
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; harmless on CPU.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.set_float32_matmul_precision("highest")  # no TF32 rounding on GPUs either


def capture_rng() -> dict[str, Any]:
    """The random state training draws from (dropout, anything else in Python or torch). Every rank seeds and
    draws alike, so rank 0's stands for all; the data order needs none (the sampler derives it from seed and epoch)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
