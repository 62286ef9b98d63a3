"""Checkpoints written in the background (--async-checkpoint) hold what synchronous ones hold, and lose nothing.

A background save copies the state before the next step changes it (staging). Without that copy the thread writes
whatever the parameters are when it gets to them: pytorch#144657, an async save of CPU tensors that wrote values of
later steps. Each run below saves after every step, so every step after a save changes what it is writing, and
each of its checkpoints is compared, tensor by tensor, with the synchronous run's of the same step: the same
contents, read by the same code, resume the same way (tests/test_checkpoint.py shows that for synchronous ones).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from common.async_checkpoint import BackgroundSave
from common.checkpoint import Checkpointer
from common.distributed import distributed
from common.models import GPT, GPTConfig
from common.run_dir import complete_checkpoints
from tests.harness.cases import NEEDS_FSDP2_ON_CPU
from tests.harness.model_files import assert_same_parameters
from tests.harness.runs import Run, run_script, warm_output_of
from tests.harness.wrappers import INJECT_FAULT
from tools.benchmarks import benchmark, checkpoint_stall

FSDP1, FSDP2 = "fsdp/train_transformer.py", "fsdp/train_transformer_fsdp2.py"
STEPS = 10
EVERY_STEP = [
    *("--max-steps", str(STEPS), "--checkpoint-interval", "1", "--keep-checkpoints", str(STEPS)),
    *("--log-interval", "5", "--eval-interval", str(STEPS), "--dropout", "0.1"),
    *("--block-size", "32", "--train-sequences", "320", "--heldout-sequences", "40"),
]


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``tree``'s leaves by their path, ``model.blocks.0.attn.weight``."""
    if isinstance(tree, dict):
        return {key: leaf for name, child in tree.items() for key, leaf in flat(child, f"{prefix}{name}.").items()}
    if isinstance(tree, list | tuple):
        return {key: leaf for i, child in enumerate(tree) for key, leaf in flat(child, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): tree}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def contents(checkpoint: Path, scratch: Path) -> dict[str, Any]:
    """Everything a sharded checkpoint holds, by path: DCP's tensors and trainer.pt (the step, the random state)."""
    whole = scratch / f"{checkpoint.parents[1].name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, whole)
    held = {"dcp": torch.load(whole, weights_only=True), "trainer": torch.load(checkpoint / "trainer.pt")}
    whole.unlink()
    return flat(held)


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return sorted(set(a) ^ set(b)) + [key for key in a if key in b and not same(a[key], b[key])]


def every_step_saved(script: str, run_dir: Path, background: bool) -> Run:
    """A checkpoint after every step; in the background, each written only once the next step is done
    (tests/harness/inject_fault.py's slow-disk), so that every step changes what is being written."""
    flags, wrapper = (["--async-checkpoint"], [INJECT_FAULT, "slow-disk"]) if background else ([], [])
    run = run_script(script, [*EVERY_STEP, *flags], run_dir, nproc=2, wrapper=wrapper).check()
    assert [path.name for path in complete_checkpoints(run_dir)] == [f"step-{n}" for n in range(1, STEPS + 1)]
    return run


def assert_background_saves_hold_what_synchronous_ones_do(synchronous: Path, background: Path, scratch: Path) -> None:
    before = None
    for step in range(1, STEPS + 1):
        expected = contents(synchronous / "checkpoints" / f"step-{step}", scratch)
        written = contents(background / "checkpoints" / f"step-{step}", scratch)
        differ = differences(expected, written)
        assert not differ, f"step-{step} written in the background differs in {differ[:5]} ({len(differ)} in all)"
        if before is not None:
            weights = [key for key in expected if key.startswith("dcp.model.")]
            assert any(not same(before[key], expected[key]) for key in weights), f"step {step} changed no weight"
        before = expected
    assert_same_parameters(synchronous / "model.pt", background / "model.pt")


@NEEDS_FSDP2_ON_CPU
def test_fsdp2_background_saves_are_the_synchronous_ones_and_a_kill_mid_write_resumes_the_last_complete(
    tmp_path: Path,
) -> None:
    """FSDP2 at 2 ranks, a checkpoint after each of 10 steps, synchronous and in the background: the same 10
    checkpoints. Then rank 1 SIGKILLed in the thread writing the fifth: the job ends, step-4 is the newest complete
    checkpoint, and the run resumed from it ends with the very model of the uninterrupted run."""
    every_step_saved(FSDP2, tmp_path / "sync", background=False)
    background = every_step_saved(FSDP2, tmp_path / "async", background=True)
    assert background.output.count("checkpoint: ") == STEPS, background.describe()
    assert_background_saves_hold_what_synchronous_ones_do(tmp_path / "sync", tmp_path / "async", tmp_path)

    # Keeping one: pruning must spare the last complete checkpoint while the next is being written.
    killed_dir, keep_one = tmp_path / "killed", [*EVERY_STEP, "--async-checkpoint", "--keep-checkpoints", "1"]
    killed = run_script(FSDP2, keep_one, killed_dir, nproc=2, wrapper=[INJECT_FAULT, "kill-in-background-save"])
    assert killed.returncode != 0, killed.describe()
    assert [path.name for path in complete_checkpoints(killed_dir)] == ["step-4"], killed.describe()
    assert (killed_dir / "checkpoints" / ".tmp-step-5").is_dir(), "the killed write left no trace: was it in flight?"
    resumed = run_script(FSDP2, [*keep_one, "--resume"], killed_dir, nproc=2).check()
    assert resumed.events("resume")[0]["step"] == 4, resumed.describe()
    assert [path.name for path in (killed_dir / "checkpoints").iterdir()] == [f"step-{STEPS}"]
    assert_same_parameters(tmp_path / "sync" / "model.pt", killed_dir / "model.pt")


