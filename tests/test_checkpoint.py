"""Checkpoints, exact resume and preemption, end to end through torchrun.

A run asked to stop (the STOP file a user or the SLURM launcher creates) in
the middle of an epoch, then resumed with --resume, must train exactly what
an uninterrupted run trains: the same loss at every step and the same final
parameters, bit for bit, since both run at the same world size on the same
CPU. Dropout stays on, so the random state has to be restored too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from common.checkpoint import changed_settings, identity_mismatch
from common.data import markov_data
from common.flag_checks import NOT_TRAINING_SETTINGS
from common.models import GPT, GPTConfig
from common.run_dir import LOCK_FILE, checkpoint_step, complete_checkpoints
from tests.harness.cases import NEEDS_FSDP2_ON_CPU, cases
from tests.harness.model_files import assert_same_parameters
from tests.harness.noise_floor import GLOBAL_BATCH, NoiseRuns, assert_same_training
from tests.harness.noise_floor import TRANSFORMER_ARGS as EQUIVALENCE_ARGS
from tests.harness.noise_floor import TRANSFORMER_STEPS as EQUIVALENCE_STEPS
from tests.harness.record_reads import assert_trained_once, trained_steps
from tests.harness.runs import REPO, Run, run_script, run_until_stopped
from tests.harness.wrappers import INJECT_FAULT, OBSERVE, RECORD_READS
from tools.runs import export_checkpoint

FSDP2 = "fsdp/train_transformer_fsdp2.py"
SCRIPTS = ["ddp/train_mnist.py", "ddp/train_transformer.py", "fsdp/train_mnist.py", "fsdp/train_transformer.py", FSDP2]

# Both kinds of run: 2 epochs of 20 steps at 2 processes. 640 images (tiny_mnist_dir)
# in global batches of 32; 320 sequences in global batches of 16, with a
# checkpoint every 10 steps besides the one taken when asked to stop.
MNIST_ARGS = ["--epochs", "2", "--batch-size", "16", "--test-batch-size", "100", "--log-interval", "1"]
TRANSFORMER_ARGS = [
    *("--max-steps", "40", "--global-batch-size", "16", "--block-size", "32", "--dropout", "0.1"),
    *("--train-sequences", "320", "--heldout-sequences", "40", "--warmup-steps", "3"),
    *("--log-interval", "1", "--eval-interval", "10", "--checkpoint-interval", "10"),
]
TRANSFORMER_CONFIG = GPTConfig(vocab_size=16, block_size=32, n_layer=2, n_head=4, d_model=64)

# (id, script, arguments, steps per epoch, total steps, format of the checkpoints)
CASES = [
    ("ddp-mnist", "ddp/train_mnist.py", MNIST_ARGS, 20, 40, "full"),
    ("fsdp1-mnist", "fsdp/train_mnist.py", MNIST_ARGS, 20, 40, "sharded"),
    ("ddp-transformer", "ddp/train_transformer.py", TRANSFORMER_ARGS, 20, 40, "full"),
    ("fsdp1-transformer", "fsdp/train_transformer.py", TRANSFORMER_ARGS, 20, 40, "sharded"),
    # One file gathered on rank 0: on a CPU, torch < 2.14 needs common.distributed.full_state_dict_options.
    (
        "fsdp1-transformer-full",
        "fsdp/train_transformer.py",
        [*TRANSFORMER_ARGS, "--checkpoint-format", "full"],
        20,
        40,
        "full",
    ),
    ("fsdp2-transformer", FSDP2, TRANSFORMER_ARGS, 20, 40, "sharded"),
    # LoRA adapters beside a frozen base: the exported checkpoint holds them merged, as model.pt does.
    ("fsdp2-transformer-lora", FSDP2, [*TRANSFORMER_ARGS, "--lora-rank", "4"], 20, 40, "sharded"),
]
# The floor pass (the oldest supported torch) runs one case per strategy family.
FLOOR_CASES = {"ddp-mnist", "fsdp1-transformer-full", "fsdp2-transformer"}
# Asked to stop a few steps into the second epoch; the run stops at the next
# step boundary it reaches after seeing the STOP file, well before the epoch ends.
STOP_AFTER_EPOCH_STEPS = 3


# Right after each resume, the optimizer's state as the run holds it and as its checkpoint holds it.
RESUMED_OPTIMIZER = [OBSERVE, "resumed-optimizer"]


def assert_optimizer_state_resumed(run_dir: Path, step: int, description: str) -> None:
    """Right after the resume at ``step``, each parameter's optimizer state (AdamW's step count and both moments,
    Adadelta's for MNIST) is the uninterrupted run's: every step count is ``step``, the steps it had taken, and the
    rest is the checkpoint's, bit for bit, at any world size and under any strategy (resharding moves values, it
    computes none).

    A loss that differs after the resume says that something differs; this says that it is the optimizer state."""
    observed = torch.load(run_dir / f"observed-resumed-optimizer-step{step}.pt", weights_only=True)
    loaded, saved = observed["loaded"], observed["saved"]
    counts = sorted({float(state["step"]) for state in loaded.values()})
    unlike = [
        f"{name}'s {key}"
        for name, state in saved.items()
        for key, value in state.items()
        if key not in loaded.get(name, {}) or not torch.equal(loaded[name][key], value)
    ]
    assert counts == [float(step)] and not unlike and loaded.keys() == saved.keys(), (
        f"the optimizer state after the resume at step {step} is not the uninterrupted run's: its step count "
        f"{counts} where the run had taken {step} steps; unlike the checkpoint's: {', '.join(unlike[:6]) or 'none'}"
        f"{' ...' if len(unlike) > 6 else ''}; parameters without state: {sorted(saved.keys() - loaded.keys())}"
        f"\n{description}"
    )


def train_history(run: Run) -> list[tuple]:
    return [(r["step"], r["epoch"], r["loss"], r["grad_norm"], r["lr"]) for r in run.events("train")]


def eval_history(run: Run) -> list[tuple]:
    return [(r["step"], r["loss"]) for r in run.events("eval")]


@pytest.mark.parametrize(
    ("script", "args", "per_epoch", "total", "kind"), cases(CASES, floor=FLOOR_CASES, keep_id=False)
)
def test_stopped_and_resumed_run_matches_an_uninterrupted_one(
    script: str, args: list[str], per_epoch: int, total: int, kind: str, tiny_mnist_dir: Path, tmp_path: Path
) -> None:
    if "mnist" in script:
        args = [*args, "--data-dir", str(tiny_mnist_dir)]
    reference_reads, reads = tmp_path / "reference-reads", tmp_path / "interrupted-reads"
    reference = run_script(script, args, tmp_path / "reference", nproc=2, wrapper=[RECORD_READS, str(reference_reads)])
    reference.check()
    losses = [record["loss"] for record in reference.events("train")]
    assert sum(losses[-5:]) < sum(losses[:5]), "the reference run must learn something"

    run_dir = tmp_path / "interrupted"
    stop_after = per_epoch + STOP_AFTER_EPOCH_STEPS
    recorded = [RECORD_READS, str(reads)]
    stopped = run_until_stopped(script, args, run_dir, nproc=2, stop_after=stop_after, wrapper=recorded).check()
    marker = json.loads((run_dir / "PREEMPTED").read_text())
    stopped_at = marker["step"]
    assert stop_after <= stopped_at < 2 * per_epoch, stopped.describe()  # inside the second epoch
    assert stopped.output.count(f"stopped at step {stopped_at} on request (a STOP file)") == 1, stopped.describe()
    assert not (run_dir / "STOP").exists() and not (run_dir / "model.pt").exists()
    checkpoint = Path(marker["checkpoint"])
    assert checkpoint_step(checkpoint) == stopped_at
    assert checkpoint.is_dir() == (kind == "sharded")
    # --keep-checkpoints 2: the newest periodic one survives beside the stop's.
    expected = 2 if "--checkpoint-interval" in args else 1
    assert complete_checkpoints(run_dir)[-expected:] == complete_checkpoints(run_dir)
    assert complete_checkpoints(run_dir)[-1] == checkpoint

    resumed = run_script(script, [*args, "--resume"], run_dir, nproc=2, wrapper=[*recorded, *RESUMED_OPTIMIZER])
    resumed.check()
    assert resumed.output.count(f"resumed from {checkpoint} at step {stopped_at}") == 1, resumed.describe()
    (resume_record,) = resumed.events("resume")
    assert resume_record["step"] == stopped_at
    assert_optimizer_state_resumed(run_dir, stopped_at, resumed.describe())
    steps_after_resume = [r["step"] for r in resumed.metrics() if r["event"] == "train" and r["step"] > stopped_at]
    assert steps_after_resume[0] == stopped_at + 1
    assert not (run_dir / "PREEMPTED").exists()

    # The same examples at every step, read once: checked by what was read, not only by the losses.
    assert_trained_once(reads, reference_reads, reference.final()["global_batch_size"], resumed.describe())
    assert train_history(resumed) == train_history(reference)
    assert eval_history(resumed) == eval_history(reference)
    assert resumed.final()["steps"] == total
    assert_same_parameters(run_dir / "model.pt", reference.run_dir / "model.pt")

    if kind == "sharded" and "--checkpoint-interval" in args:
        check_export(run_dir, resumed.final()["eval_loss"])


# 44 sequences in global batches of 8: 5 steps an epoch, and 44 - 5 x 8 = 4 sequences that drop_last leaves out.
EPOCH_END_ARGS = [
    *("--train-sequences", "44", "--heldout-sequences", "8", "--block-size", "16", "--global-batch-size", "8"),
    *("--max-steps", "7", "--checkpoint-interval", "4", "--log-interval", "1"),
]


def test_a_run_resumed_at_the_last_step_of_an_epoch_reads_only_what_it_trains(tmp_path: Path) -> None:
    """Resumed from step 4 of a 5-step epoch, the loaders read the 3 steps left, 24 sequences, and nothing of
    the 32 the checkpoint had already trained on: a data set whose reads cost (images decoded, remote
    shards) is not read again to find the place."""
    script = "ddp/train_transformer.py"
    reference_reads, resumed_reads = tmp_path / "reference-reads", tmp_path / "resumed-reads"
    reference_dir = tmp_path / "reference"
    run_script(script, EPOCH_END_ARGS, reference_dir, nproc=2, wrapper=[RECORD_READS, str(reference_reads)]).check()
    (checkpoint,) = [path for path in complete_checkpoints(reference_dir) if checkpoint_step(path) == 4]
    resumed = run_script(
        script, [*EPOCH_END_ARGS, "--resume-from", str(checkpoint)], tmp_path / "resumed", nproc=2,
        wrapper=[RECORD_READS, str(resumed_reads)],
    ).check()  # fmt: skip
    reads = [json.loads(line) for path in resumed_reads.glob("reads-*.jsonl") for line in path.read_text().splitlines()]
    read = sum("read" in line for line in reads)
    assert read == 3 * 8, f"the resumed run's loaders read {read} sequences to train 3 steps of 8\n{resumed.describe()}"
    trained = trained_steps(reference_reads, 8)
    assert trained_steps(resumed_reads, 8) == {step: trained[step] for step in (5, 6, 7)}, resumed.describe()
    # What drop_last leaves out of an epoch: its last 4 sequences, the same at any world size (the order is).
    first_epoch = [index for step in range(1, 6) for index in trained[step]]
    assert len(first_epoch) == len(set(first_epoch)) == 40


def check_export(run_dir: Path, eval_loss: float) -> None:
    """The last sharded checkpoint, exported, is the final model and scores the final evaluation."""
    newest = complete_checkpoints(run_dir)[-1]
    exported = run_dir / "exported.pt"
    # In this process: the command needs no process group, and a new interpreter would only add start-up.
    assert export_checkpoint.main([str(newest), str(exported)]) == 0
    assert_same_parameters(exported, run_dir / "model.pt")
    model = GPT(TRANSFORMER_CONFIG)
    model.load_state_dict(torch.load(exported, weights_only=True))
    model.eval()
    heldout = markov_data(32, train_sequences=320, heldout_sequences=40).heldout
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for inputs, targets in DataLoader(heldout, batch_size=20):
            loss_sum += F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum").item()
            tokens += targets.numel()
    assert loss_sum / tokens == pytest.approx(eval_loss, rel=1e-5)


# --- a run stopped and resumed under another strategy at another world size, four times -----------

DDP, FSDP1 = "ddp/train_transformer.py", "fsdp/train_transformer.py"
HSDP = ["--replicate-degree", "2"]
# Each chain: (script, processes, flags) per segment; between them, 8 switches of strategy and world size:
# every strategy to every other, both checkpoint formats read by every script, HSDP both ways.
SWITCHES = {
    "ddp-fsdp2-fsdp1-hsdp-fsdp1": [
        (DDP, 2, []),
        (FSDP2, 3, []),
        (FSDP1, 2, []),  # sharded
        (FSDP2, 4, HSDP),
        (FSDP1, 3, ["--checkpoint-format", "full"]),
    ],
    "fsdp2-ddp-fsdp1-ddp-fsdp2": [
        (FSDP2, 4, []),  # sharded
        (DDP, 2, []),
        (FSDP1, 3, ["--checkpoint-format", "full"]),
        (DDP, 4, []),
        (FSDP2, 2, []),
    ],
}
STRATEGY = {DDP: "ddp", FSDP1: "fsdp1_full_shard", FSDP2: "fsdp2"}


def strategy_of(script: str, flags: list[str]) -> str:
    return "fsdp2_hsdp" if flags == HSDP else STRATEGY[script]


@pytest.mark.parametrize("chain", SWITCHES.values(), ids=SWITCHES.keys())
def test_a_run_switched_between_strategies_and_world_sizes_trains_each_example_once(
    chain: list[tuple[str, int, list[str]]], transformer_noise: NoiseRuns, tmp_path: Path
) -> None:
    """Stopped every 4 steps and resumed under another strategy at another world size: a checkpoint belongs
    to the model, not to the script. Each step trains the examples the one-process reference's did, and the
    run is the same training, its optimizer state, schedule and random state carried across each switch: the
    optimizer state, checked right after each switch, is the one the previous strategy saved.

    The equivalence tests' settings: a global batch of 24, the same examples in every step at any world size.
    """
    run_dir, reads = tmp_path / "switched", tmp_path / "reads"
    recorded = [RECORD_READS, str(reads)]
    for segment, (script, nproc, flags) in enumerate(chain):
        args = [*EQUIVALENCE_ARGS, *flags, *(["--resume"] if segment else [])]
        wrapper = [*recorded, *RESUMED_OPTIMIZER] if segment else recorded
        if segment < len(chain) - 1:
            run_until_stopped(script, args, run_dir, nproc, stop_after=4 * (segment + 1), wrapper=wrapper).check()
        else:
            run = run_script(script, args, run_dir, nproc=nproc, wrapper=wrapper).check()
    resumes = run.events("resume")
    for record in resumes:
        assert_optimizer_state_resumed(run_dir, record["step"], run.describe())
    assert [record["world_size"] for record in resumes] == [nproc for _, nproc, _ in chain[1:]], resumes
    assert all(a["step"] < b["step"] for a, b in zip(resumes, resumes[1:], strict=False)), resumes
    strategies = [strategy_of(script, flags) for script, _, flags in chain]
    switches = [record["changed"]["strategy"] for record in resumes]
    assert switches == [list(pair) for pair in zip(strategies, strategies[1:], strict=False)], resumes
    assert run.output.count(f"strategy {strategies[-2]} -> {strategies[-1]}") == 1, run.describe()
    assert_trained_once(reads, transformer_noise.reference_reads, GLOBAL_BATCH, run.describe())
    # Up to each checkpoint the run had other world sizes, so it matches to rounding, not bit for bit.
    assert_same_training(transformer_noise, run_dir, run.describe(), EQUIVALENCE_STEPS)


# --- kills and damage: the last good checkpoint survives ------------------------------------------

SHORT_ARGS = [
    *("--max-steps", "20", "--checkpoint-interval", "5", "--log-interval", "5", "--eval-interval", "20"),
    *("--block-size", "32", "--train-sequences", "320", "--heldout-sequences", "40"),
]


def file_digests(folder: Path) -> dict[str, str]:
    """What every file of the run holds, but the lock file's note of its latest holder (no state of the run)."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != LOCK_FILE
    }


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def names(run_dir: Path) -> list[str]:
    return [path.name for path in complete_checkpoints(run_dir)]


