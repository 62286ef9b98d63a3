"""The options of the GPU table (``python -m tools.benchmarks.benchmark --speedups``, docs/performance.md, "Step by
step") change how fast a step runs, not what it trains. Each is held here, on CPU, against the one-process reference
the equivalence tests share (tests/harness/noise_floor.py): to the bit where the same kernels run, and within the
noise floor (tools.checks.check_equivalence's verdict, SAME) where a kernel legitimately rounds otherwise. The
larger micro-batch of the table's last row is the twins' own relation (one micro-batch against K micro-steps of
the same global batch), which every equivalence test holds."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

from common import cli, flag_checks
from tests.harness.noise_floor import TRANSFORMER_ARGS, TRANSFORMER_STEPS, NoiseRuns, assert_same_training
from tests.harness.runs import run_script
from tools.benchmarks import benchmark
from tools.benchmarks.compare_strategies import Strategy
from tools.runs.compare_runs import train_records

DDP = "ddp/train_transformer.py"
FSDP2 = "fsdp/train_transformer_fsdp2.py"


def bits_unlike(reference: Path, candidate: Path, steps: list[int]) -> list[str]:
    """Where ``candidate``'s loss, gradient norm (at ``steps``) or final parameters differ from ``reference``'s in
    any bit."""
    ours, theirs = train_records(reference), train_records(candidate)
    unlike = [
        f"step {step} {key}: {theirs[step][key]!r} against {ours[step][key]!r}"
        for step in steps
        for key in ("loss", "grad_norm")
        if theirs[step][key] != ours[step][key]
    ]
    expected = torch.load(reference / "model.pt", weights_only=True)
    got = torch.load(candidate / "model.pt", weights_only=True)
    return unlike + [f"parameter {name}" for name, tensor in expected.items() if not torch.equal(tensor, got[name])]


def test_flash_attention_is_torchs_own_choice_and_reading_the_loss_less_often_changes_no_bit(
    transformer_noise: NoiseRuns, tmp_path: Path
) -> None:
    """``--sdpa-backend flash`` names the kernel torch picks by itself here, and ``--log-interval 5`` only reads
    the loss at fewer steps: both train the reference's numbers to the bit, every step and every parameter."""
    flash = run_script(DDP, [*TRANSFORMER_ARGS, "--sdpa-backend", "flash"], tmp_path / "flash").check()
    every_step = list(range(1, TRANSFORMER_STEPS + 1))
    unlike = bits_unlike(transformer_noise.reference, flash.run_dir, every_step)
    assert not unlike, f"--sdpa-backend flash is not torch's own choice: {unlike[:4]}\n{flash.describe()}"
    fewer_reads = run_script(DDP, [*TRANSFORMER_ARGS, "--log-interval", "5"], tmp_path / "log-5").check()
    logged = list(range(5, TRANSFORMER_STEPS + 1, 5))
    assert sorted(train_records(fewer_reads.run_dir)) == logged, fewer_reads.describe()
    unlike = bits_unlike(transformer_noise.reference, fewer_reads.run_dir, logged)
    assert not unlike, f"reading the loss less often changed the training: {unlike[:4]}\n{fewer_reads.describe()}"


OTHER_KERNELS = {
    # (script, flags): on CPU, the default is AdamW's loop over the tensors, and flash attention (above)
    "fused-adamw": (DDP, ["--fused-adamw"]),
    "math-attention": (DDP, ["--sdpa-backend", "math"]),
    "fsdp2-fused-adamw": (FSDP2, ["--fused-adamw"]),  # the fused kernel on FSDP2's sharded (DTensor) parameters
}


@pytest.mark.parametrize("case", sorted(OTHER_KERNELS))
def test_another_kernel_trains_the_same_within_the_noise_floor(
    case: str, transformer_noise: NoiseRuns, tmp_path: Path
) -> None:
    """A kernel that adds in another order is the same training, as check_equivalence judges it; and it did run:
    under DDP its numbers are not the reference's bits (a flag that changed nothing would pass SAME unseen)."""
    script, flags = OTHER_KERNELS[case]
    run = run_script(script, [*TRANSFORMER_ARGS, *flags], tmp_path).check()
    assert_same_training(transformer_noise, tmp_path, run.describe(), TRANSFORMER_STEPS)
    if script == DDP:
        steps = list(range(1, TRANSFORMER_STEPS + 1))
        assert bits_unlike(transformer_noise.reference, tmp_path, steps), f"{flags} changed no bit\n{run.describe()}"


# What FSDP1 with --compile and bf16 ended in on this CPU (torch 2.14.1) at its first evaluation, before the scripts
# evaluated eagerly (test_a_compiled_fsdp1_run_in_bf16_evaluates): a realistic failure for the table to survive.
FSDP1_COMPILE_FAILURE = (
    "fsdp1_full_shard at 1 failed (exit code 1):\n...\n[rank0]: torch._dynamo.exc.InternalTorchDynamoError: "
    "RuntimeError: attempting to assign a gradient with dtype 'float' to a tensor with grad_dtype 'BFloat16'.\n"
)


