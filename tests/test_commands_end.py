"""Every command that starts processes ends them: stopped mid-run, nothing it started survives, no temporary
folder stays, and it says so in one line (tools.processes).

Each case runs the real command in an interpreter of its own. What it starts is cheap, a
``sitecustomize`` on the PYTHONPATH sees to it:
- every torchrun worker of the test is a stand-in that ignores SIGTERM and SIGINT (a rank busy in a
  collective, or saving on SIGTERM, does not end at once either), writes one line to a FIFO and waits
  forever: that line is how the test knows the run is mid-run, workers and all;
- torchrun itself is real in the first case, which is issue 37's (its agent costs 3 CPU-seconds to
  start, and it leaves a folder in the temporary directory); in the others it is a stand-in of the
  same shape, an agent whose worker runs in a session of its own, as torchrun's do.

Every process the command starts inherits its environment, which holds the FIFO's path: a process
whose environment holds it once the command has ended is a survivor. The temporary directory is the
test's own, so anything left in it is the command's.

Two cases run in process, the signal's handler called where the kernel would run it: a signal while
Popen starts a child (the child must still be ended), and a command stopped before it started anything.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.outputs import TEMPORARY_PREFIX
from tests.harness.runs import REPO, clean_env, kill_all, start
from tools import processes

MARKER, FAKE_TORCHRUN = "TEST_COMMANDS_END_FIFO", "TEST_COMMANDS_END_STAND_IN_TORCHRUN"
STAND_IN = f"""
import os
import signal
import subprocess
import sys

if "{MARKER}" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with open(os.environ["{MARKER}"], "w") as fifo:
        fifo.write(f"worker {{os.getpid()}} running\\n")
    while True:
        signal.pause()
with open("/proc/self/cmdline", "rb") as cmdline:
    torchrun = b"torch.distributed.run" in cmdline.read().split(b"\\0")
if "{FAKE_TORCHRUN}" in os.environ and torchrun:
    worker = {{**os.environ, "TORCHELASTIC_RUN_ID": "stand-in"}}
    subprocess.Popen([sys.executable, "-c", ""], env=worker, start_new_session=True)
    while True:
        signal.pause()
"""
STARTED_WITHIN_S = 60  # torchrun's start on a loaded machine, with a margin
PREFLIGHT_TIMEOUT_S = 4  # --timeout: the stand-ins start well within it

# Each: the case, the command's arguments (DIR: the test's folder), the signal (None: its own timeout),
# whether torchrun is real, the exit code and the line it must end with.
CASES = [
    ("preflight-sigterm", ["tools.checks.preflight", "--nproc", "1", "DIR/script.py"], signal.SIGTERM, True,
     128 + signal.SIGTERM, "python -m tools.checks.preflight: stopped by SIGTERM"),
    ("preflight-timeout", ["tools.checks.preflight", "--nproc", "1", "--timeout", str(PREFLIGHT_TIMEOUT_S),
                           "DIR/script.py"], None, False,
     1, f"pre-flight: no result within --timeout {PREFLIGHT_TIMEOUT_S} s"),
    ("check_equivalence-sigint", ["tools.checks.check_equivalence", "--nproc", "2", "--runs-dir", "DIR/runs",
                                  "DIR/script.py", "--global-batch-size", "4"], signal.SIGINT, False,
     128 + signal.SIGINT, "python -m tools.checks.check_equivalence: stopped by SIGINT"),
    ("benchmark-sigterm", ["tools.benchmarks.benchmark", "--nproc", "1", "--warmup", "1", "--steps", "1",
                           "--batch-size", "1", "--out", "DIR/out/benchmark.json"], signal.SIGTERM, False,
     128 + signal.SIGTERM, "python -m tools.benchmarks.benchmark: stopped by SIGTERM"),
    ("compare_strategies-sigint", ["tools.benchmarks.compare_strategies", "--world-sizes", "1", "--strategies", "ddp",
                                   "--steps", "1", "--device", "cpu", "--out-dir", "DIR/out"], signal.SIGINT, False,
     128 + signal.SIGINT, "python -m tools.benchmarks.compare_strategies: stopped by SIGINT"),
]  # fmt: skip


def processes_with(entry: str) -> list[int]:
    """The processes whose environment holds ``entry`` (NAME=VALUE); a zombie's reads as empty."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):  # ended meanwhile, or not ours to read
            if entry.encode() in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
    return found