def test_resume_after_a_torn_metrics_line(tmp_path: Path) -> None:
    """A disk that filled during an append leaves half a line; --resume leaves it out and goes on. The run had
    ended (its last checkpoint is its last step, after the last evaluation): the resume logs no second
    evaluation of that step."""
    run_dir = tmp_path / "run"
    run_script("ddp/train_transformer.py", SHORT_ARGS, run_dir).check()
    whole = (run_dir / "metrics.jsonl").read_text()
    with (run_dir / "metrics.jsonl").open("a") as metrics:
        metrics.write('{"event": "train", "step": 21, "lo')  # no newline: the write stopped there
    resumed = run_script("ddp/train_transformer.py", [*SHORT_ARGS, "--resume"], run_dir).check()
    assert resumed.output.count("left out 1 line(s) cut off mid-write") == 1, resumed.describe()
    # The finished run's final record is the one record after the checkpoint's step.
    assert resumed.output.count("1 record(s) after step 20 are replaced by this run") == 1, resumed.describe()
    records = resumed.metrics()  # every line parses
    history = [json.loads(line) for line in whole.splitlines()]
    assert history[-1]["event"] == "final"  # a resumed run writes its own
    assert records[: len(history) - 1] == history[:-1], resumed.describe()
    assert [record["event"] for record in records[len(history) - 1 :]] == ["resume", "final"], records
    evaluations = [record["step"] for record in records if record["event"] == "eval"]
    assert evaluations == [20], records


