"""Both ends of the supported torch range, and the parts that need more than the floor.

The floor is torch 2.6 (TORCH_FLOOR, as common/distributed.py's docstring says). A part that needs a later
release stops there before anything starts: exit code 2, one line that names
the release, nothing written. On a torch that has the release, the same
command runs. CI runs this file on the floor and on the newest torch pip
resolves; where a test branches on the version, each branch asserts.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

import common.distributed
from common.distributed import FSDP2_CPU_OFFLOAD, FSDP2_ON_CPU, torch_at_least, torch_release
from tests.harness.cases import FSDP2_SCRIPT
from tests.harness.runs import REPO, Run, run_script
from tests.harness.wrappers import TEARDOWN_ROUNDS

pytestmark = pytest.mark.floor

# The oldest torch the scripts run on: the first release with the public FSDP2 API (fully_shard).
TORCH_FLOOR = (2, 6)

# Four steps of the tiny model at block size 32: enough for every collective to run.
SHORT_ARGS = [
    *("--max-steps", "4", "--block-size", "32", "--train-sequences", "200", "--heldout-sequences", "20"),
    *("--global-batch-size", "8", "--log-interval", "2", "--eval-interval", "4"),
]


def assert_stopped_for_torch(run: Run, part: str, release: tuple[int, int]) -> None:
    """The one line a part prints on a torch older than ``release``, exit code 2, and no run directory."""
    expected = f"error: {part} needs torch {release[0]}.{release[1]} or newer; this is torch {torch.__version__}"
    assert run.returncode == 2, run.describe()
    assert run.output.splitlines() == [expected], run.describe()
    assert not run.run_dir.exists(), "a run refused for its torch must write nothing"


def test_fsdp2_runs_on_the_cpu_from_torch_2_9(tmp_path: Path) -> None:
    run = run_script(FSDP2_SCRIPT, SHORT_ARGS, tmp_path / "run")
    if torch_at_least(FSDP2_ON_CPU):
        final = run.check().final()
        assert (final["strategy"], final["steps"]) == ("fsdp2", 4), run.describe()
        assert math.isfinite(final["eval_loss"]), run.describe()
    else:
        assert_stopped_for_torch(run, "FSDP2 on the CPU", FSDP2_ON_CPU)


def test_fsdp2_cpu_offload_from_torch_2_9(tmp_path: Path) -> None:
    args = [*SHORT_ARGS, "--cpu-offload"]
    if not torch_at_least(FSDP2_CPU_OFFLOAD):
        assert_stopped_for_torch(
            run_script(FSDP2_SCRIPT, args, tmp_path / "run"), "--cpu-offload with FSDP2", FSDP2_CPU_OFFLOAD
        )
    elif torch.cuda.is_available():
        # run_script passes --device cpu first; the later --device cuda wins.
        run = run_script(FSDP2_SCRIPT, [*args, "--device", "cuda"], tmp_path / "run").check()
        assert math.isfinite(run.final()["eval_loss"]), run.describe()
    else:
        # A new enough torch lets the flag through to the next check: offload is a GPU feature.
        run = run_script(FSDP2_SCRIPT, args, tmp_path / "run")
        assert run.returncode == 2, run.describe()
        assert run.output.count("--cpu-offload frees GPU memory by moving state to the host; this run has no GPU") == 1
        assert "needs torch" not in run.output, run.describe()
        assert not run.run_dir.exists()


def test_process_groups_end_without_deadlock(tmp_path: Path) -> None:
    """common.distributed.gloo_destroyed_without_gil: 200 gloo process groups at 3 ranks, each started, used and
    torn down. Without the workaround torch 2.6 deadlocked within these rounds on every try; the helper's own
    watchdog turns a deadlock into a failure with every stack.
    """
    run = run_script(TEARDOWN_ROUNDS, ["--rounds", "200", "--watchdog", "100"], tmp_path, nproc=3, timeout=150)
    assert run.check().output.count("200 rounds at 3 ranks") == 1, run.describe()


def test_torch_release_reads_every_kind_of_version() -> None:
    assert torch_release("2.6.0+cu124") == (2, 6)
    assert torch_release("2.14.1") == (2, 14)
    assert torch_release("2.10.0a0+git1234abc") == (2, 10)
    assert torch_release("2.9.0.dev20250801+cpu") == (2, 9)
    with pytest.raises(ValueError, match="not a torch version"):
        torch_release("nightly")


def test_the_floor_is_the_same_everywhere() -> None:
    """requirements.txt, the floor pass's environment and common/distributed.py name one floor."""
    assert f"torch {TORCH_FLOOR[0]}.{TORCH_FLOOR[1]} (the floor" in (common.distributed.__doc__ or "")
    requirement = next(
        line for line in (REPO / "requirements.txt").read_text().splitlines() if line.startswith("torch")
    )
    assert torch_release(requirement.split(">=")[1]) == TORCH_FLOOR, requirement
    floor_venv = (REPO / ".ci" / "floor-venv").read_text()
    version = re.search(r"^TORCH_VERSION=(\S+)$", floor_venv, re.MULTILINE)
    assert version is not None and torch_release(version.group(1)) == TORCH_FLOOR
