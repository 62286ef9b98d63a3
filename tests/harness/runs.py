"""Run a script the way a user does, and read what it wrote.

- ``run_script``: a training script under ``python`` or ``torchrun --standalone``, its ranks forked
  from the warm server (tests/harness/launcher.py) unless ``real_launcher`` asks for the real one;
- ``run_warm``: the same with a prepared command line, and a callback on each line of output;
- ``warm_output_of``: a benchmark's torchrun command, its ranks forked from the warm server;
- ``run_command``: any command in a subprocess of its own session, in the clean environment;
- ``run_until_stopped``: a run asked to stop (RUN_DIR/STOP) once it reports a given step.

Every run gets ``clean_env()`` and a hard timeout: at the timeout every process it started is killed
and the test fails showing everything they printed. A ``Run`` reads the run's records back from its
run directory's metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import launcher
from tools.processes import descendants, standalone_torchrun

REPO = Path(__file__).resolve().parents[2]

# Variables a launcher or scheduler may have left in the environment of the
# test run; a child that inherits them would try to join someone else's job.
INHERITED_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PMI_", "OMPI_")
INHERITED_NAMES = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
}


def clean_env() -> dict[str, str]:
    """This process's environment without what a launcher left in it, for a run of its own."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in INHERITED_NAMES and not key.startswith(INHERITED_PREFIXES)
    }
    # One thread per process: several ranks share this machine's few cores.
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    return env


@dataclass
class Run:
    """A finished run: how it was started, how it ended, what it printed, and where it wrote."""

    command: list[str]
    returncode: int
    output: str
    run_dir: Path
    warm: bool = False  # the ranks were forks of tests/harness/launcher.py's server, not new interpreters

    def describe(self) -> str:
        """The command, its exit code and its whole output: what a failing test shows."""
        how = " (ranks started by tests/harness/launcher.py, as torchrun would)" if self.warm else ""
        return f"$ {' '.join(self.command)}{how}\nexit code {self.returncode}\n--- output ---\n{self.output}"

    def check(self) -> Run:
        """The run itself, once it is known to have exited 0; else the test fails with ``describe()``."""
        assert self.returncode == 0, self.describe()
        return self

    def metrics(self) -> list[dict]:
        """Every record rank 0 wrote to RUN_DIR/metrics.jsonl, in order."""
        lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    def events(self, kind: str) -> list[dict]:
        """The records of one kind: ``train``, ``eval``, ``final``..."""
        return [record for record in self.metrics() if record["event"] == kind]

    def final(self) -> dict:
        """The one ``final`` record a finished run writes."""
        (record,) = self.events("final")
        return record


def script_invocation(script: str, args: list[str], run_dir: Path, wrapper: list[str]) -> list[str]:
    """What follows ``python`` or ``torchrun ...`` on the command line: the script and its flags."""
    return [*wrapper, script, "--device", "cpu", "--dist-timeout", "60", "--run-dir", str(run_dir), *args]


def launcher_prefix(nproc: int | None) -> list[str]:
    """What starts a script as a user would: ``python``, or ``torchrun`` with ``nproc`` processes."""
    if nproc is None:
        return [sys.executable]
    return standalone_torchrun(nproc)  # a rendezvous on a free port, so parallel tests never collide