@NEEDS_FSDP2_ON_CPU
def test_kill_mid_save_and_damaged_checkpoint_lose_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    killed = run_script(
        FSDP2,
        SHORT_ARGS,
        run_dir,
        nproc=2,
        wrapper=[INJECT_FAULT, "kill-mid-save"],
        real_launcher=True,
    )
    assert killed.returncode != 0, killed.describe()
    # Rank 1 died after writing its shards of step 10, before the checkpoint was complete.
    assert names(run_dir) == ["step-5"]
    assert (run_dir / "checkpoints" / ".tmp-step-10").is_dir()

    resumed = run_script(FSDP2, [*SHORT_ARGS, "--resume"], run_dir, nproc=2).check()
    assert resumed.events("resume")[0]["step"] == 5
    assert resumed.final()["steps"] == 20
    assert names(run_dir) == ["step-15", "step-20"]  # the killed save's leftovers are gone too
    assert not (run_dir / "checkpoints" / ".tmp-step-10").exists()

    newest = run_dir / "checkpoints" / "step-20"
    truncate(max(newest.glob("*.distcp"), key=lambda path: path.stat().st_size))
    before = file_digests(run_dir)
    refused = run_script(FSDP2, [*SHORT_ARGS, "--resume"], run_dir, nproc=2)
    assert refused.returncode != 0, refused.describe()
    previous = run_dir / "checkpoints" / "step-15"
    message = f"checkpoint {newest} cannot be loaded"
    assert refused.output.count(message) == 1, refused.describe()
    assert f"--resume-from {previous}." in refused.output, refused.describe()
    assert file_digests(run_dir) == before, "a refused resume must change nothing"


