"""A throwaway Slurm cluster on this machine: one slurmctld and two slurmd, each slurmd a "node".

The tests start one for their session. Start one by hand to try the launchers without a cluster:

    python -m tests.harness.slurm_cluster      # prints the `export SLURM_CONF=...` line; Ctrl-C stops it

Everything it writes (configuration, state, spool, logs, pid files) stays in one temporary
folder, every port is picked free, and it stops only the processes it started, by their pids,
never by name: other clusters on the same machine are left alone. No munge: `auth/none`.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

PROGRAMS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo", "scancel")
INSTALL_COMMAND = "apt-get install slurmctld slurmd slurm-client"
NODES = ("node1", "node2")
# More CPUs than this machine has, so that two 2-CPU jobs can share a node; slurmd is told to
# believe the configuration (config_overrides) instead of draining the node for lack of cores.
CPUS_PER_NODE = 4
# How long Slurm holds a requeued job before it may start again. Slurm's default is 120 s
# (AuthInfo's cred_expire); a cluster for tests and trials would spend most of its time waiting.
REQUEUE_DELAY_S = 5
POLL_S = 0.2

CONFIG = """\
ClusterName=local
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={controller_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/none
CredType=cred/none
AuthInfo=cred_expire={requeue_delay}
FirstJobId={first_job_id}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=OFF
PartitionName=scavenger Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=60
PartitionName=scavenger-nograce Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=0
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""
NODE_LINE = "NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={cpus} State=UNKNOWN"


def missing_programs() -> list[str]:
    return [name for name in PROGRAMS if shutil.which(name, path=_path_with_sbin()) is None]


def _path_with_sbin() -> str:
    # The daemons live in /usr/sbin, which a user's PATH may lack.
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])


