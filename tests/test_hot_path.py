"""Fast on a GPU by construction, checked where there is no GPU.

A GPU runs ahead of the host only while the host never waits for it. These tests check on CPU
what keeps that true: no training step reads a value from the device except where the run
logs, evaluates or saves; MNIST batches cost no per-image work; FSDP1 accumulates gradients in
fp32 under mixed precision; and the throughput figure counts training alone.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from common import bookkeeping
from common.data import CompactDistributedSampler, MarkovSource, train_loader
from common.distributed import DistContext, distributed, set_cpu_threads
from common.mnist import _open_mnist, normalize_images
from common.models import GPT, GPT_PRESETS, GPTConfig, count_parameters
from common.run_dir import TENSORBOARD_DIR
from tests.harness.cases import FSDP2_SCRIPT, NEEDS_FSDP2_ON_CPU
from tests.harness.per_image_mnist import per_image_mnist
from tests.harness.runs import Run, run_script, warm_output_of
from tests.harness.wrappers import OBSERVE, PER_IMAGE_MNIST
from tools.benchmarks import benchmark, overhead
from tools.benchmarks.compare_strategies import Strategy

# Not fsdp/train_transformer_fsdp2_tp.py: its loop is the FSDP2 script's line for line (diff the two: they differ in
# wrap_model and in the counts of ranks), and tensor parallelism adds DTensor collectives, which read nothing on the
# host. A run of it here would cost about 15 CPU-seconds of the suite's budget to find what the FSDP2 run finds.
TRANSFORMERS = ["ddp/train_transformer.py", "fsdp/train_transformer.py", "fsdp/train_transformer_fsdp2.py"]
SCRIPTS = ["ddp/train_mnist.py", "fsdp/train_mnist.py", *TRANSFORMERS]
SHORT_TRANSFORMER = ["--block-size", "32", "--train-sequences", "320", "--heldout-sequences", "40"]

# Reads of tensors that stay on the host in a GPU run too, so that the GPU never waits for them.
# Matched against the project's own line that asked (first) or torch's line that read (second).
HOST_SIDE = (
    "common/distributed.py:all_agree",  # the stop agreement: CPU tensors on the gloo host group
    "torch/optim/optimizer.py:_get_value",  # the optimizer's step counters, which torch keeps on the host
    "torch/utils/data/",  # the sampler's indices and the loader's seeds, drawn on the host
    "common/data.py:__iter__",  # CompactDistributedSampler's order, a host tensor read in chunks
)


def observed(run: Run, what: str, rank: int = 0) -> dict:
    assert run.returncode == 0, run.describe()
    return json.loads((run.run_dir / f"observed-{what}-rank{rank}.json").read_text())


def device_reads(record: dict) -> dict[int, list[str]]:
    """The reads that could wait for a GPU, by step."""
    by_step: dict[int, list[str]] = {}
    for read in record["reads"]:
        if not (read["project"].startswith(HOST_SIDE) or read["innermost"].startswith(HOST_SIDE)):
            by_step.setdefault(read["step"], []).append(
                f"{read['method']} from {read['project']} ({read['innermost']})"
            )
    return by_step


@pytest.mark.parametrize(
    "script", [pytest.param(s, marks=NEEDS_FSDP2_ON_CPU) if s == FSDP2_SCRIPT else s for s in SCRIPTS]
)
def test_steps_that_do_not_log_or_save_read_nothing_from_the_device(script: str, tmp_path: Path) -> None:
    # The transformer with the kernels of the speed-ups table's fastest rows (--compile aside: 18 s a run on CPU).
    data = ["--synthetic"] if "mnist" in script else [*SHORT_TRANSFORMER, "--fused-adamw", "--sdpa-backend", "flash"]
    # 8 steps: steps 4 and 8 log; the checkpoint after step 6 is written at the start of step 7,
    # before its zero_grad, so its reads count for step 6. 8 is the last step (evaluation, model.pt).
    # --tensorboard: its scalars come from the record's numbers, which the logging step has already read.
    args = [*data, "--max-steps", "8", "--log-interval", "4", "--checkpoint-interval", "6", "--tensorboard"]
    # fsdp/train_mnist.py's one run through torchrun itself: every script has one, for the launcher's contract.
    real = script == "fsdp/train_mnist.py"
    run = run_script(script, args, tmp_path, nproc=2, wrapper=[OBSERVE, "host-reads"], real_launcher=real)
    for rank in (0, 1):
        record = observed(run, "host-reads", rank)
        assert record["steps"] == 8
        reads = device_reads(record)
        quiet = {step: reads.get(step, []) for step in (1, 2, 3, 5, 7)}
        assert all(not found for found in quiet.values()), f"rank {rank}: {quiet}\n{run.describe()}"
        # The count sees reads where they are allowed: logging reads the loss (or it counts nothing).
        assert any("common/bookkeeping.py:report" in read for read in reads.get(4, [])), reads
    assert len(list((tmp_path / TENSORBOARD_DIR).glob("events.out.tfevents.*"))) == 1, "rank 0's event file"


def per_step(run: Run) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in run.events("train")]


def test_mnist_batches_on_the_device_train_exactly_as_the_per_image_transform(
    tiny_mnist_dir: Path, tmp_path: Path
) -> None:
    args = ["--data-dir", str(tiny_mnist_dir), "--epochs", "1", "--batch-size", "16", "--log-interval", "1"]
    tensors = run_script("ddp/train_mnist.py", args, tmp_path / "tensors", nproc=2).check()
    images = run_script("ddp/train_mnist.py", args, tmp_path / "images", nproc=2, wrapper=[PER_IMAGE_MNIST]).check()
    assert len(per_step(tensors)) == 20
    assert per_step(tensors) == per_step(images)  # bit for bit
    assert tensors.final()["eval_loss"] == images.final()["eval_loss"]
    assert tensors.final()["accuracy"] == images.final()["accuracy"]


def cpu_ms_per_batch(loader: DataLoader, prepare, passes: int = 3) -> float:  # noqa: ANN001
    """CPU time of this thread to deliver one batch ready for the model: the median of an epoch, the best
    of ``passes`` epochs. Other processes on the machine only ever add to it, so the best pass is the cost."""
    medians = []
    for _ in range(passes):
        times = []
        batches = iter(loader)
        while True:
            began = time.thread_time()
            try:
                images, _ = next(batches)
            except StopIteration:
                break
            prepare(images)
            times.append(time.thread_time() - began)
        medians.append(1000 * statistics.median(times))
    return min(medians)


def test_an_mnist_batch_of_64_takes_under_a_millisecond(mnist_dir: Path) -> None:
    ctx = DistContext(
        rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo"
    )
    tensors, _ = _open_mnist(mnist_dir, download=False)
    per_image, _ = per_image_mnist(mnist_dir, download=False)
    # One thread, as each rank runs (OMP_NUM_THREADS=1): with two, this thread's clock also counted its spin
    # at the pool's barrier while the other thread waited for a core the other pytest worker held (10.4 ms once).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fast = cpu_ms_per_batch(
            train_loader(tensors, 64, CompactDistributedSampler(tensors, 1, 0, seed=1), ctx), normalize_images
        )
        slow = cpu_ms_per_batch(
            train_loader(per_image, 64, CompactDistributedSampler(per_image, 1, 0, seed=1), ctx), lambda images: images
        )
    finally:
        torch.set_num_threads(threads)
    print(f"MNIST, a batch of 64: {fast:.2f} ms as tensors, {slow:.2f} ms per image (CPU time)")
    assert fast <= 1.0
    assert fast * 5 < slow


def test_fsdp1_accumulates_gradients_in_fp32_under_mixed_precision(tmp_path: Path) -> None:
    """Under no_sync, FSDP1 would add the micro-steps' gradients up in bf16; the script reduces every
    micro-step instead, so what the second micro-step finds is the first one's fp32 sharded gradient."""
    args = [*SHORT_TRANSFORMER, "--mixed-precision", "bf16", "--grad-accum-steps", "2", "--max-steps", "2"]
    run = run_script("fsdp/train_transformer.py", args, tmp_path, nproc=2, wrapper=[OBSERVE, "grad-dtype"])
    at_loss = observed(run, "grad-dtype")["at_loss"]
    assert at_loss == [[], ["torch.float32"], [], ["torch.float32"]], at_loss