def test_a_tensor_parallel_checkpoint_resumed_unsplit_says_how_to_go_on() -> None:
    """The TP script's checkpoint at --tp-degree 2 saves each q|k|v weight split in 3 parts ("qkv" in its identity).
    The FSDP2 script, which records no "qkv", compared its own keys only and went on to DCP's raw size mismatch
    (saved [3, 64, 64], current [192, 64]); the TP script in one process said "qkv is '3 parts' there, None here"."""
    common = {"model": GPTConfig(16, 64, 2, 4, 64).shape(), "lora": None, "tied": None, "trained": None}
    split, unsplit = {**common, "qkv": "3 parts"}, {**common, "qkv": None}  # the TP script's, at 2 ranks and at 1
    for ours in (common, unsplit):  # the FSDP2 script's identity, then the TP script's in one process
        message = identity_mismatch(split, ours)
        assert message is not None, "resumed a split checkpoint into whole weights"
        assert message.startswith(
            "its q|k|v weights were saved split for tensor parallelism: resume it with "
            "fsdp/train_transformer_fsdp2_tp.py at a --tp-degree above 1"
        ), message
        assert "python -m tools.runs.export_checkpoint CHECKPOINT model.pt" in message and "--init-from" in message
    # Which script resumes it, and at what degree (it said "resume it in one process", naming neither).
    whole = str(identity_mismatch(common, split))
    assert "saved whole; a --tp-degree above 1 splits them: resume it with fsdp/train_transformer_fsdp2.py" in whole
    assert "or with fsdp/train_transformer_fsdp2_tp.py at --tp-degree 1 (any number of processes)" in whole
    # Whole weights fit either way; a key only the first checkpoints recorded ("script") is still not compared.
    assert identity_mismatch(unsplit, common) is None and identity_mismatch(common, unsplit) is None
    assert identity_mismatch({**common, "script": "fsdp/train_transformer_fsdp2.py"}, common) is None


