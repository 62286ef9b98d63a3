"""A run's bookkeeping behind one object, ``Bookkeeping``: metrics.jsonl, progress lines, the observed step
(common.collectives), the final record (``FinalRecord``) and the stop requests of common.distributed's StopRequest.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn

from common.checkpoint import Resumed
from common.collectives import StepObserver
from common.data import TokenData
from common.distributed import (
    DistContext,
    FatalError,
    StopRequest,
    all_ranks_agree,
    local_state_bytes,
    max_over_ranks,
    print0,
    shard_group_size,
)
from common.hangs import training_ended, watch_paused
from common.models import transformer_flops_per_token
from common.outputs import open_log, write_text
from common.run_dir import METRICS_FILE, PREEMPTED_FILE, STOP_FILE, TENSORBOARD_DIR, RunDirLock
from common.safe_io import then_resume, what_is_kept, write_failure


def mean_over_ranks(value: torch.Tensor) -> float:
    """The average of a scalar over all ranks (gloo has no AVG, so SUM then divide)."""
    total = value.detach().clone().float()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.item() / dist.get_world_size()


# Logged once per restart; any other record describes its step's state, the same however often a run restarts there.
PER_RESTART_EVENTS = {"resume"}


class EventFile:
    """--tensorboard: each number of a metrics.jsonl record as the scalar EVENT/FIELD (train/loss, final/mfu) at its
    step, written from the record itself. A run starting at step N (0 when fresh) opens its file with SummaryWriter's
    ``purge_step`` N: TensorBoard hides the earlier files' points at step N and after (written again, or abandoned by a
    rollback), so a resumed run draws one line; what metrics.jsonl keeps at step N (``at_start``) is written again."""

    def __init__(self, run_dir: Path, start: int, at_start: list[dict[str, Any]]) -> None:
        from torch.utils.tensorboard import SummaryWriter  # only with --tensorboard: a copy runs without the package

        folder = run_dir / TENSORBOARD_DIR
        # TensorBoard reads a folder's files in the order of their names, which begin with the second each was opened:
        # a run resumed within the second of the last file's must wait for the next one, or be read before it.
        seconds = [int(p.name.split(".")[3]) for p in folder.glob("events.out.tfevents.*") if p.name[20:30].isdigit()]
        time.sleep(min(max(max(seconds, default=0) + 1 - time.time(), 0), 1))
        self.writer = SummaryWriter(str(folder), purge_step=start)
        for record in at_start:
            self.write(record)

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step", record.get("steps"))  # the final record's x: the steps the run trained
        for name, value in record.items():
            if name != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(f"{record['event']}/{name}", value, step)
        self.writer.flush()  # on disk with the record's line: a live TensorBoard shows it, a kill loses nothing


class MetricsLog:
    """One JSON object per line in ``run_dir/metrics.jsonl``, written by rank 0 and opened at the first record: a run
    that fails its checks writes nothing over an earlier run's metrics. A run resumed at step N keeps the records up to
    N (it trains and logs the later steps again), leaves out a line cut short (and says so), and does not write twice
    a record of a step's state that it kept (the final evaluation of a run resumed at its end). ``lock``: the run dir's,
    taken again before a record if its file left the folder (an rm -rf, a rename); None: no lock guards the folder."""

    tensorboard = False  # --tensorboard: each record to an EventFile too, opened with metrics.jsonl
    _board: EventFile | None = None

    def __init__(
        self, run_dir: Path, ctx: DistContext, resumed_at: int | None = None, lock: RunDirLock | None = None
    ) -> None:
        self.path, self.ctx, self.resumed_at, self.lock = run_dir / METRICS_FILE, ctx, resumed_at, lock
        self._file = None
        self._kept: set[tuple[str, int]] = set()  # (event, step) of the records kept from before the resume

    def write(self, event: str, **fields: Any) -> None:
        """Append one record. Every rank calls it at the same point; if rank 0 cannot write, all stop."""
        failure = write_failure(lambda: self._append({"event": event, **fields})) if self.ctx.is_main else None
        if not all_ranks_agree(failure is None, self.ctx):
            kept = what_is_kept(self.path.parent)
            raise FatalError(f"could not write {self.path}: {failure}. {kept}. {then_resume(failure)}", exit_code=1)

    def _append(self, record: dict[str, Any]) -> None:
        if self.lock is not None:
            self.lock.retake_if_lost()  # where the run dir went, its lock went too
        if self._file is not None and (gone := self._gone_from_its_path(self._file)):
            # Deleted under the run (a cleanup job, an rm -rf of the run dir), or moved with a renamed
            # run dir: appending to the open file would lose every record, or put them elsewhere, without a word.
            print(f"warning: {self.path} was {gone} while this run wrote it; a new one starts here", flush=True)
            self._file.close()  # type: ignore[union-attr]
            self._file = None  # _open makes the folder again and, the file being gone, starts a new one
        if self._file is None:
            self._file, at_start = self._open()
            if self.tensorboard and self._board is None:  # once: not again when metrics.jsonl is made anew
                self._board = EventFile(self.path.parent, self.resumed_at or 0, at_start)
        if record["event"] not in PER_RESTART_EVENTS and (record["event"], record.get("step")) in self._kept:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._board is not None:
            self._board.write(record)

    def _gone_from_its_path(self, file: IO[str]) -> str | None:
        """How the open ``file`` left ``self.path`` ("deleted", "moved or replaced"); None while it is still there."""
        opened = os.fstat(file.fileno())
        if opened.st_nlink == 0:
            return "deleted"
        try:
            return None if os.path.samestat(os.stat(self.path), opened) else "moved or replaced"
        except FileNotFoundError:
            return "moved or replaced"

    def _open(self) -> tuple[IO[str], list[dict[str, Any]]]:
        """The file to append to, and the records it keeps of the step this run starts from."""
        if self.resumed_at is None or not self.path.exists():
            return open_log(self.path, append=False), []
        kept, torn, replaced, at_start = [], [], 0, []
        for number, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # an append that a full disk or a kill cut short
                torn.append(number)
                continue
            if record.get("step", math.inf) <= self.resumed_at:
                kept.append(line)
                self._kept.add((record.get("event"), record["step"]))
                at_start += [record] if record["step"] == self.resumed_at else []
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
        return open_log(self.path, append=True), at_start

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._board is not None:
            self._board.writer.close()


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


# Dense bf16 peaks per GPU for MFU (NVIDIA's data sheets, docs/performance.md names each); MFU_PEAK_TFLOPS overrides
# them. Specific names first (NVL and PCIe before H200, H100), and a key ends where a word does: L4 is not the L40S.
BF16_TFLOPS = {"H200 NVL": 835, "H200": 989, "H100 NVL": 835, "H100 PCIe": 756, "H100": 989, "A100": 312, "L4": 121}


def peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of one GPU, or None on CPU and on GPUs the table does not know."""
    if device.type != "cuda":
        return None
    if "MFU_PEAK_TFLOPS" in os.environ:
        return float(os.environ["MFU_PEAK_TFLOPS"]) * 1e12
    name = torch.cuda.get_device_name(device).replace("-", " ") + " "  # "NVIDIA A100-SXM4-80GB": words end at a space
    return next((tflops * 1e12 for key, tflops in BF16_TFLOPS.items() if f"{key} " in name), None)


