"""Mistakes a user makes get one clear message and a non-zero exit, not a traceback per rank."""

from __future__ import annotations

import importlib
import os
import runpy
from pathlib import Path

import pytest

from common.cli import Parser, check_launch_environment
from tests.harness.mnist_fixture import write_fake_mnist
from tests.harness.runs import REPO, clean_env, run_script

FSDP1, FSDP2 = "fsdp/train_transformer.py", "fsdp/train_transformer_fsdp2.py"
CASES = [
    # (script, arguments, text the single message must contain)
    ("ddp/train_mnist.py", ["--batch-size", "0"], "--batch-size: must be a positive integer, got 0"),
    ("ddp/train_mnist.py", ["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    ("ddp/train_mnist.py", ["--lr", "-1"], "--lr: must be a positive number, got -1"),
    ("ddp/train_transformer.py", ["--d-model", "66", "--n-head", "4"], "--d-model 66 must be divisible by --n-head 4"),
    ("ddp/train_transformer.py", ["--text-file", "does/not/exist.txt"], "--text-file does/not/exist.txt: no such file"),
    ("ddp/train_mnist.py", ["--global-batch-size", "10", "--batch-size", "5"], "not both"),
    ("ddp/train_transformer.py", ["--deterministic", "--dropout", "0.1"], "--deterministic needs --dropout 0"),
    (FSDP1, ["--sharding-strategy", "hybrid_shard", "--replicate-degree", "2"], "not divide the world size 1"),
    (FSDP1, ["--replicate-degree", "2"], "--replicate-degree only applies to --sharding-strategy hybrid_shard"),
    (FSDP1, ["--sharding-strategy", "hybrid_shard"], "hybrid_shard on one machine: give --replicate-degree R"),
    (FSDP1, ["--cpu-offload"], "--cpu-offload frees GPU memory by moving state to the host; this run has no GPU"),
    (FSDP2, ["--mixed-precision", "fp16"], "argument --mixed-precision: invalid choice: 'fp16'"),
    ("ddp/train_transformer.py", ["--max-steps", "-1"], "--max-steps: must be zero or a positive integer, got -1"),
    ("ddp/train_transformer.py", ["--dropout", "1.5"], "--dropout: must be in [0, 1), got 1.5"),
    ("fsdp/train_mnist.py", ["--keep-checkpoints", "0"], "--keep-checkpoints: must be a positive integer, got 0"),
    (FSDP2, ["--profile", "-2"], "--profile: must be zero or a positive integer, got -2"),
    ("ddp/train_mnist.py", ["--resume", "--resume-from", "x"], "give --resume (the newest checkpoint) or"),
    (FSDP2, ["--resume-from", "runs/none/checkpoints/step-9"], "--resume-from runs/none/checkpoints/step-9: no such"),
    ("ddp/train_mnist.py", ["--resume-from", "common"], "--resume-from common: not a checkpoint"),
    ("fsdp/train_mnist.py", ["--init-from", "runs/none/model.pt"], "--init-from runs/none/model.pt: no such file"),
    ("ddp/train_transformer.py", ["--text-file", "README.md", "--variable-length"], "--variable-length cuts the"),
    ("ddp/train_transformer.py", ["--token-file", "runs/none.tokens"], "--token-file runs/none.tokens: no such file"),
    ("fsdp/train_transformer.py", ["--token-file", "README.md"], "no readable README.md.json beside it"),
    (FSDP2, ["--text-file", "README.md", "--token-file", "README.md"], "give --text-file or --token-file, not both"),
    ("ddp/train_transformer.py", ["--init-from", "README.md", "--resume-from", "x"], "give --resume-from (continue"),
    # Numbers that are not numbers a run can use: inf, nan, what overflows to inf, a seed past 32 bits.
    ("ddp/train_transformer.py", ["--lr", "inf"], "--lr: must be a finite number, got inf"),
    ("ddp/train_mnist.py", ["--lr", "1e400"], "--lr: must be a finite number, got 1e400"),
    ("ddp/train_transformer.py", ["--lr", "1e38"], "--lr: must be at most 3.4e+37: the optimizer's float32"),
    ("ddp/train_transformer.py", ["--weight-decay", "nan"], "--weight-decay: must be a finite number, got nan"),
    ("ddp/train_transformer.py", ["--dist-timeout", "inf"], "--dist-timeout: must be a finite number, got inf"),
    ("ddp/train_transformer.py", ["--dist-timeout", "0.001"], "--dist-timeout: must be from 10 to 604800 seconds"),
    ("fsdp/train_mnist.py", ["--dist-timeout", "1e13"], "--dist-timeout: must be from 10 to 604800 seconds"),
    ("ddp/train_transformer.py", ["--seed", "99999999999999999999999"], "--seed: must be an integer from 0 to"),
    ("ddp/train_mnist.py", ["--seed", "-1"], "--seed: must be an integer from 0 to 4294967295, got -1"),
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
TORCHRUN_CASES = [CASES[0]]


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
    ("estimate_memory", ["--params", "nan", "--world-size", "8", "--gpu-memory", "80"], "--params: must be a finite"),
    ("estimate_memory", ["--params", "1e400", "--world-size", "8", "--gpu-memory", "80"], "got 1e400"),
    ("estimate_communication", ["--params", "7e9", "--world-size", "8", "--tflops", "inf"], "--tflops: must be a"),
    ("compare_runs", ["a", "b", "--loss-rtol", "nan"], "--loss-rtol: must be a finite number, got nan"),
    ("compare_runs", ["a", "b", "--param-atol", "inf"], "--param-atol: must be a finite number, got inf"),
    ("compare_runs", ["a", "b", "--noise", "c", "--noise-factor", "0"], "--noise-factor: must be a positive number"),
    ("compare_runs", ["a", "b", "--noise", "c", "--loss-rtol", "1e-5"], "give --noise or tolerances, not both"),
]


@pytest.mark.parametrize(
    ("command", "args", "message"), COMMAND_CASES, ids=[f"{c} {' '.join(a)}" for c, a, _ in COMMAND_CASES]
)
def test_bad_number_for_a_command_is_refused(
    command: str, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    main = importlib.import_module(f"common.{command}").main
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
    export = importlib.import_module("common.export_checkpoint").main
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
