"""Shared test machinery: run a training script the way a user does, and read what it wrote."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from common.compat import FSDP2_CPU_OFFLOAD, FSDP2_ON_CPU, torch_at_least
from tests.harness import launcher
from tests.harness.mnist_fixture import write_fake_mnist
from tests.harness.noise_floor import FAMILIES, NoiseRuns, noise_runs_in, planned_noise_runs

REPO = Path(__file__).resolve().parents[1]

# A short MNIST run: 2 epochs of the 3000-image rendered-digit fixture.
MNIST_ARGS = ["--epochs", "2", "--batch-size", "32", "--log-interval", "10"]
# A short transformer run: 300 steps of 48 sequences of 32 tokens, the same
# global batch at 1, 2 and 3 processes. It ends about 0.11 nats/token above the
# floor. The 0.3 bound leaves room for noise, yet fails a model stuck on the
# ~2.4 plateau of one that has not learned to use its context.
CONVERGE_ARGS = [
    "--max-steps", "300", "--global-batch-size", "48", "--lr", "1e-2", "--warmup-steps", "10",
    "--block-size", "32", "--log-interval", "10", "--eval-interval", "300",
]  # fmt: skip
NEAR_FLOOR = 0.3

# Parts that stop by design on an older torch (test_torch_versions.py shows each stop) are skipped there.
FSDP2_SCRIPT = "fsdp/train_transformer_fsdp2.py"
NEEDS_FSDP2_ON_CPU = pytest.mark.skipif(
    not torch_at_least(FSDP2_ON_CPU), reason="FSDP2 on the CPU needs torch 2.9 (test_torch_versions.py)"
)
NEEDS_FSDP2_CPU_OFFLOAD = pytest.mark.skipif(
    not torch_at_least(FSDP2_CPU_OFFLOAD), reason="FSDP2 --cpu-offload needs torch 2.9 (test_torch_versions.py)"
)


def cases(rows: list[tuple], floor: Collection[str] = (), keep_id: bool = True) -> list:
    """``pytest.param`` per row of a case table whose first item is the case's id.

    Rows named in ``floor`` get the ``floor`` marker: the floor pass (the oldest
    supported torch, ``pytest -m floor``) runs them too. Rows that run the FSDP2
    script are skipped where FSDP2 cannot run on the CPU. ``keep_id=False``
    passes the row without its id to the test.
    """
    params = []
    for row in rows:
        marks = [pytest.mark.floor] if row[0] in floor else []
        if FSDP2_SCRIPT in row:
            marks.append(NEEDS_FSDP2_ON_CPU)
        params.append(pytest.param(*(row if keep_id else row[1:]), id=row[0], marks=marks))
    return params


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
    command: list[str]
    returncode: int
    output: str
    run_dir: Path
    warm: bool = False  # the ranks were forks of tests/harness/launcher.py's server, not new interpreters

    def describe(self) -> str:
        how = " (ranks started by tests/harness/launcher.py, as torchrun would)" if self.warm else ""
        return f"$ {' '.join(self.command)}{how}\nexit code {self.returncode}\n--- output ---\n{self.output}"

    def check(self) -> Run:
        assert self.returncode == 0, self.describe()
        return self

    def metrics(self) -> list[dict]:
        lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    def events(self, kind: str) -> list[dict]:
        return [record for record in self.metrics() if record["event"] == kind]

    def final(self) -> dict:
        (record,) = self.events("final")
        return record


def script_invocation(script: str, args: list[str], run_dir: Path, wrapper: list[str]) -> list[str]:
    """What follows ``python`` or ``torchrun ...`` on the command line: the script and its flags."""
    return [*wrapper, script, "--device", "cpu", "--dist-timeout", "60", "--run-dir", str(run_dir), *args]


def launcher_prefix(nproc: int | None) -> list[str]:
    if nproc is None:
        return [sys.executable]
    # --standalone: a rendezvous on a free port, so parallel tests never collide.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def start(command: list[str], env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.Popen:
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


def descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs, from Linux's /proc."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(child) for child in (task / "children").read_text().split()]
        except OSError:  # the task ended meanwhile
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


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
    script: str, args: list[str], run_dir: Path, nproc: int | None, stop_after: int, timeout: float = 240
) -> Run:
    """Like ``run_script``, but create RUN_DIR/STOP once the progress line reports step ``stop_after``.

    That is how a user (or the SLURM launcher) asks a run to stop. The run
    notices at a later step boundary; which one depends on timing, so tests
    read the step it stopped at from the PREEMPTED marker.
    """

    def stop_at_step(line: str) -> None:
        match = PROGRESS_LINE.match(line)
        if match and int(match.group(1)) == stop_after:
            (run_dir / "STOP").touch()

    return run_warm(script_invocation(script, args, run_dir, []), run_dir, nproc, timeout, stop_at_step)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``-n``, all of test_slurm.py runs on one worker: its tests share one Slurm cluster.

    Every other test is a unit of its own, as under xdist's default. (xdist's own ``xdist_group``
    mark does nothing with pytest 9: the group is added to a node id that pytest no longer reads.)
    """
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SlurmTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "slurm" if nodeid.startswith("tests/test_slurm.py::") else nodeid

    return SlurmTestsTogether(config, log)


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small rendered-digit MNIST: 3000 training images, 1999 test images.

    1999 is prime, so no world size above one divides the test set evenly.
    """
    return write_fake_mnist(tmp_path_factory.mktemp("mnist"), train_count=3000, test_count=1999)


@pytest.fixture(scope="session")
def tiny_mnist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """640 training and 200 test images: an epoch of 20 steps at a global batch of 32, for runs that need
    several epochs but not a good model."""
    return write_fake_mnist(tmp_path_factory.mktemp("tiny_mnist"), train_count=640, test_count=200)


def shared_noise_runs(tmp_path_factory: pytest.TempPathFactory, family: str, data: tuple[str, ...] = ()) -> NoiseRuns:
    """The one-process reference and its twins for ``family`` (tests/harness/noise_floor.py), made once a session;
    ``data`` are the flags that say where its data is.

    Under ``pytest -n`` the first worker to take the lock runs them into a folder all workers share.
    """
    # getbasetemp() is per worker under xdist, and its parent is this session's, shared by the
    # workers. Without xdist the parent is shared by every session of this user, other torch
    # versions' and CPU kernels' too: there the session's own folder is the one to use.
    session = tmp_path_factory.getbasetemp()
    root = (session.parent if "PYTEST_XDIST_WORKER" in os.environ else session) / "noise-floor" / family
    script, flags = FAMILIES[family]
    flags = [*flags, *data]
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{root}.lock"):
        if not (root / "done").exists():
            for name, run_flags in planned_noise_runs(flags):
                run_script(script, run_flags, root / name).check()
            (root / "done").touch()
    return noise_runs_in(root, flags)


@pytest.fixture(scope="session")
def transformer_noise(tmp_path_factory: pytest.TempPathFactory) -> NoiseRuns:
    return shared_noise_runs(tmp_path_factory, "transformer")


@pytest.fixture(scope="session")
def variable_length_noise(tmp_path_factory: pytest.TempPathFactory) -> NoiseRuns:
    return shared_noise_runs(tmp_path_factory, "variable-length")


@pytest.fixture(scope="session")
def mnist_noise(tmp_path_factory: pytest.TempPathFactory, tiny_mnist_dir: Path) -> NoiseRuns:
    # Each xdist worker writes its own copy of the fixture: the same files, from the same seed.
    return shared_noise_runs(tmp_path_factory, "mnist", ("--data-dir", str(tiny_mnist_dir)))


# The order in which pytest-xdist hands tests to its workers is the collection order. The
# longest tests go first, so that both workers stay busy to the end instead of one of them
# finishing a long test alone. Measured with `pytest -n auto --durations=0`; earlier wins.
LONGEST_FIRST = (
    "tests/test_start_from_a_copy.py",
    "tests/test_slurm.py",
    "tests/test_equivalence.py::test_check_equivalence_says_same",
    "tests/test_checkpoint.py",
    "tests/test_failures.py",
    "tests/test_ddp.py",
    "tests/test_bad_input.py::test_bad_flag_is_reported_once_under_torchrun",
    "tests/test_untrusted_checkpoint.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def position(item: pytest.Item) -> int:
        prefixes = [index for index, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)]
        return prefixes[0] if prefixes else len(LONGEST_FIRST)

    items.sort(key=position)  # stable: the rest keep their order