def test_full_checkpoint_from_another_run_or_damaged_is_refused_and_an_older_one_resumes(tmp_path: Path) -> None:
    script, run_dir = "ddp/train_transformer.py", tmp_path / "run"
    run_script(script, SHORT_ARGS, run_dir).check()  # one process: these checks need no second rank
    newest, previous = run_dir / "checkpoints" / "step-20.pt", run_dir / "checkpoints" / "step-15.pt"
    assert names(run_dir) == ["step-15.pt", "step-20.pt"]
    before = file_digests(run_dir)

    wider = run_script(script, [*SHORT_ARGS, "--resume", "--d-model", "32"], run_dir)
    assert wider.returncode == 2, wider.describe()
    assert "does not fit this run: model is {" in wider.output, wider.describe()

    # A checkpoint belongs to a model: another strategy's script resumes it (test_a_run_switched_...), but
    # not the MNIST CNN's checkpoint, under any script.
    mnist = ["--synthetic", "--max-steps", "1", "--checkpoint-interval", "1"]
    run_script("fsdp/train_mnist.py", mnist, tmp_path / "mnist", nproc=2).check()
    cnn = tmp_path / "mnist" / "checkpoints" / "step-1"
    other_model = run_script(script, [*SHORT_ARGS, "--resume-from", str(cnn)], tmp_path / "other", real_launcher=True)
    assert other_model.returncode == 2, other_model.describe()
    assert "does not fit this run: model is 'MnistNet' there, {'vocab_size'" in other_model.output, (
        other_model.describe()
    )

    truncate(newest)
    before[str(newest.relative_to(run_dir))] = hashlib.sha256(newest.read_bytes()).hexdigest()
    damaged = run_script(script, [*SHORT_ARGS, "--resume"], run_dir, real_launcher=True)
    assert damaged.returncode == 2, damaged.describe()
    truncated = "EOFError: a file in it ends too early, as a truncated file does"
    assert f"checkpoint {newest} cannot be loaded ({truncated})" in damaged.output, damaged.describe()
    assert f"resume from it with --resume-from {previous}." in damaged.output, damaged.describe()
    assert "Traceback" not in damaged.output, damaged.describe()
    assert file_digests(run_dir) == before, "a refused resume must change nothing"

    recovered = run_script(script, [*SHORT_ARGS, "--resume-from", str(previous)], run_dir).check()
    assert [record["step"] for record in recovered.events("resume")] == [15]
    assert names(run_dir) == ["step-15.pt", "step-20.pt"]  # step 20 saved again, whole this time
    torch.load(newest, weights_only=True)


