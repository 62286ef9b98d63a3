"""What a run reports: metrics.jsonl for tools and plots, one fixed-width line for people."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path
from typing import IO, Any

import torch
import torch.nn as nn

from common.distributed import DistContext, FatalError, all_ranks_agree, local_state_bytes, max_over_ranks
from common.models import GPT
from common.outputs import open_log, write_text
from common.run_dir import METRICS_FILE, keep_holding
from common.saving import then_resume, what_is_kept, write_failure

# Dense bf16 tensor-core peaks from NVIDIA's data sheets (half the "with sparsity" figure), per GPU,
# for MFU. More specific names first: the NVL and PCIe boards must not match the SXM figure of
# their plain names. MFU_PEAK_TFLOPS overrides the table.
PEAK_BF16_TFLOPS = {
    "H200 NVL": 835.0,
    "H200": 989.0,  # SXM
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,  # SXM
    "A100": 312.0,
}


# Each restart logs one of these; every other record describes the state at its step, which is the same
# however often a run restarts there.
PER_RESTART_EVENTS = {"resume"}


class MetricsLog:
    """Appends one JSON object per line to ``run_dir/metrics.jsonl`` on rank 0.

    The file is opened on the first record, not when the run starts, so a run
    that fails its checks writes nothing over an earlier run's metrics. A run
    resumed at step N keeps the records up to N and drops the later ones: the
    steps after the checkpoint are trained again and logged again. A line that
    is not a whole record (a write cut short) is left out, and said so. A record
    of the state at a step that the kept ones already hold (the final evaluation
    of a run resumed at its end) is not written twice.
    """

    def __init__(self, run_dir: Path, ctx: DistContext, resumed_at: int | None = None) -> None:
        self.path = run_dir / METRICS_FILE
        self.ctx = ctx
        self.resumed_at = resumed_at
        self._file = None
        self._kept: set[tuple[str, int]] = set()  # (event, step) of the records kept from before the resume

    def write(self, event: str, **fields: Any) -> None:
        """Append one record. Every rank calls it at the same point; if rank 0 cannot write, all stop."""
        failure = write_failure(lambda: self._append({"event": event, **fields})) if self.ctx.is_main else None
        if not all_ranks_agree(failure is None, self.ctx):
            raise FatalError(
                f"could not write {self.path}: {failure}. {what_is_kept(self.path.parent)}. {then_resume(failure)}",
                exit_code=1,
            )

    def _append(self, record: dict[str, Any]) -> None:
        keep_holding(self.path.parent)  # where the run dir went, its lock went too
        gone = self._file is not None and self._gone_from_its_path(self._file)
        if gone:
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
            there = os.stat(self.path)
        except FileNotFoundError:
            return "moved or replaced"
        return None if (there.st_ino, there.st_dev) == (opened.st_ino, opened.st_dev) else "moved or replaced"

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
            print(
                f"{self.path}: {replaced} record(s) after step {self.resumed_at} are replaced by this run, "
                "which trains those steps again",
                flush=True,
            )
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
    """Wait for the GPU's queue, so that a clock read next counts the work queued before it: a kernel or
    an NCCL collective returns once enqueued, gloo's once done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Start CUDA's peak-allocation count from now (the process's peak resident set cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


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
    """Training FLOPs per token of the GPT inside ``model`` (None if there is none).

    6 per weight that multiplies (2 forward, 4 backward), plus attention's
    scores and weighted sum, 12 x layers x width x sequence length (the PaLM
    paper's estimate). Embedding lookups multiply nothing, so they are left out.
    """
    gpt = next((module for module in model.modules() if isinstance(module, GPT)), None)
    if gpt is None:
        return None
    config = gpt.config
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
