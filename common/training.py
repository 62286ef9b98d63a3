"""The training loop's pieces that do not depend on the strategy: the schedule, the loss's checks and token
counts, the evaluation, and the metrics a run logs (metrics.jsonl, the progress line, memory and FLOPs)."""

from __future__ import annotations

import json
import math
import os
import random
import resource
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

from common.data import IGNORE_INDEX
from common.distributed import DistContext, FatalError, all_ranks_agree, local_part, local_state_bytes, max_over_ranks
from common.models import GPT
from common.outputs import open_log, write_text
from common.run_dir import METRICS_FILE, keep_holding
from common.safe_io import then_resume, what_is_kept, write_failure


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


class FiniteLossCheck:
    """Stops every rank when the training loss turns NaN or infinite, without reading the GPU every step.
    ``watch`` notes on the device the first step whose loss was not finite; the host reads it only where it reads
    the device anyway: at the steps that log (before their optimizer step) and before a checkpoint is written. So a
    GPU never waits for it, and a non-finite loss never reaches a checkpoint or model.pt: the final step logs."""

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
        """Raise on every rank if any rank's loss was not finite at a step up to ``step``; a collective."""
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


# Dense bf16 peaks per GPU (NVIDIA's data sheets, half the "with sparsity" figure) for MFU; MFU_PEAK_TFLOPS overrides
# them. Specific names first: NVL and PCIe boards must not match the SXM figure of their plain names (H200, H100).
PEAK_BF16_TFLOPS = {"H200 NVL": 835, "H200": 989, "H100 NVL": 835, "H100 PCIe": 756, "H100": 989, "A100": 312}
# Logged once per restart; any other record describes its step's state, the same however often a run restarts there.
PER_RESTART_EVENTS = {"resume"}


class MetricsLog:
    """One JSON object per line in ``run_dir/metrics.jsonl``, written by rank 0 and opened at the first record: a run
    that fails its checks writes nothing over an earlier run's metrics. A run resumed at step N keeps the records up to
    N (it trains and logs the later steps again), leaves out a line cut short (and says so), and does not write twice
    a record of a step's state that it kept (the final evaluation of a run resumed at its end)."""

    def __init__(self, run_dir: Path, ctx: DistContext, resumed_at: int | None = None) -> None:
        self.path, self.ctx, self.resumed_at = run_dir / METRICS_FILE, ctx, resumed_at
        self._file = None
        self._kept: set[tuple[str, int]] = set()  # (event, step) of the records kept from before the resume

    def write(self, event: str, **fields: Any) -> None:
        """Append one record. Every rank calls it at the same point; if rank 0 cannot write, all stop."""
        failure = write_failure(lambda: self._append({"event": event, **fields})) if self.ctx.is_main else None
        if not all_ranks_agree(failure is None, self.ctx):
            kept = what_is_kept(self.path.parent)
            raise FatalError(f"could not write {self.path}: {failure}. {kept}. {then_resume(failure)}", exit_code=1)

    def _append(self, record: dict[str, Any]) -> None:
        keep_holding(self.path.parent)  # where the run dir went, its lock went too
        if self._file is not None and (gone := self._gone_from_its_path(self._file)):
            # Deleted under the run (a cleanup job, an rm -rf of the run dir), or moved with a renamed
            # run dir: appending to the open file would lose every record, or put them elsewhere, without a word.
            print(f"warning: {self.path} was {gone} while this run wrote it; a new one starts here", flush=True)
            self._file.close()  # type: ignore[union-attr]
            self._file = None  # _open makes the folder again and, the file being gone, starts a new one
        if self._file is None:
            self._file = self._open()
        if record["event"] not in PER_RESTART_EVENTS and (record["event"], record.get("step")) in self._kept:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def _gone_from_its_path(self, file: IO[str]) -> str | None:
        """How the open ``file`` left ``self.path`` ("deleted", "moved or replaced"); None while it is still there."""
        opened = os.fstat(file.fileno())
        if opened.st_nlink == 0:
            return "deleted"
        try:
            return None if os.path.samestat(os.stat(self.path), opened) else "moved or replaced"
        except FileNotFoundError:
            return "moved or replaced"

    def _open(self) -> IO[str]:
        if self.resumed_at is None or not self.path.exists():
            return open_log(self.path, append=False)
        kept, torn, replaced = [], [], 0
        for number, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # an append that a full disk or a kill cut short
                torn.append(number)
                continue
            if record.get("step", math.inf) <= self.resumed_at:
                kept.append(line)
                self._kept.add((record.get("event"), record["step"]))
            else:
                replaced += 1
        if replaced:
            what = f"{replaced} record(s) after step {self.resumed_at} are replaced by this run"
            print(f"{self.path}: {what}, which trains those steps again", flush=True)
        if torn:
            lines = ", ".join(map(str, torn))
            print(f"{self.path}: left out {len(torn)} line(s) cut off mid-write (line {lines})", flush=True)
        # Replaced in one rename, so a kill here cannot lose the earlier history.
        write_text(self.path, "".join(line + "\n" for line in kept), overwrite=True)  # this run's own file
        return open_log(self.path, append=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def progress_line(
    step: int, max_steps: int, epoch: int, loss: float, grad_norm: float, lr: float, rate: str, step_ms: float
) -> str:
    width = len(str(max_steps))
    return (
        f"step {step:>{width}}/{max_steps} | epoch {epoch:>2} | loss {loss:8.4f} | grad norm {grad_norm:8.3f} | "
        f"lr {lr:9.3e} | {rate} | {step_ms:8.1f} ms/step"
    )


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queue, so a clock read next counts the work queued before it (a kernel or an NCCL
    collective returns once enqueued, gloo's once done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: allocated tensors on a GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak_rss if sys.platform == "darwin" else peak_rss * 1024  # Linux reports KiB


def max_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> dict[str, int]:
    """``local_state_bytes`` of the rank that holds the most, per kind."""
    local = local_state_bytes(model, optimizer)
    largest = max_over_ranks([float(v) for v in local.values()], ctx)
    return {key: int(value) for key, value in zip(local, largest, strict=True)}


def transformer_flops_per_token(model: nn.Module) -> float | None:
    """Training FLOPs per token of the GPT inside ``model`` (None if there is none): 6 per weight that multiplies
    (2 forward, 4 backward), plus attention's 12 x layers x width x sequence length (the PaLM paper's estimate);
    embedding lookups multiply nothing."""
    config = next((module.config for module in model.modules() if isinstance(module, GPT)), None)
    if config is None:
        return None
    # Sharded models hold only part of each weight: count a copy that takes no memory.
    with torch.device("meta"):
        whole = GPT(config)
    lookups = whole.tok_emb.weight.numel() + whole.pos_emb.weight.numel()
    weights = sum(p.numel() for p in whole.parameters()) - lookups
    return 6 * weights + 12 * config.n_layer * config.d_model * config.block_size


def peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of one GPU, or None on CPU and on GPUs the table does not know."""
    if device.type != "cuda":
        return None
    if "MFU_PEAK_TFLOPS" in os.environ:
        return float(os.environ["MFU_PEAK_TFLOPS"]) * 1e12
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)


def model_flops_utilization(flops_per_token: float, tokens_per_s: float, peak_per_gpu: float, gpus: int) -> float:
    """The share of the GPUs' peak that the model's own arithmetic used (recomputation does not count)."""
    return flops_per_token * tokens_per_s / (peak_per_gpu * gpus)