def test_resume_applies_the_flags_it_is_given(tmp_path: Path) -> None:
    """The NaN message's advice: resume from an earlier checkpoint with a lower --lr. The lower lr and the
    new weight decay are what trains from the checkpoint's step on, and the run says so, once."""
    first, second = tmp_path / "first", tmp_path / "second"
    args = [*SHORT_ARGS[2:], "--max-steps", "10", "--log-interval", "1"]  # SHORT_ARGS less its --max-steps
    run_script("ddp/train_transformer.py", args, first).check()
    checkpoint = first / "checkpoints" / "step-5.pt"
    changed = [*args, "--resume-from", str(checkpoint), "--lr", "1e-4", "--weight-decay", "0"]
    resumed = run_script("ddp/train_transformer.py", changed, second).check()
    message = "from step 5 on, as the flags ask: --lr 0.01 -> 0.0001, --weight-decay 0.1 -> 0.0"
    assert resumed.output.count(message) == 1, resumed.describe()
    assert resumed.events("resume")[0]["changed"] == {"--lr": [0.01, 0.0001], "--weight-decay": [0.1, 0.0]}
    before = {r["step"]: r["lr"] for r in Run([], 0, "", first).events("train")}
    after = {r["step"]: r["lr"] for r in resumed.events("train")}
    assert sorted(after) == list(range(6, 11)), after
    assert all(after[step] == pytest.approx(before[step] / 100, rel=1e-12) for step in after), (before, after)
    unchanged = run_script("ddp/train_transformer.py", [*args, "--resume-from", str(checkpoint)], tmp_path / "same")
    assert "as the flags ask" not in unchanged.check().output, unchanged.describe()
    assert unchanged.events("resume")[0]["changed"] == {}


