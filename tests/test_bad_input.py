"""Mistakes a user makes get one clear message and a non-zero exit, not a traceback per rank."""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
from pathlib import Path

import pytest
import torch

from common.cli import Parser
from common.flag_checks import check_launch_environment
from common.models import GPT, GPTConfig
from tests.harness.mnist_fixture import write_fake_mnist
from tests.harness.runs import REPO, clean_env, run_script
from tools.benchmarks import compare_strategies
from tools.checks import check_equivalence
from tools.runs import sample

FSDP1, FSDP2 = "fsdp/train_transformer.py", "fsdp/train_transformer_fsdp2.py"
CASES = [
    # (script, arguments, text the single message must contain)
    ("ddp/train_mnist.py", ["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    ("ddp/train_transformer.py", ["--d-model", "66", "--n-head", "4"], "--d-model 66 must be divisible by --n-head 4"),
    ("ddp/train_mnist.py", ["--global-batch-size", "10", "--batch-size", "5"], "not both"),
    ("ddp/train_transformer.py", ["--deterministic", "--dropout", "0.1"], "--deterministic needs --dropout 0"),
    # torch's own words, at the first forward: "No viable backend for scaled_dot_product_attention was found".
    (FSDP2, ["--sdpa-backend", "efficient"], "--sdpa-backend efficient is a CUDA kernel and this run has no GPU"),
    (FSDP1, ["--sharding-strategy", "hybrid_shard", "--replicate-degree", "2"], "not divide the world size 1"),
    (FSDP1, ["--replicate-degree", "2"], "--replicate-degree only applies to --sharding-strategy hybrid_shard"),
    (FSDP1, ["--sharding-strategy", "hybrid_shard"], "hybrid_shard on one machine: give --replicate-degree R"),
    (FSDP1, ["--cpu-offload"], "--cpu-offload frees GPU memory by moving state to the host; this run has no GPU"),
    (FSDP2, ["--mixed-precision", "fp16"], "argument --mixed-precision: invalid choice: 'fp16'"),
    ("ddp/train_transformer.py", ["--dropout", "1.5"], "--dropout: must be in [0, 1), got 1.5"),
    ("ddp/train_mnist.py", ["--resume", "--resume-from", "README.md"], "give --resume (the newest checkpoint) or"),
    ("ddp/train_mnist.py", ["--resume-from", "common"], "--resume-from common: not a checkpoint"),
    ("ddp/train_transformer.py", ["--text-file", "README.md", "--variable-length"], "--variable-length cuts the"),
    ("fsdp/train_transformer.py", ["--token-file", "README.md"], "README.md.json beside it"),
    (FSDP2, ["--text-file", "README.md", "--token-file", "README.md"], "give --text-file or --token-file, not both"),
    ("ddp/train_transformer.py", ["--init-from", "README.md", "--resume-from", "common"], "give --resume-from (con"),
    # Numbers past a flag's range (nan, inf, 1e999, 0 and -1 are tried on every flag by test_every_flag.py).
    ("ddp/train_transformer.py", ["--lr", "1e38"], "--lr: must be at most 3.4e+37: the optimizer's float32"),
    ("fsdp/train_mnist.py", ["--dist-timeout", "1e13"], "--dist-timeout: must be from 10 to 604800 seconds"),
    ("ddp/train_transformer.py", ["--seed", "99999999999999999999999"], "--seed: must be an integer from 0 to"),
    ("ddp/train_transformer.py", ["--train-sequences", "1000000000000"], "the synthetic data would take 484,288 GiB"),
    (FSDP2, ["--heldout-sequences", "10000000000000"], "--heldout-sequences 10000000000000 at --block-size 64: the"),
    ("ddp/train_transformer.py", ["--d-model", "1000000", "--n-head", "1"], "the weights alone would take 89,407 GiB"),
    (FSDP1, ["--block-size", "200000"], "--block-size: must be an integer from 1"),
    # Found once the data is loaded, inside the process group: still one message and exit code 2.
    ("ddp/train_transformer.py", ["--train-sequences", "10"], "the training set is too small for one optimizer step"),
]


@pytest.fixture(autouse=True)
def single_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process runs must see no launcher's variables, as a plain `python script.py` would."""
    for name in os.environ.keys() - clean_env().keys():
        monkeypatch.delenv(name, raising=False)


def run_in_process(script: str, args: list[str], run_dir: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Call the script's main() here: flags are checked before any process group
    exists, so no subprocess (and no seconds of torch start-up) is needed."""
    main = runpy.run_path(str(REPO / script))["main"]
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cpu", "--run-dir", str(run_dir), *args])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out + captured.err


@pytest.mark.parametrize(("script", "args", "message"), CASES, ids=[f"{s} {' '.join(a)}" for s, a, _ in CASES])
def test_bad_flag_is_refused(
    script: str, args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, output = run_in_process(script, args, tmp_path / "run", capsys)
    assert code == 2, output  # argparse's code for a usage error
    assert output.count(message) == 1, output
    assert not (tmp_path / "run").exists(), "a run that fails its checks must write nothing"


# Under torchrun every rank parses the flags; the point is that two ranks print one message.
TORCHRUN_CASES = [("ddp/train_mnist.py", ["--batch-size", "0"], "--batch-size: must be a positive integer, got 0")]


@pytest.mark.parametrize(
    ("script", "args", "message"), TORCHRUN_CASES, ids=[f"{s} {' '.join(a)}" for s, a, _ in TORCHRUN_CASES]
)
def test_bad_flag_is_reported_once_under_torchrun(script: str, args: list[str], message: str, tmp_path: Path) -> None:
    run = run_script(script, args, tmp_path / "run", nproc=2, timeout=60, real_launcher=True)
    assert run.returncode != 0, run.describe()
    assert run.output.count(message) == 1, run.describe()
    assert not (tmp_path / "run").exists(), "a run that fails its checks must write nothing"


def test_fresh_start_in_a_run_dir_with_checkpoints_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-5.pt").write_bytes(b"an earlier run's checkpoint")
    (run_dir / "metrics.jsonl").write_text('{"event": "train", "step": 5}\n')
    code, output = run_in_process("ddp/train_transformer.py", [], run_dir, capsys)
    assert code == 2, output
    assert output.count("already holds checkpoints of an earlier run (newest: step-5.pt); pass --resume") == 1
    assert (run_dir / "checkpoints" / "step-5.pt").read_bytes() == b"an earlier run's checkpoint"
    assert (run_dir / "metrics.jsonl").read_text() == '{"event": "train", "step": 5}\n'
    assert sorted(path.name for path in run_dir.rglob("*")) == ["checkpoints", "metrics.jsonl", "step-5.pt"]


def test_global_batch_must_divide_over_the_ranks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # What torchrun --nproc_per_node=2 tells rank 0; the check runs before any process group exists.
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    code, output = run_in_process("ddp/train_mnist.py", ["--global-batch-size", "25"], tmp_path / "run", capsys)
    assert code == 2, output
    assert output.count("--global-batch-size 25 does not divide into 2 rank(s) x 1 micro-step(s)") == 1, output


SCRIPTS = sorted(
    path.relative_to(REPO).as_posix() for path in [*REPO.glob("ddp/train_*.py"), *REPO.glob("fsdp/train_*.py")]
)


@pytest.mark.parametrize("script", SCRIPTS)
def test_tensorboard_without_its_package_is_refused_before_any_work(
    script: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # None in sys.modules: what an interpreter without the package finds (find_spec None, import fails).
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    code, output = run_in_process(script, ["--tensorboard", "--max-steps", "1"], tmp_path / "run", capsys)
    assert code == 2, output
    message = "--tensorboard needs the tensorboard package, which is not installed: pip install tensorboard"
    assert output.count(message) == 1 and output.count("error") == 1, output
    assert not (tmp_path / "run").exists(), "a run that fails its checks must write nothing"


@pytest.mark.parametrize("script", [name for name in SCRIPTS if "transformer" in name and name.startswith("fsdp/")])
def test_async_checkpoint_with_full_checkpoints_is_refused(
    script: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--async-checkpoint writes sharded checkpoints in the background; a full one is rank 0's file: one message."""
    flags = ["--async-checkpoint", "--checkpoint-format", "full", "--max-steps", "1"]
    code, output = run_in_process(script, flags, tmp_path / "run", capsys)
    assert code == 2, output
    message = "--async-checkpoint writes sharded checkpoints, each rank its own shards, in the background; "
    assert output.count(message) == 1 and output.count("error") == 1, output
    assert not (tmp_path / "run").exists(), "a run that fails its checks must write nothing"


TP_SCRIPT = "fsdp/train_transformer_fsdp2_tp.py"


@pytest.mark.parametrize(
    ("world_size", "flags", "message"),
    [
        ("3", ["--tp-degree", "2"], "--tp-degree 2 does not divide the world size 3: each tensor-parallel group"),
        ("4", ["--tp-degree", "4", "--n-head", "2", "--d-model", "64"], "--tp-degree 4 must divide the attention"),
        ("4", ["--global-batch-size", "5"], "--global-batch-size 5 does not divide into 2 data-parallel group(s) x 1"),
        ("12", ["--tp-degree", "2"], "the 6 data-parallel groups must divide the width (--d-model 64)"),
        # Sequence-parallel: an uneven slice gave each rank a DTensor of another global length.
        ("2", ["--block-size", "33"], "--tp-degree 2 must divide the block size (33): between the Blocks each rank"),
        # Each ran, unrefused, before: full checkpoints and --init-from loaded scrambled q|k|v weights (issue 57's
        # hostile pass), and --replicate-degree at --tp-degree 1 trained plain FSDP2 instead of the HSDP asked for.
        ("4", ["--checkpoint-format", "full"], "--checkpoint-format full with --tp-degree above 1"),
        ("4", ["--init-from", __file__], "--init-from with --tp-degree above 1: loading whole weights"),
        ("2", ["--tp-degree", "1", "--replicate-degree", "2"], "--replicate-degree: this script shards over every"),
    ],
    ids=[
        "world-3",
        "heads-2",
        "batch-5",
        "width-64-over-6",
        "block-33",
        "full-format",
        "init-from",
        "replicate-at-tp-1",
    ],
)
def test_a_mesh_the_world_size_or_the_model_cannot_make_is_refused(
    world_size: str,
    flags: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What rank 0 of torchrun --nproc_per_node=WORLD sees: one message before any process group exists."""
    for name, value in {"RANK": "0", "WORLD_SIZE": world_size, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)

    def got_past_the_checks(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run went on to rendezvous with a mesh it cannot make")

    monkeypatch.setattr("common.distributed.generation_store", got_past_the_checks)
    code, output = run_in_process(TP_SCRIPT, flags, tmp_path / "run", capsys)
    assert code == 2, output
    assert output.count(message) == 1, output


@pytest.mark.parametrize(
    ("world_size", "flags"),
    [
        ("2", ["--replicate-degree", "2"]),
        # One replica per machine is the default: 4 machines of one process each (LOCAL_WORLD_SIZE 1).
        ("4", []),
    ],
    ids=["replicate-degree-2-at-2", "one-process-per-node"],
)
def test_hybrid_shard_with_one_process_per_shard_group_is_refused(
    world_size: str,
    flags: list[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """FSDP1 falls back to no_shard inside a shard group of one rank and never averages the replicas' gradients
    (torch 2.14.1): each rank trains on its own data alone, silently. Refused before anything starts."""
    launched = {"RANK": "0", "WORLD_SIZE": world_size, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for name, value in {**launched, "LOCAL_WORLD_SIZE": "1" if not flags else world_size}.items():
        monkeypatch.setenv(name, value)

    def got_past_the_checks(*args: object, **kwargs: object) -> None:
        raise AssertionError("the run went on to rendezvous: hybrid_shard with one-rank shard groups was accepted")

    # Without this a missed refusal waits forever for ranks that do not exist.
    monkeypatch.setattr("common.distributed.generation_store", got_past_the_checks)
    args = ["--sharding-strategy", "hybrid_shard", *flags]
    code, output = run_in_process(FSDP1, args, tmp_path / "run", capsys)
    assert code == 2, output
    assert output.count("leaves one process in each shard group, where FSDP1 never averages the gradients") == 1


@pytest.mark.parametrize("nproc", [None, 2], ids=["python", "torchrun-2"])
def test_missing_mnist_names_the_way_out(nproc: int | None, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    run = run_script("ddp/train_mnist.py", ["--data-dir", str(empty)], tmp_path / "run", nproc=nproc, timeout=90)
    assert run.returncode != 0, run.describe()
    lines = [line for line in run.output.splitlines() if "MNIST is not in --data-dir" in line]
    assert len(lines) == 1, run.describe()
    assert "--synthetic" in lines[0]
    assert "Traceback" not in run.output, run.describe()  # from no rank
    # The failed download leaves no empty MNIST/raw behind, which would look like a data set.
    assert list(empty.iterdir()) == [], run.describe()


def test_empty_text_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "empty.txt"
    text.write_text("")
    code, output = run_in_process("ddp/train_transformer.py", ["--text-file", str(text)], tmp_path / "run", capsys)
    assert code == 2, output
    assert f"--text-file {text} has 0 characters" in output, output


COMMAND_CASES = [
    # (command, arguments, text the single message must contain)
    (
        "runs.compare_runs",
        ["common", "ddp", "--noise", "fsdp", "--loss-rtol", "1e-5"],
        "give --noise or tolerances, not",
    ),
    # A model past any that is trained: its DDP buckets, listed, took 700 MB at 1e13 (issue 37, 14).
    (
        "estimates.estimate_communication",
        ["--params", "1e13", "--world-size", "8"],
        "--params: must be from 1 to 1e+12",
    ),
    (
        "estimates.estimate_communication",
        ["--params", "1e30", "--world-size", "8"],
        "--params: must be from 1 to 1e+12",
    ),
    (
        "estimates.estimate_communication",
        ["--params", "7e9", "--world-size", "8", "--layers", "10000", "--grad-accum-steps", "11"],
        "--layers 10000 x --grad-accum-steps 11 is more than 100,000 units' collectives to list",
    ),
    # --layers cut --params into units; beside --model it was silently ignored (issue 42's hostile pass).
    (
        "estimates.estimate_communication",
        ["--model", "tiny", "--world-size", "8", "--layers", "7"],
        "units are its Blocks",
    ),
    (
        "estimates.estimate_memory",
        ["--model", "tiny", "--world-size", "8", "--gpu-memory", "8", "--layers", "7"],
        "its Blocks",
    ),
    # --wait becomes each rank's --dist-timeout: refused by its own name, in that flag's range (issue 37, 13).
    ("checks.preflight", ["--nproc", "2", "--wait", "1e6", "ddp/train_mnist.py"], "--wait: must be from 10 to 604800"),
    ("runs.sample", ["common", "--prompt", "1", "--temperature", "1e-40"], "--temperature: must be from 0.01 to 100"),
    # The rows above the last reach its one micro-batch in micro-steps of --batch-size: a whole number of them.
    ("benchmarks.benchmark", ["--speedups", "--batch-size", "3", "--larger-batch-size", "8"], "a multiple of --batch"),
    ("benchmarks.benchmark", ["--larger-batch-size", "8"], "--larger-batch-size is the last row of --speedups"),
    # A flag of one benchmark given to another was ignored, and the figures said nothing of it.
    ("benchmarks.benchmark", ["--checkpoint-every", "5"], "give --checkpoint too"),
    ("benchmarks.benchmark", ["--checkpoint", "--warmup", "5"], "--warmup does not apply"),
    ("benchmarks.benchmark", ["--checkpoint", "--speedups"], "are benchmarks of their own"),
    ("benchmarks.benchmark", ["--checkpoint", "--steps", "5"], "no checkpoint to time"),
]


@pytest.mark.parametrize(
    ("command", "args", "message"), COMMAND_CASES, ids=[f"{c} {' '.join(a)}" for c, a, _ in COMMAND_CASES]
)
def test_bad_number_for_a_command_is_refused(
    command: str, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    main = importlib.import_module(f"tools.{command}").main
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    output = capsys.readouterr()
    assert exit_info.value.code == 2, output
    assert (output.out + output.err).count(message) == 1, output
    assert "Traceback" not in output.err


@pytest.mark.parametrize("where", ["a file", "below a file"])
def test_a_run_dir_that_cannot_be_a_folder_is_refused_first(
    where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before any model is built: one message, and the file as it was."""
    taken = tmp_path / "notes.txt"
    taken.write_text("the user's notes\n")
    run_dir = taken if where == "a file" else taken / "run"
    main = runpy.run_path(str(REPO / "ddp/train_transformer.py"))["main"]
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cpu", "--run-dir", str(run_dir)])
    output = capsys.readouterr()
    assert exit_info.value.code == 2, output
    assert (output.out + output.err).count(f"{taken} is a file, not a folder") == 1, output
    assert taken.read_text() == "the user's notes\n"


@pytest.mark.parametrize("output", ["checkpoints/step-5.pt", "checkpoints/step-10.pt", "checkpoints/model.pt"])
def test_export_never_writes_over_a_checkpoint(output: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Onto itself, onto another checkpoint, or among them: refused before anything is read or written."""
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    for step in (5, 10):
        (checkpoints / f"step-{step}.pt").write_bytes(f"training checkpoint {step}".encode())
    export = importlib.import_module("tools.runs.export_checkpoint").main
    with pytest.raises(SystemExit) as exit_info:
        export([str(checkpoints / "step-5.pt"), str(tmp_path / "run" / output)])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2, error
    assert error.count("that is where a run keeps its checkpoints") == 1, error
    assert sorted(path.name for path in checkpoints.iterdir()) == ["step-10.pt", "step-5.pt"]
    assert [(checkpoints / f"step-{step}.pt").read_bytes() for step in (5, 10)] == [
        b"training checkpoint 5",
        b"training checkpoint 10",
    ]


@pytest.mark.parametrize(
    ("variables", "shown"),
    [
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2"),
        ({"RANK": "1"}, "RANK=1"),
        ({"RANK": "0", "WORLD_SIZE": "4"}, "RANK=0 WORLD_SIZE=4"),
    ],
)
def test_a_world_size_without_torchrun_is_refused(
    variables: dict[str, str],
    shown: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Not half the data under a claim of two processes: one message, from the only process there is."""
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    code, output = run_in_process("ddp/train_transformer.py", [], tmp_path / "run", capsys)
    assert code == 2, output
    assert output.count(f"{shown} is set, but not MASTER_ADDR: start the processes with torchrun") == 1, output
    assert not (tmp_path / "run").exists()


def test_a_world_of_one_written_out_still_runs_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """RANK=0 WORLD_SIZE=1 (as some schedulers export) is one process, as without them."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    check_launch_environment(Parser(prog="train.py"))  # returns; a refusal would exit


@pytest.mark.parametrize("damage", ["truncated images", "a wrong header"])
def test_damaged_mnist_is_named_as_damaged(damage: str, tmp_path: Path) -> None:
    """Files that are there but cannot be read: one message that says so, not 'not in --data-dir'
    and not a bare AssertionError; the files as they were."""
    data = write_fake_mnist(tmp_path / "data", train_count=64, test_count=16)
    images = data / "MNIST" / "raw" / "train-images-idx3-ubyte"
    content = images.read_bytes()
    images.write_bytes(content[: len(content) // 2] if damage == "truncated images" else b"\0\0\0\0" + content[4:])
    damaged = images.read_bytes()
    run = run_script("ddp/train_mnist.py", ["--data-dir", str(data)], tmp_path / "run", timeout=90)
    assert run.returncode == 2, run.describe()
    lines = [line for line in run.output.splitlines() if "but its files cannot be read" in line]
    assert len(lines) == 1 and "Traceback" not in run.output, run.describe()
    assert images.read_bytes() == damaged


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--global-batch-size", "abc"], "the script's --global-batch-size: must be a whole number, got abc"),
        (["--global-batch-size", "24", "--grad-accum-steps=x"], "the script's --grad-accum-steps: must be a whole"),
        (["--global-batch-size", "24", "--grad-accum-steps", "0"], "--grad-accum-steps: must be a positive integer"),
    ],
)
def test_check_equivalence_reads_the_counts_it_divides_by(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The script's flags that plan the runs (issue 37, 9): one message, exit 2, no run started."""
    runs = tmp_path / "runs"
    code = check_equivalence.main(["--nproc", "2", "--runs-dir", str(runs), "ddp/train_transformer.py", *flags])
    error = capsys.readouterr().err
    assert code == 2 and error.count("error:") == 1 and message in error, error
    assert not runs.exists()


def finished_run(run_dir: Path, decoding: dict[str, str]) -> Path:
    """What tools.runs.sample reads of a transformer run: model.pt, and a final record with its shape."""
    config = GPTConfig(vocab_size=50, block_size=8, n_layer=1, n_head=1, d_model=8)
    run_dir.mkdir()
    torch.save(GPT(config, seed=0).state_dict(), run_dir / "model.pt")
    record = {"event": "final", "model_config": config.shape(), "decoding": decoding}
    (run_dir / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    return run_dir


@pytest.mark.parametrize("decoding", [{}, {"tokenizer": "my-bpe"}], ids=["synthetic", "own-tokenizer"])
def test_sample_prints_ids_apart(decoding: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The prompt's ids and the new ones, a space between each (issue 37, 5: "3 14 1511 6"); a token file
    of the user's own tokenizer takes its prompt as ids too (issue 37, 6: every prompt was refused)."""
    run_dir = finished_run(tmp_path / "run", decoding)
    assert sample.main([str(run_dir), "--prompt", "3 14 15", "--tokens", "5"]) == 0
    ids = capsys.readouterr().out.split()
    assert ids[:3] == ["3", "14", "15"] and len(ids) == 8, ids
    assert all(0 <= int(token) < 50 for token in ids), ids


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", "3 14 50"], "--prompt: ids [50] are outside the model's vocabulary of 50 (0 to 49)"),
        (["--prompt", "3 x"], "--prompt: 'x' is not a token id"),
        (["--prompt", "3", "--device", "cuda"], "--device cuda: CUDA is not available on this machine"),
    ],
)
def test_sample_refuses_what_the_model_cannot_take(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the model is loaded (issue 37, 10): one message, not an IndexError or a CUDA error."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine's answer may be either
    run_dir = finished_run(tmp_path / "run", {})
    with pytest.raises(SystemExit) as stopped:
        sample.main([str(run_dir), *args])
    error = capsys.readouterr().err
    assert stopped.value.code == 2 and error.count("error:") == 1 and message in error, error


def test_compare_strategies_reads_the_flags_after_the_dashes_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Read by the scripts' own parsers before any run: one line, not torchrun's failure after the first runs."""
    argv = ["--device", "cpu", "--strategies", "ddp", "fsdp2", "--out-dir", str(tmp_path / "out"), "--", "--lr", "nan"]
    with pytest.raises(SystemExit) as stopped:
        compare_strategies.parse_args(argv)
    error = capsys.readouterr().err
    assert stopped.value.code == 2 and error.count("error:") == 1, error
    assert "the flags for ddp/train_transformer.py: argument --lr: must be a finite number, got nan" in error
    assert not (tmp_path / "out").exists()