@pytest.mark.parametrize("script", [FSDP1])
def test_fsdp1_background_saves_are_the_synchronous_ones(script: str, tmp_path: Path) -> None:
    """FSDP1's sharded state dict: ShardedTensors, which DCP's own default stager cannot copy (torch 2.14.1: "torch
    function 'data_ptr' ... not supported for ShardedTensor"). FSDP1 builds that state dict out of fresh tensors, so
    here a save without staging wrote the right values too: FSDP2's case above is the one that needs the copy."""
    every_step_saved(script, tmp_path / "sync", background=False)
    every_step_saved(script, tmp_path / "async", background=True)
    assert_background_saves_hold_what_synchronous_ones_do(tmp_path / "sync", tmp_path / "async", tmp_path)


def test_a_load_waits_for_the_background_save_it_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan#930: a load right after an async save read a checkpoint not yet written. Here the write is held
    until something waits for it; the resume from it must wait, then load the values saved, not those changed
    after the save."""
    waited = threading.Event()
    write_data, wait = dcp.FileSystemWriter.write_data, BackgroundSave.wait

    def held_write(*args: Any, **kwargs: Any) -> Any:
        assert waited.wait(timeout=60), "nothing waited for the background save"
        return write_data(*args, **kwargs)

    def waiting(self: BackgroundSave) -> Path | None:
        waited.set()
        return wait(self)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", held_write)
    monkeypatch.setattr(BackgroundSave, "wait", waiting)
    with distributed("cpu", 60) as ctx:
        model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, d_model=8))
        optimizer = torch.optim.AdamW(model.parameters())
        checkpoints = Checkpointer(
            *(ctx, tmp_path),
            **dict(model=model, optimizer=optimizer, extra={}, identity={}, strategy="ddp", settings={}),
            **dict(global_batch_size=1, sharded=True, interval=1, keep=2, check_before_save=lambda step: None),
            asynchronous=True,
        )
        saved = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        checkpoints.save(1)
        assert not waited.is_set()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)  # what the next step does to the tensors being saved
        resumed = checkpoints.resume(resume=False, resume_from=tmp_path / "checkpoints" / "step-1")
    assert resumed.step == 1
    assert all(torch.equal(saved[name], tensor) for name, tensor in model.state_dict().items())


def test_a_run_that_fails_completes_the_checkpoint_in_flight_first(tmp_path: Path) -> None:
    """DDP (whose background saves are DCP's too) at 2 ranks: rank 1's loss turns NaN at step 3 while the
    checkpoint of step 2 is held in the background (slow-disk). The run stops with its one message, and its
    teardown first waits for that write: step-2 is complete, and the run says so."""
    flags = ["--max-steps", "6", "--checkpoint-interval", "1", "--log-interval", "1", "--async-checkpoint"]
    flags += ["--block-size", "32", "--train-sequences", "320", "--heldout-sequences", "40"]
    run_dir = tmp_path / "run"
    failed = run_script(
        "ddp/train_transformer.py", flags, run_dir, 2, timeout=90, wrapper=[INJECT_FAULT, "slow-disk+nan"]
    )
    assert failed.returncode == 1, failed.describe()
    assert failed.output.count("error: the training loss is not finite (NaN or inf) at step 3") == 1, failed.describe()
    written = f"the checkpoint being written when the run failed, {run_dir / 'checkpoints' / 'step-2'}, is complete"
    assert failed.output.count(written) == 1, failed.describe()
    assert [path.name for path in complete_checkpoints(run_dir)] == ["step-1", "step-2"]


def test_the_checkpoint_benchmark_times_each_way_of_saving(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m tools.benchmarks.benchmark --checkpoint`` at its smallest: one round of 4 steps each way, in one
    process, its runs' ranks forked warm. What it reports is checked, not how fast (the figures in
    docs/checkpoints.md come from a quiet machine)."""
    monkeypatch.setattr(checkpoint_stall, "output_of", warm_output_of)
    out = tmp_path / "checkpoint.json"
    argv = ["--checkpoint", "--model", "tiny", "--nproc", "1", "--steps", "4", "--checkpoint-every", "2"]
    assert benchmark.main([*argv, "--rounds", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    modes = result["modes"]
    assert list(modes) == ["synchronous", "background", "never"], result
    assert modes["synchronous"]["blocked_ms_per_save"] > 0 and modes["background"]["blocked_ms_per_save"] > 0
    assert modes["never"]["blocked_ms_per_save"] is None and modes["never"]["wall_over_never"] == 1.0
    assert all(len(walls) == 1 and walls[0] > 0 for walls in result["loop_wall_s"].values()), result