def test_resume_names_every_training_setting_that_changed(tmp_path: Path) -> None:
    """Settings that no optimizer or scheduler state holds (the schedule's shape, clipping, the seed) change
    the training as much as --lr: named on one line, once at 2 processes, and in the resume record. Where
    the run writes and how it logs may change without a word."""
    first, second = tmp_path / "first", tmp_path / "second"
    args = [*SHORT_ARGS[2:], "--max-steps", "5"]  # SHORT_ARGS less its --max-steps: one checkpoint, at step 5
    run_script("ddp/train_transformer.py", args, first).check()
    checkpoint = first / "checkpoints" / "step-5.pt"
    changed = ["--warmup-steps", "5", "--min-lr-ratio", "0.9", "--grad-clip", "0.001", "--seed", "7"]
    changed += ["--global-batch-size", "64"]  # left to the default before: 32 a rank, at 1 process
    unnamed = ["--log-interval", "1", "--eval-interval", "1", "--keep-checkpoints", "3"]
    resumed = run_script(
        "ddp/train_transformer.py", [*args, *changed, *unnamed, "--resume-from", str(checkpoint)], second, nproc=2
    ).check()
    message = (
        "from step 5 on, as the flags ask: --seed 1 -> 7, --global-batch-size unset -> 64, --grad-clip 1.0 -> 0.001, "
        "--warmup-steps 30 -> 5, --min-lr-ratio 0.1 -> 0.9\n"
    )
    assert resumed.output.count(message) == 1, resumed.describe()
    expected = {"--seed": [1, 7], "--global-batch-size": [None, 64], "--grad-clip": [1.0, 0.001]}
    expected |= {"--warmup-steps": [30, 5], "--min-lr-ratio": [0.1, 0.9]}
    assert resumed.events("resume")[0]["changed"] == expected, resumed.describe()
    # A checkpoint written before checkpoints recorded their flags: what cannot be compared is said, too.
    state = torch.load(checkpoint, weights_only=True)
    del state["trainer"]["settings"]
    (tmp_path / "older").mkdir()
    torch.save(state, tmp_path / "older" / "step-5.pt")
    older = [*args, "--lr", "1e-4", "--seed", "7", "--resume-from", str(tmp_path / "older" / "step-5.pt")]
    legacy = run_script("ddp/train_transformer.py", older, tmp_path / "third").check()
    assert legacy.output.count("records no flags (it was written before checkpoints did)") == 1, legacy.describe()
    assert legacy.output.count("as the flags ask: --lr 0.01 -> 0.0001\n") == 1, legacy.describe()