def await_line(fifo: int, command: subprocess.Popen, printed: bytearray, seconds: float) -> str:
    """The first line a stand-in worker wrote, the command's output meanwhile kept in ``printed``; the test
    fails if the command ends or the time runs out first."""
    deadline = time.monotonic() + seconds
    pipe = command.stdout.fileno()
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fifo, pipe], [], [], left)
        if fifo in ready:
            return os.read(fifo, 4096).decode()
        if pipe in ready:
            chunk = os.read(pipe, 4096)
            if not chunk:
                command.wait()
                pytest.fail(f"the command ended (exit code {command.returncode}) before a worker started:\n"
                            f"{printed.decode(errors='replace')}")  # fmt: skip
            printed += chunk
    pytest.fail(f"no worker started within {seconds} s:\n{printed.decode(errors='replace')}")


def start_as_from_a_terminal(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """``start(command)`` with SIGINT as a terminal gives it, whatever started pytest: a shell's background
    job (``pytest ... &``, as CI may run it) ignores SIGINT, its children inherit that, and a command
    rightly keeps a signal it was started with ignored. A handler of this process's own is reset on exec."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return start(command, env)
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize(
    ("case", "argv", "signum", "real_torchrun", "exit_code", "last_line"), CASES, ids=[c[0] for c in CASES]
)
def test_a_command_stopped_mid_run_leaves_nothing(
    case: str,
    argv: list[str],
    signum: int | None,
    real_torchrun: bool,
    exit_code: int,
    last_line: str,
    tmp_path: Path,
) -> None:
    (tmp_path / "script.py").write_text("")  # what the stand-ins replace; plain python runs it to an exit 0
    stand_in, temporary = tmp_path / "stand_in", tmp_path / "tmp"
    stand_in.mkdir()
    temporary.mkdir()
    (stand_in / "sitecustomize.py").write_text(STAND_IN)
    fifo_path = tmp_path / "announce"
    os.mkfifo(fifo_path)
    # Read and write ends both open here: the stand-ins' open() never blocks, and a read never sees an end.
    fifo = os.open(fifo_path, os.O_RDWR | os.O_NONBLOCK)
    env = clean_env() | {"TMPDIR": str(temporary), MARKER: str(fifo_path), "PYTHONPATH": f"{stand_in}:{REPO}"}
    env |= {} if real_torchrun else {FAKE_TORCHRUN: "1"}
    marker = f"{MARKER}={fifo_path}"
    command = start_as_from_a_terminal(
        [sys.executable, "-m", *(arg.replace("DIR", str(tmp_path)) for arg in argv)], env
    )
    printed = bytearray()
    try:
        assert "running" in await_line(fifo, command, printed, STARTED_WITHIN_S)
        if signum is not None:
            os.kill(command.pid, signum)  # the command alone, as `kill PID` or a scheduler does
        try:
            rest, _ = command.communicate(timeout=PREFLIGHT_TIMEOUT_S + 30)
        except subprocess.TimeoutExpired:
            kill_all(command.pid)
            pytest.fail(f"the command did not end:\n{command.communicate()[0]}")
        output = printed.decode(errors="replace") + rest
        described = f"exit code {command.returncode}\n--- output ---\n{output}"
        survivors = processes_with(marker)
        assert survivors == [], f"still running: {survivors}\n{described}"
        assert sorted(os.listdir(temporary)) == [], described
        # Nor an output's temporary (benchmark's and compare_strategies' run folders are made under one).
        assert sorted(tmp_path.rglob(f"{TEMPORARY_PREFIX}*")) == [], described
        assert command.returncode == exit_code, described
        assert output.count(last_line) == 1, described
    finally:
        os.close(fifo)
        for pid in processes_with(marker):  # today's survivors, so that the test leaves none itself
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_stop_while_a_child_starts_still_ends_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A signal that comes while Popen starts the child waits until the tree knows the child, then ends it.

    In process, the signal's handler called where the kernel would run it: inside Popen, once the child exists.
    """
    real_popen = subprocess.Popen

    def popen_then_stop(*args: object, **kwargs: object) -> subprocess.Popen:
        child = real_popen(*args, **kwargs)
        processes._SIGNALS.handle(signal.SIGTERM, None)
        return child

    monkeypatch.setattr(subprocess, "Popen", popen_then_stop)
    marker = f"{MARKER}={tmp_path}"
    env = clean_env() | {MARKER: str(tmp_path)}
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    try:
        code = processes.exit_code_of(lambda: processes.output_of(sleeper, env=env)[0], "prog")
        assert code == 128 + signal.SIGTERM
        assert processes_with(marker) == []
        assert capsys.readouterr().err == "prog: stopped by SIGTERM; it ended every process it had started\n"
    finally:
        for pid in processes_with(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_command_that_started_nothing_says_only_that_it_stopped(capsys: pytest.CaptureFixture[str]) -> None:
    def stopped_at_once() -> int:
        processes._SIGNALS.handle(signal.SIGINT, None)  # where the kernel would run it
        return 0

    assert processes.exit_code_of(stopped_at_once, "prog") == 128 + signal.SIGINT
    assert capsys.readouterr().err == "prog: stopped by SIGINT\n"