def test_throughput_leaves_out_evaluation(tmp_path: Path) -> None:
    """An evaluation every second step (of many sequences) takes far longer than the steps between;
    the throughput must still be that of training.

    Judged within one run, so that the load of other tests on the machine weighs on both sides alike
    (two runs compared, one with evaluations and one without, were 2.05 times apart once under load).
    """
    args = [*SHORT_TRANSFORMER[:4], "--heldout-sequences", "2000", "--max-steps", "24", "--log-interval", "4",
            "--eval-interval", "2"]  # fmt: skip
    final = run_script("ddp/train_transformer.py", args, tmp_path).check().final()
    tokens = final["steps"] * final["global_batch_size"] * 32
    # The time the throughput implies: measured 8% of the run's wall time, evaluations being most of the
    # rest; had they been counted, it would be nearly all of it.
    assert tokens / final["tokens_per_s"] < 0.5 * final["wall_s"], final


@NEEDS_FSDP2_ON_CPU
def test_the_benchmark_compares_ddp_fsdp1_and_fsdp2_in_bf16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first command to run on GPUs, run here as on CPU: the tiny preset, one process per strategy.

    Its main() in this process, and each strategy's run from the test launcher instead of a torchrun
    of its own: what is tested is the command's choice of runs, flags, table and JSON; torchrun
    itself is tested elsewhere."""

    def launch(strategy: Strategy, world_size: int, run_dir: Path, flags: list[str]) -> dict:
        run = run_script(strategy.script, [*strategy.flags, *flags], run_dir, nproc=world_size).check()
        return run.final()

    monkeypatch.setattr(benchmark, "launch", launch)
    out = tmp_path / "benchmark.json"
    assert benchmark.main(["--nproc", "1", "--warmup", "1", "--steps", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["runs"]
    assert [row["strategy"] for row in rows] == ["ddp", "fsdp1_full_shard", "fsdp2"]
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["step_ms"] > 0 and row["peak_memory_gib"] > 0, row
        assert row["mfu"] is None  # only on a GPU of known peak
        final = Run([], 0, "", tmp_path / row["strategy"]).final()
        assert final["mixed_precision"] == "bf16" and final["steps"] == 3 and final["world_size"] == 1
    assert "| fsdp2 | 1 |" in capsys.readouterr().out


@NEEDS_FSDP2_ON_CPU
def test_the_overhead_benchmark_times_a_script_beside_a_bare_loop_that_trains_the_same_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`python -m tools.benchmarks.benchmark --overhead --strategy fsdp2 --nproc 2`, in this process, with its
    runs' ranks forked warm, as torchrun would start them: a round of each, the same shards trained by both
    (rank 0's share of the tiny preset), and the same last loss to the bit, or the command fails: on CPU a
    step's time depends on its numbers (subnormals), so a bare loop that trained others would measure them.
    The times themselves are a benchmark's, not a test's (docs/performance.md)."""
    monkeypatch.setattr(overhead, "output_of", warm_output_of)
    out = tmp_path / "overhead.json"
    flags = ["--overhead", "--model", "tiny", "--strategy", "fsdp2", "--nproc", "2", "--warmup", "2", "--steps", "3"]
    assert benchmark.main([*flags, "--rounds", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    tiny = GPT(GPTConfig(vocab_size=MarkovSource().vocab_size, **GPT_PRESETS["tiny"]))  # the script's default data
    rank_0_share = sum(-(-p.shape[0] // 2) * p[0].numel() for p in tiny.parameters())  # FSDP2 cuts dimension 0
    assert result["parameter_bytes"] == 4 * rank_0_share < 4 * count_parameters(tiny), result
    assert result["processes"] == 2 and result["strategy"] == "fsdp2", result
    assert len(result["script_ms"]) == len(result["bare_ms"]) == 1 and min(result["script_ms"] + result["bare_ms"]) > 0
    assert len(result["last_losses"]) == 1 and 0 < result["last_losses"][0] < 10, result
    assert result["ratio"] == result["script_median_ms"] / result["bare_median_ms"]
    assert "| tiny | fsdp2 | 2 |" in capsys.readouterr().out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_on_a_gpu_the_bare_loop_trains_the_scripts_numbers(strategy: str, tmp_path: Path) -> None:
    """On a GPU the script's fp32 matmuls run on TF32 tensor cores: a bare loop without them trained other
    numbers on an H200 (last loss 1.440988 against 1.441212 after 225 steps), and the benchmark stopped."""
    flags = ["--overhead", "--model", "tiny", "--strategy", strategy, "--nproc", "1", "--warmup", "5", "--steps", "20"]
    assert benchmark.main([*flags, "--rounds", "1", "--out", str(tmp_path / "overhead.json")]) == 0


def test_the_clock_of_an_interval_stops_once_the_device_has_done_its_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU runs behind the host: an interval of steps takes until the device's queue is done, or steps that
    only queue their kernels would look as fast as the host queues them. Here the host queues two steps in
    1 s and the device is done 4 s later: 2.5 s a step, not 0.5."""
    now = [0.0]
    monkeypatch.setattr(bookkeeping.time, "perf_counter", lambda: now[0])

    def queued_work_done(device: torch.device) -> None:
        now[0] += 4.0

    monkeypatch.setattr(bookkeeping, "synchronize", queued_work_done)
    with distributed("cpu", 60) as ctx:
        reporter = bookkeeping.ProgressReporter(bookkeeping.MetricsLog(tmp_path, ctx), ctx, 2, 10, 1, 0)
        now[0] += 1.0
        reporter.report(2, 1, torch.tensor(1.0), torch.tensor(1.0), 0.1)
    (record,) = Run([], 0, "", tmp_path).events("train")
    assert record["step_ms"] == 2500.0, record


def test_one_process_with_every_core_keeps_torchs_own_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Setting torch's thread count, even to the number it already had, also made MKL use every thread on
    the small matrix products of a small model: 15% on the tiny preset's step (common/distributed.py). So the
    count changes only where processes share the cores, or where torch's default is not this process's share
    (a Slurm task limited to some of a node's cores)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    asked: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # torch's default on a machine of 4 cores
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    set_cpu_threads(1)
    assert asked == []
    set_cpu_threads(2)  # two processes share the 4 cores
    assert asked == [2]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # a task given 2 of the 4
    set_cpu_threads(1)
    assert asked == [2, 2]


@pytest.mark.parametrize("value", ["", " ", "0", "-1", "four", "2x"])
def test_an_omp_num_threads_that_is_no_count_is_taken_as_unset_and_said_once(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """OpenMP reads such a value as every core, in each process: 2 ranks on 2 cores took 7 min 52 s for the
    README's job instead of 1 min 47 s, with only libgomp's "Invalid value" to see. Each process takes its share
    of the cores as if the variable were unset, its children get that count, and rank 0 alone says why."""
    asked: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("OMP_NUM_THREADS", value)
        set_cpu_threads(2)
        assert os.environ["OMP_NUM_THREADS"] == "2"
    assert asked == [2, 2]
    said = capsys.readouterr().out
    assert said.count(f"OMP_NUM_THREADS={value!r} is no thread count") == 1, said
    # What OpenMP takes as a count is the user's choice, left alone.
    for count in ("3", " 1 ", "2,1"):
        monkeypatch.setenv("OMP_NUM_THREADS", count)
        set_cpu_threads(2)
    assert asked == [2, 2] and capsys.readouterr().out == ""
