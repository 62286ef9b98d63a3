"""A checkpoint from someone else must not run their code when it is exported or resumed from.

DCP keeps a sharded checkpoint's metadata as a pickle. These tests take a real
FSDP2 checkpoint, give it a ``.metadata`` (or a non-tensor entry) that creates a
file when unpickled, and check that export and --resume-from refuse it with one
message and exit code 2 before the file exists, that --trust-checkpoint lets the
export read it, and that a plain DCP checkpoint needs no flag wherever it lies.
"""

from __future__ import annotations

import dataclasses
import io
import operator
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from filelock import FileLock

from common.safe_io import UntrustedCheckpoint, read_dcp_metadata, root_failure, sharded_reader
from tests.harness.cases import NEEDS_FSDP2_ON_CPU
from tests.harness.model_files import assert_same_parameters
from tests.harness.runs import run_script
from tools.runs import export_checkpoint

FSDP2 = "fsdp/train_transformer_fsdp2.py"
# Every case starts from an FSDP2 checkpoint.
pytestmark = NEEDS_FSDP2_ON_CPU
# Its checkpoint at step 4 is the last step, so it holds the same model as its model.pt.
RUN_ARGS = [
    *("--max-steps", "4", "--checkpoint-interval", "4", "--block-size", "32", "--train-sequences", "320"),
    *("--heldout-sequences", "40", "--log-interval", "2", "--eval-interval", "4"),
]


@pytest.fixture(scope="session")
def source_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 2-process FSDP2 run, made once per session (under ``pytest -n`` too); tests tamper with copies only."""
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's base is a child of the session's; without it the parent outlives the session.
    root = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "trust-source-run"
    with FileLock(f"{root}.lock"):
        if not (root / "model.pt").exists():
            run_script(FSDP2, RUN_ARGS, root, nproc=2).check()
    return root


class _Touch:
    """Unpickled, it creates ``path``: the harmless stand-in for what a crafted pickle could run."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


class _TouchThen:
    """Unpickled, it creates ``path`` and then becomes ``value``, so a loader that runs it carries on."""

    def __init__(self, path: Path, value: Any) -> None:
        self.path, self.value = path, value

    def __reduce__(self) -> tuple[Any, ...]:
        return (operator.getitem, ((_Touch(self.path), self.value), 1))


def foreign_copy(source_run: Path, tmp_path: Path) -> Path:
    """The source run's checkpoint, as a download or a colleague would hand it over."""
    checkpoint = tmp_path / "download" / "checkpoints" / "step-4"
    shutil.copytree(source_run / "checkpoints" / "step-4", checkpoint)
    return checkpoint


def craft_metadata(checkpoint: Path, marker: Path) -> None:
    """Replace ``.metadata`` with one that creates ``marker`` when unpickled, then is the real metadata."""
    real = read_dcp_metadata(checkpoint)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_TouchThen(marker, real)))


