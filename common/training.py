"""Pieces of the training loop that do not depend on the distribution strategy."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

from common.data import IGNORE_INDEX
from common.distributed import DistContext, FatalError, max_over_ranks, print0, shard_group_size
from common.metrics import (
    MetricsLog,
    max_state_bytes,
    model_flops_utilization,
    peak_flops,
    peak_memory_bytes,
    progress_line,
    reset_peak_memory,
    transformer_flops_per_token,
)


def plan_total_steps(steps_per_epoch: int, epochs: int | None, max_steps: int | None) -> int:
    """Optimizer steps to run: the end of the last epoch or --max-steps, whichever is first."""
    if steps_per_epoch == 0:
        raise FatalError(
            "the training set is too small for one optimizer step per epoch at this batch size, "
            "world size and --grad-accum-steps: lower the batch size or use fewer processes"
        )
    by_epochs = steps_per_epoch * epochs if epochs is not None else None
    candidates = [n for n in (by_epochs, max_steps) if n is not None]
    return min(candidates)


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_ratio: float) -> LambdaLR:
    """Linear warmup to the peak lr, then a cosine decay to ``min_ratio`` of it."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


class FiniteLossCheck:
    """Stops every rank when the training loss turns NaN or infinite, without reading the GPU every step.

    ``watch`` notes on the device the first step whose loss was not finite. The host reads that
    note only where it reads the device anyway: at the steps that log (before their optimizer
    step) and before a checkpoint is written. A GPU therefore never waits for this check, and a
    non-finite loss still never reaches a checkpoint or model.pt: the final step always logs.
    """

    NONE = 2**62  # "no bad step yet"; the ranks agree on the smallest step any of them saw

    def __init__(self, ctx: DistContext) -> None:
        self.first_bad_step = torch.full((), self.NONE, dtype=torch.int64, device=ctx.device)

    def watch(self, loss: torch.Tensor, step: int, read: bool) -> None:
        """Note ``loss``, the loss of optimizer step ``step``; ``read`` checks all notes so far now."""
        first_bad_here = ~torch.isfinite(loss) & (self.first_bad_step == self.NONE)
        self.first_bad_step = torch.where(first_bad_here, step, self.first_bad_step)
        if read:
            self.check(step, before_update=True)

    def check(self, step: int, before_update: bool = False) -> None:
        """Raise on every rank if any rank's loss was not finite at a step up to ``step``.

        A collective: every rank calls it at the same step.
        """
        first_bad = self.first_bad_step.clone()
        dist.all_reduce(first_bad, op=dist.ReduceOp.MIN)
        bad_step = int(first_bad.item())
        if bad_step == self.NONE:
            return
        if bad_step == step and before_update:
            what = "stopped before the optimizer applied it, and no checkpoint was written after it"
        else:
            what = (
                f"found at step {step}, where the run next read its losses (it reads them where it logs or "
                f"saves); no checkpoint or model.pt was written after step {bad_step - 1}"
            )
        raise FatalError(
            f"the training loss is not finite (NaN or inf) at step {bad_step}; {what}. Lower --lr, clip "
            "gradients (--grad-clip), or resume from an earlier checkpoint with --resume-from",
            exit_code=1,
        )


def global_token_count(micro_batches: list[tuple[torch.Tensor, torch.Tensor]], ctx: DistContext) -> torch.Tensor:
    """The targets that count in one optimizer step, over all its micro-batches and every rank: what
    the step's summed loss is divided by, so that every token weighs the same wherever it falls.

    Counted where the batches were loaded (on the host), then added up over the ranks on the device:
    the step never waits to read it. A mean per micro-batch would instead weigh a token by how many
    others share its micro-batch, which changes with the world size and the accumulation split.
    """
    local = sum((targets != IGNORE_INDEX).sum() for _, targets in micro_batches)
    count = local.to(ctx.device, non_blocking=True)
    dist.all_reduce(count)
    return count