def test_a_flag_added_later_is_a_recorded_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The settings a checkpoint records come from each script's parser, not from a list: a flag a script
    gains is recorded and compared from the day it is added. Only the flags named as saying where or how a
    run writes, logs, saves or starts are left out, and each of those is a flag some script has."""
    parse = argparse.ArgumentParser.parse_args
    flags: set[str] = set()

    def with_a_new_flag(parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> argparse.Namespace:
        parser.add_argument("--new-knob", type=float, default=0.5)
        flags.update(flag for action in parser._actions for flag in action.option_strings)
        return parse(parser, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", with_a_new_flag)
    for script in SCRIPTS:
        parse_args = runpy.run_path(str(REPO / script))["parse_args"]
        _, settings = parse_args(["--run-dir", str(tmp_path / "run"), "--new-knob", "2"])
        assert settings["--new-knob"] == 2.0, script
        recorded = {flag: value for flag, value in settings.items() if flag != "--new-knob"}
        assert changed_settings(recorded, settings) == {"--new-knob": ["(not recorded)", 2.0]}, script
    assert not NOT_TRAINING_SETTINGS - flags, "left out, but no script has them"


def test_resuming_an_older_checkpoint_sets_the_newer_ones_aside(tmp_path: Path) -> None:
    """A run saved step-5 and step-10; resumed from step-5 to step 8, it saves step-8. The next plain
    --resume (what STOP, PREEMPTED and every requeue use) must continue step-8, and step-10 must survive."""
    run_dir = tmp_path / "run"
    first = [*SHORT_ARGS[2:], "--max-steps", "10"]  # checkpoints every 5 steps
    run_script("ddp/train_transformer.py", first, run_dir).check()
    step_10 = (run_dir / "checkpoints" / "step-10.pt").read_bytes()
    again = [*SHORT_ARGS[2:], "--max-steps", "8", "--checkpoint-interval", "4"]
    rolled_back = run_script(
        "ddp/train_transformer.py", [*again, "--resume-from", str(run_dir / "checkpoints" / "step-5.pt")], run_dir
    ).check()
    aside = run_dir / "abandoned" / "after-step-5"
    assert rolled_back.output.count(f"step-10.pt went further than step-5.pt: moved to {aside}") == 1
    assert names(run_dir) == ["step-5.pt", "step-8.pt"], rolled_back.describe()
    assert (aside / "step-10.pt").read_bytes() == step_10
    resumed = run_script("ddp/train_transformer.py", [*again, "--resume"], run_dir).check()
    assert f"resumed from {run_dir / 'checkpoints' / 'step-8.pt'} at step 8" in resumed.output, resumed.describe()