def _environments() -> list[tuple[int, dict[str, str]]]:
    """Every process this user may read: its pid and its environment."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            environ = process_environ(int(entry.name))
            if environ is not None:
                found.append((int(entry.name), environ))
    return found


def process_environ(pid: int) -> dict[str, str] | None:
    """The environment ``pid`` started with; None if it is gone or another user's."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class SlurmCluster:
    """Write the configuration, start the daemons, answer queries; ``stop`` ends all it started."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.daemons: list[subprocess.Popen] = []

    def client_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) without SLURM_* variables, plus SLURM_CONF."""
        source = os.environ if base is None else base
        env = {key: value for key, value in source.items() if not key.startswith("SLURM_")}
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), "/usr/sbin"])
        return env

    def write_config(self) -> None:
        for folder in ("state", "spool"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        nodes = "\n".join(NODE_LINE.format(name=name, port=free_port(), cpus=CPUS_PER_NODE) for name in NODES)
        self.conf.write_text(
            CONFIG.format(
                controller_port=free_port(),
                user=getpass.getuser(),
                requeue_delay=REQUEUE_DELAY_S,
                # Job ids, and so the launchers' rendezvous ports (10000 + id), differ between clusters
                # that run at the same time on one machine; and they stay below the ephemeral ports.
                first_job_id=random.randrange(1000, 20000),
                root=self.root,
                nodes=nodes,
            )
        )

    def start(self, timeout: float = 60) -> None:
        """Start slurmctld and one slurmd per node, and return once every node is idle."""
        self.write_config()
        env = self.client_env()
        # -D: in the foreground, so that each daemon is our child and its pid is the one to stop.
        commands = {"slurmctld": ["slurmctld", "-D", "-c", "-f", str(self.conf)]}
        commands.update({f"slurmd-{name}": ["slurmd", "-D", "-N", name, "-f", str(self.conf)] for name in NODES})
        for label, command in commands.items():
            log = open(self.root / f"{label}.stderr", "wb")  # noqa: SIM115 - handed to the daemon
            self.daemons.append(
                subprocess.Popen(
                    [shutil.which(command[0], path=_path_with_sbin()) or command[0], *command[1:]],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            log.close()
        try:
            self.wait_until(
                lambda: self._node_states() == dict.fromkeys(NODES, "idle"), timeout, "the nodes to be idle"
            )
        except TimeoutError:
            self.stop()
            raise

    def _node_states(self) -> dict[str, str]:
        """Each node's state; sinfo lists a node once per partition that has it."""
        for daemon in self.daemons:
            if daemon.poll() is not None:
                raise RuntimeError(f"{daemon.args[0]} exited with {daemon.returncode}; see {self.root}")
        result = self.command("sinfo", "--noheader", "--Node", "--format=%N %t", check=False)
        return dict(line.split() for line in result.stdout.splitlines()) if result.returncode == 0 else {}

    def command(self, *args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        return subprocess.run(
            list(args), env=self.client_env(), capture_output=True, text=True, check=check, timeout=timeout
        )

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict: JobState, ExitCode, Reason, Restarts, NodeList, ..."""
        line = self.command("scontrol", "--oneliner", "show", "job", str(job_id)).stdout.strip()
        fields = {}
        for item in line.split():
            key, _, value = item.partition("=")
            fields[key] = value
        return fields

    def wait_until(self, probe: Callable[[], object], timeout: float, what: str) -> object:
        deadline = time.monotonic() + timeout
        while True:
            result = probe()
            if result:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:.0f} s for {what}")
            time.sleep(POLL_S)

    def processes(self, **env: str) -> list[int]:
        """Pids of this cluster's processes (daemons, slurmstepd, jobs) whose environment has ``env``.

        slurmstepd and every job inherit SLURM_CONF from the daemons and from sbatch, and
        slurmstepd daemonizes, so the environment, not the process tree, tells them apart.
        """
        wanted = {"SLURM_CONF": str(self.conf), **env}
        return [
            pid
            for pid, environ in _environments()
            if pid != os.getpid() and all(environ.get(key) == value for key, value in wanted.items())
        ]

    def stop(self, timeout: float = 60) -> list[int]:
        """Cancel every job, stop the daemons, kill whatever of the cluster is left; its pids."""
        alive = all(daemon.poll() is None for daemon in self.daemons)
        if alive and self.command("squeue", "--noheader", "--format=%i", check=False).stdout.strip():
            self.command("scancel", "--user", getpass.getuser(), check=False)
            with contextlib.suppress(TimeoutError):
                self.wait_until(
                    lambda: not self.command("squeue", "--noheader", "--format=%i", check=False).stdout.strip(),
                    timeout,
                    "the cancelled jobs to end",
                )
        for daemon in self.daemons:
            if daemon.poll() is None:
                daemon.terminate()
        for daemon in self.daemons:
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        leftovers = self.processes()
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return leftovers

    def log_tail(self, lines: int = 30) -> str:
        """The end of every daemon's log, for a failure message."""
        parts = []
        for log in sorted(self.root.glob("slurm*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name} ---\n" + "\n".join(text))
        return "\n".join(parts)


def main() -> None:
    missing = missing_programs()
    if missing:
        sys.exit(f"Slurm is not installed (missing: {', '.join(missing)}); on Debian or Ubuntu: {INSTALL_COMMAND}")
    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="slurm-cluster-")))
    started = time.monotonic()
    cluster.start()
    print(f"Slurm is up in {time.monotonic() - started:.1f} s: {len(NODES)} nodes x {CPUS_PER_NODE} CPUs, no GPUs.")
    print("In another shell, from the repository root:\n")
    print(f"    export SLURM_CONF={cluster.conf}")
    print("    sinfo")
    print("    NPROC_PER_NODE=2 sbatch --gpus-per-node=0 --cpus-per-task=2 slurm/ddp.sbatch --synthetic")
    print("    squeue\n")
    print(f"Logs in {cluster.root}. Ctrl-C stops the cluster and its jobs.")
    # Set both explicitly: a shell that starts this in the background makes it ignore SIGINT.
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda *_: sys.exit(0))
    try:
        signal.pause()
    except SystemExit:
        pass
    finally:
        leftovers = cluster.stop()
        print(f"\nstopped{f'; killed {len(leftovers)} leftover processes' if leftovers else ''}")


if __name__ == "__main__":
    main()