class TokenCount:
    """What each optimizer step's summed loss is divided by: ``global_token_count``, or, for data that never
    pads, the number every step has (every target counts), known before the run: no step counts or sends it.
    On a GPU that is one NCCL collective a step fewer, and no host sum over every micro-batch's targets."""

    def __init__(self, padded: bool, targets_per_step: int, ctx: DistContext) -> None:
        self.padded, self.ctx = padded, ctx
        self.every_target = torch.tensor(targets_per_step, device=ctx.device)  # int64, as the count is

    def __call__(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return global_token_count(micro_batches, self.ctx) if self.padded else self.every_target


def mean_over_ranks(value: torch.Tensor) -> float:
    """The average of a scalar over all ranks (gloo has no AVG, so SUM then divide)."""
    total = value.detach().clone().float()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.item() / dist.get_world_size()


class ProgressReporter:
    """Every --log-interval steps: one metrics.jsonl record and one console line.

    Every rank must call ``report`` at the same steps, because the loss it
    reports is averaged over ranks with a collective.

    Throughput and step time count training alone: the clock stops while the
    run evaluates or saves (``paused``) and while it reports, and the run's
    overall figure leaves out its first interval, which pays for warming up
    (the first collectives, allocations, compilation). Peak memory is reset when
    the reporter is made (after the model is wrapped) and read at the last step,
    before anything gathers the whole model.
    """

    def __init__(
        self,
        log: MetricsLog,
        ctx: DistContext,
        total_steps: int,
        items_per_step: int,
        unit: str,
        first_step: int = 0,
    ) -> None:
        self.log = log
        self.ctx = ctx
        self.total_steps = total_steps
        self.items_per_step = items_per_step  # global: all ranks and micro-steps
        self.unit = unit  # "samples" or "tokens"
        self._last_step = first_step  # a resumed run starts counting at its checkpoint
        self._interval_seconds = 0.0
        self._running_since: float | None = time.perf_counter()
        self._warm = False
        self._steps = 0
        self._seconds = 0.0
        self.peak_memory: int | None = None
        reset_peak_memory(ctx.device)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent in here (evaluation, checkpoints) is not training time."""
        self._stop_clock()
        try:
            yield
        finally:
            self._running_since = time.perf_counter()

    def _stop_clock(self) -> None:
        if self._running_since is not None:
            self._interval_seconds += time.perf_counter() - self._running_since
            self._running_since = None

    def report(self, step: int, epoch: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        """``grad_norm`` is the global norm, already the same on every rank."""
        self._stop_clock()
        steps = step - self._last_step
        elapsed = max(self._interval_seconds, 1e-9)
        rate = self.items_per_step * steps / elapsed
        step_ms = 1000 * elapsed / steps
        if self._warm:
            self._steps += steps
            self._seconds += elapsed
        self._warm = True
        self._last_step, self._interval_seconds = step, 0.0
        if step == self.total_steps:
            self.peak_memory = peak_memory_bytes(self.ctx.device)
        mean_loss = mean_over_ranks(loss)
        norm = grad_norm.item()
        self.log.write(
            "train",
            step=step,
            epoch=epoch,
            loss=mean_loss,
            grad_norm=norm,
            lr=lr,
            step_ms=step_ms,
            **{f"{self.unit}_per_s": rate},
        )
        short_unit = "tok" if self.unit == "tokens" else "img"
        print0(
            progress_line(step, self.total_steps, epoch, mean_loss, norm, lr, f"{rate:9.0f} {short_unit}/s", step_ms)
        )
        self._running_since = time.perf_counter()

    def throughput(self) -> dict[str, float]:
        """Global items per second and mean step time after the first interval; empty if there was none."""
        if self._steps == 0:
            return {}
        return {
            f"{self.unit}_per_s": self.items_per_step * self._steps / self._seconds,
            "step_ms": 1000 * self._seconds / self._steps,
        }


def throughput_fields(progress: ProgressReporter | None, model: nn.Module, ctx: DistContext) -> dict[str, float]:
    """Throughput and, for the transformer on a GPU whose peak is known, MFU."""
    fields = progress.throughput() if progress is not None else {}
    peak = peak_flops(ctx.device)
    flops_per_token = transformer_flops_per_token(model) if peak is not None else None
    if "tokens_per_s" in fields and flops_per_token is not None:
        fields["mfu"] = model_flops_utilization(flops_per_token, fields["tokens_per_s"], peak, ctx.world_size)
    return fields


def finish_run(
    log: MetricsLog,
    ctx: DistContext,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    progress: ProgressReporter | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """Write the final record (memory figures are the largest over ranks) and print a summary."""
    state_bytes = max_state_bytes(model, optimizer, ctx)
    trained_peak = progress.peak_memory if progress is not None else None
    (peak,) = max_over_ranks([float(trained_peak if trained_peak is not None else peak_memory_bytes(ctx.device))], ctx)
    record = {
        **fields,
        "world_size": ctx.world_size,
        "shard_group_size": shard_group_size(model),
        "local_state_bytes": state_bytes,
        "peak_memory_bytes": int(peak),
        **throughput_fields(progress, model, ctx),
    }
    log.write("final", **record)
    print0(summary_line(record))
    return record


def summary_line(record: dict[str, Any]) -> str:
    mib = 2**20
    state = record["local_state_bytes"]
    parts = [
        f"done: {record['steps']} steps in {record['wall_s']:.1f} s",
        f"eval loss {record['eval_loss']:.4f}",
        f"per-rank params/grads/optimizer {state['params'] / mib:.1f}/{state['grads'] / mib:.1f}/"
        f"{state['optimizer'] / mib:.1f} MiB",
        f"peak memory {record['peak_memory_bytes'] / mib:.0f} MiB",
    ]
    for unit, short in (("tokens", "tok"), ("samples", "img")):
        if f"{unit}_per_s" in record:
            parts.append(f"{record[f'{unit}_per_s']:.0f} {short}/s")
    if "mfu" in record:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    return " | ".join(parts)


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