def export(args: list[Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``python -m tools.runs.export_checkpoint ARGS``, in this process: exit code and everything printed."""
    try:
        code = export_checkpoint.main([str(arg) for arg in args])
    except SystemExit as exit_info:  # argparse's own refusals
        code = exit_info.code  # type: ignore[assignment]
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def assert_one_message(text: str, *fragments: str) -> None:
    assert text.count("error:") == 1, text
    assert "Traceback" not in text, text
    for fragment in fragments:
        assert fragment in text, text


def test_export_refuses_metadata_that_would_run_code_unless_trusted(
    source_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint, marker, output = foreign_copy(source_run, tmp_path), tmp_path / "PWNED", tmp_path / "model.pt"
    craft_metadata(checkpoint, marker)

    code, text = export([checkpoint, output], capsys)
    assert code == 2, text
    assert_one_message(text, f"checkpoint {checkpoint} was refused: its .metadata refers to ", "is a pickle")
    assert "--trust-checkpoint" in text, text
    assert not marker.exists(), "the crafted metadata was unpickled"
    assert not output.exists()

    code, text = export([checkpoint, output, "--trust-checkpoint"], capsys)
    assert code == 0, text
    assert marker.exists(), "trusted, the metadata is unpickled as it is, code and all"
    assert_same_parameters(output, source_run / "model.pt")


def test_plain_dcp_checkpoint_exports_without_the_flag_wherever_it_lies(
    source_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "model.pt"
    code, text = export([foreign_copy(source_run, tmp_path), output], capsys)
    assert code == 0, text
    assert_same_parameters(output, source_run / "model.pt")


def test_resume_from_crafted_checkpoint_is_refused_before_its_metadata_is_unpickled(
    source_run: Path, tmp_path: Path
) -> None:
    checkpoint, marker = foreign_copy(source_run, tmp_path), tmp_path / "PWNED"
    craft_metadata(checkpoint, marker)
    run_dir = tmp_path / "run"
    # One process: the message and exit code are the script's own, not torchrun's summary.
    run = run_script(FSDP2, [*RUN_ARGS, "--resume-from", str(checkpoint)], run_dir, timeout=120)
    assert run.returncode == 2, run.describe()
    assert run.output.count(f"checkpoint {checkpoint} was refused: its .metadata refers to ") == 1, run.describe()
    assert "Traceback" not in run.output, run.describe()
    assert not marker.exists(), "the crafted metadata was unpickled"
    assert not run_dir.exists(), "a refused resume must write nothing"


def plant(checkpoint: Path, fqn: str, value: Any) -> None:
    """Make the non-tensor entry ``fqn`` hold ``value``, as DCP would have saved it (torch.save)."""
    metadata = read_dcp_metadata(checkpoint)
    index, where = next((index, where) for index, where in metadata.storage_data.items() if index.fqn == fqn)
    payload = io.BytesIO()
    torch.save(value, payload)
    shard = checkpoint / where.relative_path
    offset = shard.stat().st_size
    with shard.open("ab") as file:
        file.write(payload.getvalue())
    metadata.storage_data[index] = dataclasses.replace(where, offset=offset, length=len(payload.getvalue()))
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))


def load_learning_rate(checkpoint: Path) -> Any:
    """What resuming does with one entry: dcp.load through the reader and planner the Checkpointer uses."""
    state: dict[str, Any] = {"optimizer": {"param_groups": [{"lr": None}]}}
    reader, planner = sharded_reader(checkpoint, trust=False)
    dcp.load(state, storage_reader=reader, planner=planner)
    return state["optimizer"]["param_groups"][0]["lr"]


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to load in a single process")
def test_non_tensor_entry_that_would_run_code_is_refused(source_run: Path, tmp_path: Path) -> None:
    """DCP reads entries such as the learning rate with torch.load(weights_only=False): a second way in."""
    checkpoint, marker = foreign_copy(source_run, tmp_path), tmp_path / "PWNED"
    assert isinstance(load_learning_rate(checkpoint), float)

    plant(checkpoint, "optimizer.param_groups.0.lr", _TouchThen(marker, 0.5))
    with pytest.raises(dcp.CheckpointException) as refused:
        load_learning_rate(checkpoint)
    assert isinstance(root_failure(refused.value), UntrustedCheckpoint), refused.value
    assert "optimizer.param_groups.0.lr refers to more than plain data" in str(root_failure(refused.value))
    assert not marker.exists(), "the crafted entry was unpickled"


def write_metadata(checkpoint: Path, transform: Any) -> None:
    (checkpoint / ".metadata").write_bytes(pickle.dumps(transform(read_dcp_metadata(checkpoint))))


def outside_the_folder(metadata: Any) -> Any:
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], relative_path="../x.distcp")
    return metadata


# (id, how to break the foreign copy, what the one message must say)
BROKEN = [
    ("metadata-not-dcp", lambda c: write_metadata(c, lambda m: {"state_dict_metadata": {}}), "holds a dict, not DCP"),
    ("shard-outside", lambda c: write_metadata(c, outside_the_folder), "points at '../x.distcp', not at a file in"),
    ("metadata-truncated", lambda c: (c / ".metadata").write_bytes((c / ".metadata").read_bytes()[:100]), "truncated"),
    ("metadata-missing", lambda c: (c / ".metadata").unlink(), "cannot read"),
    ("shard-missing", lambda c: next(c.glob("*.distcp")).unlink(), "cannot read"),
]


@pytest.mark.parametrize(("breakage", "message"), [case[1:] for case in BROKEN], ids=[case[0] for case in BROKEN])
def test_export_refuses_broken_sharded_checkpoint_with_one_message(
    breakage: Any, message: str, source_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint, output = foreign_copy(source_run, tmp_path), tmp_path / "model.pt"
    breakage(checkpoint)
    code, text = export([checkpoint, output], capsys)
    assert code == 2, text
    assert_one_message(text, message)
    assert not output.exists()


def test_export_refuses_other_input_with_one_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker, output = tmp_path / "PWNED", tmp_path / "model.pt"
    crafted, tensor = tmp_path / "crafted" / "step-1.pt", tmp_path / "tensor" / "step-2.pt"
    for path, value in [(crafted, {"model": _Touch(marker)}), (tensor, torch.zeros(3))]:
        path.parent.mkdir()
        torch.save(value, path)
    cases = [
        ([crafted, output], "more than tensors and plain data"),  # a full checkpoint runs no code either
        ([tensor, output], "it holds no model state dict"),
        ([tmp_path / "nowhere" / "step-3", output], "step-3: no such file or folder"),
        ([tensor, tmp_path], "is a folder"),
    ]
    for args, message in cases:
        code, text = export(args, capsys)
        assert code == 2, text
        assert_one_message(text, message)
    assert not marker.exists(), "the crafted full checkpoint was unpickled"
    assert not output.exists()