def start(command: list[str], env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.Popen:
    """Start ``command`` without waiting for it, its output (stdout and stderr together) on a pipe."""
    # Its own session, so that a hang can be killed whole: torchrun and every worker.
    return subprocess.Popen(
        command,
        cwd=cwd,
        env=env or clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def run_script(
    script: str,
    args: list[str],
    run_dir: Path,
    nproc: int | None = None,
    timeout: float = 240,
    wrapper: list[str] = [],  # noqa: B006 - never mutated
    real_launcher: bool = False,
) -> Run:
    """Run ``script`` as a user would: ``python script.py`` when ``nproc`` is None, else
    ``torchrun --standalone --nproc_per_node=nproc``.

    The ranks start from tests/harness/launcher.py's warm fork server, unless ``real_launcher`` asks for
    python or torchrun itself in a subprocess: for tests of the launcher's own contract (its
    error summary, signals, interpreter shutdown). When ``timeout`` runs out every process is
    killed, and the test fails showing everything the ranks printed. ``wrapper`` goes between the
    launcher and the script (a test harness that injects a fault).
    """
    invocation = script_invocation(script, args, run_dir, wrapper)
    if real_launcher:
        return run_command([*launcher_prefix(nproc), *invocation], run_dir, timeout)
    return run_warm(invocation, run_dir, nproc, timeout)


def run_warm(
    invocation: list[str],
    run_dir: Path,
    nproc: int | None,
    timeout: float,
    on_line: Callable[[str], None] | None = None,
    namespaces_of: int | None = None,
) -> Run:
    """``invocation`` (a ``script_invocation``) with its ranks forked from the warm server; in the user and
    mount namespaces of process ``namespaces_of`` if given."""
    program, *argv = invocation
    finished = launcher.launch(program, argv, clean_env(), nproc, timeout, on_line, namespaces_of=namespaces_of)
    run = Run([*launcher_prefix(nproc), *invocation], finished.returncode, finished.output, run_dir, warm=True)
    if finished.timed_out:
        pytest.fail(f"timed out after {timeout} s\n{run.describe()}")
    return run


def warm_output_of(command: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> tuple[int, str]:
    """``tools.processes.output_of`` for the commands a benchmark starts with ``standalone_torchrun(n)``, their
    ranks forked from the warm server: a test patches it into the benchmark's module, since what it checks is
    the benchmark's runs and figures, and torchrun's start would cost each of them seconds of imports (the
    launcher tests run torchrun itself). ``env`` is the benchmark's, the caller's own minus torchrun's
    variables: the ranks get ``clean_env()``, which has those settings too (one thread each)."""
    prefix = standalone_torchrun(1)[:-1]
    nproc_flag, *invocation = command[len(prefix) :]
    assert command[: len(prefix)] == prefix and nproc_flag.startswith("--nproc_per_node="), command
    assert cwd in (None, REPO), f"run_warm starts the ranks in the repository, not in {cwd}"
    # The run's own --run-dir, if any, is in the invocation: the Run is read for its exit code and output only.
    run = run_warm(invocation, REPO, int(nproc_flag.split("=", 1)[1]), timeout=300)
    return run.returncode, run.output


def run_command(
    command: list[str], run_dir: Path, timeout: float, env: dict[str, str] | None = None, cwd: Path = REPO
) -> Run:
    """Run ``command`` to the end; on timeout kill it and everything it started, and fail with its output."""
    process = start(command, env, cwd)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(process.pid)
        output, _ = process.communicate()
        pytest.fail(f"timed out after {timeout} s\n$ {' '.join(command)}\n--- output ---\n{output}")
    return Run(command, process.returncode, output, run_dir)


def kill_all(pid: int) -> None:
    """SIGKILL the process group of ``pid`` and every process below it.

    The group alone is not enough: torchrun starts each worker in a session of
    its own, and a hung worker that outlives torchrun keeps the output pipe open,
    so the test would wait for it forever.
    """
    below = descendants(pid)  # before the kill, while torchrun is still their parent
    for target in (pid, *below):
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


PROGRESS_LINE = re.compile(r"^step +(\d+)/")


def run_until_stopped(
    script: str,
    args: list[str],
    run_dir: Path,
    nproc: int | None,
    stop_after: int,
    timeout: float = 240,
    wrapper: list[str] = [],  # noqa: B006 - never mutated
) -> Run:
    """Like ``run_script``, but create RUN_DIR/STOP once the progress line reports step ``stop_after``.

    That is how a user (or the SLURM launcher) asks a run to stop. The run
    notices at a later step boundary; which one depends on timing, so tests
    read the step it stopped at from the PREEMPTED marker. A resumed run that
    starts past ``stop_after`` (its previous part stopped late) is asked at once.
    """

    def stop_at_step(line: str) -> None:
        match = PROGRESS_LINE.match(line)
        if match and int(match.group(1)) >= stop_after:
            (run_dir / "STOP").touch()

    return run_warm(script_invocation(script, args, run_dir, wrapper), run_dir, nproc, timeout, stop_at_step)