def test_the_speedups_table_runs_each_row_on_one_global_batch_and_survives_a_failed_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The table's command path on CPU: main() in this process, DDP's rows trained for real by the test launcher
    (without --compile, 18 s a run here; the cuda tests of tests/gpu_check.sh compile), FSDP1's compiled row failing
    as it once did on this CPU: its row says why, its later rows are skipped, the table and the JSON keep the rest."""
    launched: list[tuple[str, list[str]]] = []

    def launch(strategy: Strategy, world_size: int, run_dir: Path, flags: list[str]) -> dict:
        launched.append((strategy.name, flags))
        if strategy.name == "fsdp1_full_shard" and "--compile" in flags:
            sys.exit(FSDP1_COMPILE_FAILURE)
        eager = [flag for flag in flags if flag != "--compile"]
        return run_script(strategy.script, [*strategy.flags, *eager], run_dir, nproc=world_size).check().final()

    monkeypatch.setattr(benchmark, "launch", launch)
    monkeypatch.setattr(benchmark, "BENCHMARKED", ("ddp", "fsdp1_full_shard"))
    out = tmp_path / "speedups.json"
    flags = ["--speedups", "--warmup", "2", "--steps", "2", "--batch-size", "2", "--larger-batch-size", "4"]
    assert benchmark.main([*flags, "--out", str(out)]) == 1  # a row failed
    rows = json.loads(out.read_text())["runs"]
    ddp = [row for row in rows if row["strategy"] == "ddp"]
    assert [row["step"] for row in ddp] == [
        "eager",
        "+ compile",
        "+ fused AdamW",
        "+ flash attention",
        "+ loss read every 2 steps",
        "+ one micro-batch of 4",
    ]
    assert ddp[0]["gain"] is None and all(row["gain"] > 0 for row in ddp[1:]), ddp
    for row in ddp:
        assert row["steps"] == 2 and row["tokens_per_s"] > 0 and row["step_ms"] > 0 and row["mfu"] is None, row
    # Every row: the same global batch (micro-steps of 2, or one of 4); a host read every step until its row.
    ddp_flags = [row_flags for name, row_flags in launched if name == "ddp"]
    for row_flags, (accumulated, log_interval) in zip(
        ddp_flags, [("2", "1")] * 4 + [("2", "2"), (None, "2")], strict=True
    ):
        given = dict(zip(row_flags, row_flags[1:], strict=False))
        assert given.get("--grad-accum-steps") == accumulated and given["--log-interval"] == log_interval, row_flags
        assert given["--batch-size"] == ("2" if accumulated else "4"), row_flags
    assert "--sdpa-backend" in ddp_flags[3] and "--fused-adamw" in ddp_flags[2] and "--compile" in ddp_flags[1]
    fsdp1 = [row for row in rows if row["strategy"] == "fsdp1_full_shard"]
    assert [row["step"] for row in fsdp1] == ["eager", "+ compile"], fsdp1
    assert "grad_dtype 'BFloat16'" in fsdp1[1]["failed"], fsdp1
    shown = capsys.readouterr().out
    assert "| ddp | + one micro-batch of 4 |" in shown and "| fsdp1_full_shard | + compile | failed: " in shown


@pytest.mark.parametrize(
    ("backend", "precision", "refused"),
    [("flash", "fp32", True), ("cudnn", "fp32", True), ("flash", "bf16", False), ("efficient", "fp32", False)],
)
def test_on_a_gpu_a_kernel_without_fp32_is_refused_in_fp32(
    backend: str, precision: str, refused: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """flash and cudnn compute in bf16 or fp16 on a GPU: in fp32 torch would fail at the first forward, naming no
    flag. Checked here as on a GPU machine (the check asks only whether the run will use CUDA)."""
    monkeypatch.setattr(flag_checks, "wants_cuda", lambda device: True)
    parser = cli.Parser(prog="train_transformer.py")
    args = argparse.Namespace(sdpa_backend=backend, device="auto", mixed_precision=precision)
    if not refused:
        flag_checks.check_sdpa_backend(parser, args)
        return
    with pytest.raises(SystemExit) as exited:
        flag_checks.check_sdpa_backend(parser, args)
    assert exited.value.code == 2
    assert f"--sdpa-backend {backend} on a GPU computes in bf16 or fp16" in capsys.readouterr().err


@pytest.mark.skipif(
    not torch.backends.cpu.get_cpu_capability().startswith("AVX512"),
    reason="torch 2.14.1's compiled bf16 Block on AVX2 kernels computes a NaN loss (docs/performance.md)",
)
def test_a_compiled_fsdp1_run_in_bf16_evaluates(tmp_path: Path) -> None:
    """The speed-ups table's FSDP1 rows from its second on: training with --compile in bf16, then evaluating. On torch
    2.14.1 a compiled Block traced again without gradients fails there (InternalTorchDynamoError: a gradient of dtype
    float on a bf16 parameter), so the scripts evaluate eagerly. 6 s here with torch's compile cache warm, 18 cold.
    AVX-512 kernels only: with AVX2 ones torch's compiled bf16 Block computes a NaN loss at step 1 with one thread,
    and with two the same run once aborted on a corrupt heap (torch 2.14.1), faults of torch's, not the scripts'."""
    flags = ["--block-size", "32", "--train-sequences", "64", "--heldout-sequences", "8", "--max-steps", "2"]
    flags += ["--log-interval", "1", "--eval-interval", "1", "--compile", "--mixed-precision", "bf16"]
    run = run_script("fsdp/train_transformer.py", flags, tmp_path, nproc=1).check()
    assert [record["step"] for record in run.events("eval")] == [1, 2], run.describe()