def model_flops_utilization(flops_per_token: float, tokens_per_s: float, peak_per_gpu: float, gpus: int) -> float:
    """The share of the GPUs' peak that the model's own arithmetic used (recomputation does not count)."""
    return flops_per_token * tokens_per_s / (peak_per_gpu * gpus)


class ProgressReporter:
    """Every --log-interval steps: one metrics.jsonl record and one console line; every rank calls ``report`` at the
    same steps (the loss is averaged over ranks). Throughput and step time count training alone: the clock stops in
    ``paused`` (evaluation, checkpoints) and while reporting, and the overall figure leaves out the first interval
    (warm-up: first collectives, allocations, compilation). Peak memory is reset here (after the model is wrapped)
    and read at the last step, before anything gathers the whole model."""

    def __init__(
        self, log: MetricsLog, ctx: DistContext, total_steps: int, examples: int, tokens_each: int, first_step: int
    ) -> None:
        self.log, self.ctx, self.total_steps = log, ctx, total_steps
        self.items_per_step = examples * max(tokens_each, 1)  # global: all ranks and micro-steps
        self.unit = "tokens" if tokens_each else "samples"
        self._last_step = first_step  # a resumed run starts counting at its checkpoint
        self._interval_seconds = 0.0
        self._running_since: float | None = time.perf_counter()
        self._warm = False  # past the first interval, which _steps and _seconds leave out
        self._steps, self._seconds = 0, 0.0
        self.peak_memory: int | None = None
        if ctx.device.type == "cuda":  # CUDA's peak count starts now (a process's peak resident set cannot be reset)
            torch.cuda.reset_peak_memory_stats(ctx.device)

    @contextmanager
    def paused(self) -> Iterator[None]:
        self._stop_clock()
        try:
            with watch_paused():  # nor does the hang watch wait for a step meanwhile
                yield
        finally:
            self._running_since = time.perf_counter()

    def _stop_clock(self) -> None:
        if self._running_since is not None:
            # The interval ends when the GPU's queue does (synchronize); only where the run reads values next anyway.
            synchronize(self.ctx.device)
            self._interval_seconds += time.perf_counter() - self._running_since
            self._running_since = None

    def report(self, step: int, epoch: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        """``grad_norm`` is the global norm, already the same on every rank."""
        self._stop_clock()
        steps, elapsed = step - self._last_step, max(self._interval_seconds, 1e-9)
        rate = self.items_per_step * steps / elapsed
        step_ms = 1000 * elapsed / steps
        if self._warm:
            self._steps += steps
            self._seconds += elapsed
        self._warm = True
        self._last_step, self._interval_seconds = step, 0.0
        if step == self.total_steps:
            self.peak_memory = peak_memory_bytes(self.ctx.device)
            training_ended()  # the hang watch's too
        mean_loss = mean_over_ranks(loss)
        norm, rates = grad_norm.item(), {f"{self.unit}_per_s": rate}
        self.log.write("train", step=step, epoch=epoch, loss=mean_loss, grad_norm=norm, lr=lr, step_ms=step_ms, **rates)
        rate_text = f"{rate:9.0f} {'tok' if self.unit == 'tokens' else 'img'}/s"
        print0(progress_line(step, self.total_steps, epoch, mean_loss, norm, lr, rate_text, step_ms))
        self._running_since = time.perf_counter()

    def throughput(self) -> dict[str, float]:
        """Global items per second and mean step time after the first interval; empty if there was none."""
        if self._steps == 0:
            return {}
        return {
            f"{self.unit}_per_s": self.items_per_step * self._steps / self._seconds,
            "step_ms": 1000 * self._seconds / self._steps,
        }


def summary_line(record: dict[str, Any]) -> str:
    mib, state = 2**20, record["local_state_bytes"]
    held = "/".join(f"{state[kind] / mib:.1f}" for kind in ("params", "grads", "optimizer"))
    parts = [
        f"done: {record['steps']} steps in {record['wall_s']:.1f} s",
        f"eval loss {record['eval_loss']:.4f}",
        f"per-rank params/grads/optimizer {held} MiB",
        f"peak memory {record['peak_memory_bytes'] / mib:.0f} MiB",
    ]
    for unit, short in (("tokens", "tok"), ("samples", "img")):
        if f"{unit}_per_s" in record:
            parts.append(f"{record[f'{unit}_per_s']:.0f} {short}/s")
    if "mfu" in record:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    return " | ".join(parts)


@dataclass(frozen=True)
class FinalRecord:
    """What a script says of its finished run in metrics.jsonl's "final" record; Bookkeeping adds the global batch
    and what it measured (world size, memory, throughput, what one step sent, wall time). A field left None is left
    out: the MNIST scripts have no model_config, the transformer's text data no entropy floor."""

    script: str
    strategy: str  # as the checkpoints record it: ddp, fsdp1_<sharding>, fsdp2, fsdp2_hsdp
    steps: int
    evaluation: dict[str, float]  # the last held-out evaluation: loss, samples and, for MNIST, accuracy
    mixed_precision: str | None = None
    reshard_after_forward: bool | None = None  # FSDP2's choice
    data: TokenData | None = None  # the transformer's: its entropy floor and how its ids decode
    model_config: dict[str, Any] | None = None  # with the decoding, what tools.runs.sample rebuilds the model from

    def fields(self) -> dict[str, Any]:
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        data = fields.pop("data")
        if data is not None:
            fields["entropy_floor"], fields["decoding"] = data.entropy_floor, data.decoding
        fields = {name: value for name, value in fields.items() if value is not None}
        evaluation = fields.pop("evaluation")
        fields["eval_loss"], fields["eval_samples"] = evaluation["loss"], evaluation["samples"]
        if "accuracy" in evaluation:
            fields["accuracy"] = evaluation["accuracy"]
        return fields


class Bookkeeping:
    """Everything a run records and obeys beside the training itself; every rank calls each method at the same point
    (collectives). ``check_loss`` and ``paused`` go to the Checkpointer: a NaN never saved, saving not training time."""

    NO_BAD_STEP = 2**62  # first_bad_step before any; the ranks agree on the smallest step any of them saw
    log: MetricsLog  # these three made by start(), once the checkpoint to resume from is known
    progress: ProgressReporter
    stop_request: StopRequest

    def __init__(
        self, run_dir: Path, ctx: DistContext, log_interval: int, profile: int, lock: RunDirLock, tensorboard: bool
    ) -> None:
        self.run_dir, self.ctx, self.log_interval, self.lock = run_dir, ctx, log_interval, lock
        self.tensorboard = tensorboard  # metrics.jsonl's numbers into an EventFile too
        self.started = time.perf_counter()  # wall_s counts the whole of train(), data loading included
        self.observer = StepObserver(run_dir, ctx, profile)  # what one step sends; --profile's trace of N steps
        self.first_bad_step = torch.full((), self.NO_BAD_STEP, dtype=torch.int64, device=ctx.device)  # a NaN loss's
        self.total_steps = self.global_batch = 0

    def start(self, resumed: Resumed, total_steps: int, global_batch: int, tokens_per_example: int = 0) -> None:
        """Open metrics.jsonl at the step this run starts from (a resume replaces the records after it), watch
        for stop requests, and start the clock of training time (tokens per second where examples have tokens)."""
        ctx, self.total_steps, self.global_batch = self.ctx, total_steps, global_batch
        examples = f"{global_batch} sequences of {tokens_per_example} tokens" if tokens_per_example else global_batch
        print0(f"{ctx.world_size} process(es) on {ctx.device.type} | global batch {examples} | {total_steps} steps")
        log = MetricsLog(self.run_dir, ctx, resumed_at=resumed.step if resumed.path else None, lock=self.lock)
        log.tensorboard = self.tensorboard
        progress = ProgressReporter(log, ctx, total_steps, global_batch, tokens_per_example, resumed.step)
        self.log, self.progress = log, progress
        if resumed.path:
            # A resume at another world size shows as a change; ``changed``: each setting that differs, [old, new].
            sizes = {"checkpoint_world_size": resumed.world_size, "world_size": ctx.world_size}
            log.write("resume", step=resumed.step, checkpoint=str(resumed.path), **sizes, changed=resumed.changed)
        self.stop_request = StopRequest(self.run_dir / STOP_FILE, self.run_dir / PREEMPTED_FILE, ctx)  # or a signal

    def stop_requested(self) -> bool:  # the same answer on every rank
        return self.stop_request.requested()

    def stop(self, step: int, checkpoint: Path | None) -> NoReturn:  # the PREEMPTED marker, then exit code 0
        self.stop_request.exit(step, checkpoint)

    def paused(self) -> AbstractContextManager[None]:  # an evaluation, a checkpoint: not training time
        return self.progress.paused()

    def begin_step(self, step: int) -> None:  # ``step`` steps done; until end_step, the next one and nothing else
        self.observer.begin_step(step)

    def end_step(self) -> None:
        self.observer.end_step()

    def logs(self, step: int) -> bool:  # the step that ends with ``step`` steps done: only those read the device
        return step % self.log_interval == 0 or step == self.total_steps

    def watch_loss(self, loss: torch.Tensor, step: int) -> None:
        """Stop every rank at a NaN or infinite loss, a GPU never waiting: note the first such step on the device and
        read it where the host reads anyway: the steps that log (the last one too) and a checkpoint's check_loss."""
        first_bad_here = ~torch.isfinite(loss) & (self.first_bad_step == self.NO_BAD_STEP)
        self.first_bad_step = torch.where(first_bad_here, step, self.first_bad_step)
        if self.logs(step):
            self.check_loss(step, before_update=True)

    def check_loss(self, step: int, before_update: bool = False) -> None:
        """Raise on every rank if any rank's loss was not finite at a step up to ``step``; a collective."""
        first_bad = self.first_bad_step.clone()
        dist.all_reduce(first_bad, op=dist.ReduceOp.MIN)
        bad_step = int(first_bad.item())
        if bad_step == self.NO_BAD_STEP:
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

    def report(self, step: int, epoch: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float) -> None:
        if self.logs(step):  # one metrics.jsonl record and one console line
            self.progress.report(step, epoch, loss, grad_norm, lr)

    def write(self, event: str, **fields: Any) -> None:  # one record of metrics.jsonl
        self.log.write(event, **fields)

    def finish(self, model: nn.Module, optimizer: torch.optim.Optimizer, record: FinalRecord) -> None:
        """Write the final record (memory figures are the largest over ranks), print a summary, close metrics.jsonl."""
        floor = record.data.entropy_floor if record.data is not None else None
        if floor is not None:
            loss = record.evaluation["loss"]
            above = f"{loss - floor:+.4f} nats/token above the best possible"
            print0(f"held-out loss {loss:.4f} vs. floor {floor:.4f}: {above}")
        ctx, log, progress = self.ctx, self.log, self.progress
        self.stop_request.settle()
        fields = {**record.fields(), "wall_s": time.perf_counter() - self.started}
        trained_peak = progress.peak_memory  # None: the run trained no last step (it resumed at its end)
        local_peak = trained_peak if trained_peak is not None else peak_memory_bytes(ctx.device)
        gpu_peak = peak_flops(ctx.device)  # MFU: for the transformer on a GPU whose peak is known
        state_bytes = max_state_bytes(model, optimizer, ctx)  # then the largest over ranks of each
        (peak,) = max_over_ranks([float(local_peak)], ctx)
        fields |= {"global_batch_size": self.global_batch, "world_size": ctx.world_size}
        fields |= {
            "shard_group_size": shard_group_size(model),
            "local_state_bytes": state_bytes,
            "peak_memory_bytes": int(peak),
            **progress.throughput(),
        }
        flops_per_token = transformer_flops_per_token(model) if gpu_peak is not None else None
        if "tokens_per_s" in fields and flops_per_token is not None:
            fields["mfu"] = model_flops_utilization(flops_per_token, fields["tokens_per_s"], gpu_peak, ctx.world_size)
        fields |= self.observer.record()  # what one step sent; --profile's trace, written now if the run ended in it
        log.write("final", **fields)
        print0(summary_line(fields))
        log.close()
