"""Pieces of the training loop that do not depend on the distribution strategy."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.lr_scheduler import LambdaLR

from common.distributed import DistContext, FatalError, all_ranks_agree, max_over_ranks, print0
from common.metrics import (
    MetricsLog,
    max_state_bytes,
    model_flops_utilization,
    peak_flops,
    peak_memory_bytes,
    progress_line,
    shard_group_size,
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


def stop_if_loss_is_not_finite(loss: torch.Tensor, step: int, ctx: DistContext) -> None:
    """Stop every rank, before the optimizer step, if the loss is NaN or infinite on any rank.

    Checked before the step so that the weights (and any checkpoint saved
    later) never hold what a non-finite loss would do to them.
    """
    if not all_ranks_agree(bool(torch.isfinite(loss).all()), ctx.device):
        raise FatalError(
            f"the training loss is not finite (NaN or inf) at step {step}; stopped before the optimizer "
            "applied it, and no checkpoint was written after it. Lower --lr, clip gradients (--grad-clip), "
            "or resume from an earlier checkpoint with --resume-from",
            exit_code=1,
        )


def mean_over_ranks(value: torch.Tensor) -> float:
    """The average of a scalar over all ranks (gloo has no AVG, so SUM then divide)."""
    total = value.detach().clone().float()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.item() / dist.get_world_size()


class ProgressReporter:
    """Every --log-interval steps: one metrics.jsonl record and one console line.

    Every rank must call ``report`` at the same steps, because the loss it
    reports is averaged over ranks with a collective.
    """

    def __init__(self, log: MetricsLog, total_steps: int, items_per_step: int, unit: str, first_step: int = 0) -> None:
        self.log = log
        self.total_steps = total_steps
        self.items_per_step = items_per_step  # global: all ranks and micro-steps
        self.unit = unit  # "samples" or "tokens"
        self._last_time = time.perf_counter()
        self._last_step = first_step  # a resumed run starts counting at its checkpoint
        self._steps = 0
        self._seconds = 0.0

    def report(self, step: int, epoch: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        """``grad_norm`` is the global norm, already the same on every rank."""
        mean_loss = mean_over_ranks(loss)
        now = time.perf_counter()
        steps = step - self._last_step
        elapsed = max(now - self._last_time, 1e-9)
        rate = self.items_per_step * steps / elapsed
        step_ms = 1000 * elapsed / steps
        self._last_time, self._last_step = now, step
        self._steps += steps
        self._seconds += elapsed
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

    def throughput(self) -> dict[str, float]:
        """Global items per second and mean step time over every step this run trained; empty if none.

        Measured from report to report, so evaluations and checkpoints between
        two reports count, as they do for whoever waits for the run.
        """
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
    (peak,) = max_over_ranks([float(peak_memory_bytes(ctx.device))], ctx.device)
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
