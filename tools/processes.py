"""Child processes that end with the command that started them, whatever ends it.

The commands that start torchrun (tools.checks.preflight, tools.checks.check_equivalence, tools.benchmarks.benchmark,
tools.benchmarks.compare_strategies) start it with ``run_tree``: in a session of its own, every process below it
remembered as it appears, and all of them killed when it exits, when its time runs out, or when the
command is stopped. torchrun starts each worker in a session of its own too, so neither a signal to
the command's process group nor one to torchrun alone reaches the workers; a worker orphaned by
torchrun's end is no longer below anything this command can see, hence the remembering.

``exit_code_of(main, prog)`` runs a command's work with SIGTERM, SIGINT and SIGHUP turned into
``Stopped``, an exception: the ``finally`` blocks between the signal and the command's top end the
children and remove the temporary folders, then the command prints one line and exits 128 + the
signal's number, as a shell reports a process ended by that signal.

Nothing here imports torch: tools.checks.preflight's parent process never does.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from common.outputs import STOPPING_SIGNALS

POLL_S = 0.1  # how often a running tree is looked at: new processes, the caller's done(), the clock


class Stopped(BaseException):
    """A stopping signal reached the command. A BaseException, as KeyboardInterrupt is: an ``except
    Exception`` on the way up must not turn the stop into an ordinary error and carry on."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def __str__(self) -> str:
        return f"stopped by {signal.Signals(self.signum).name}"


class _SignalState:
    """What a stopping signal does now: raise Stopped; or wait to the end of a held block (a child being
    started, a cleanup); or nothing, once a stop is under way (its cleanup must run to its end)."""

    def __init__(self) -> None:
        self.held = 0
        self.pending: int | None = None
        self.stopping = False
        self.trees = 0  # how many process trees run_tree started, for the last line
        self.outlived: list[int] = []  # processes still there after their tree was killed, for the last line

    def handle(self, signum: int, frame: object) -> None:
        if self.stopping:
            return
        if self.held:
            self.pending = signum
            return
        self.stopping = True
        raise Stopped(signum)

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Signals wait for the end of the block: a Stopped raised inside Popen would leave its child unknown,
        one inside a cleanup would leave half of it undone."""
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1
        if not self.held and self.pending is not None and not self.stopping:
            self.stopping = True
            raise Stopped(self.pending)


_SIGNALS = _SignalState()


def exit_code_of(main: Callable[[], int | None], prog: str) -> int:
    """``main()``'s exit code; if a stopping signal comes first, one line on stderr and 128 + the signal.

    A signal the command was started with ignored (``nohup``, a background job's SIGINT) stays ignored.
    """
    if threading.current_thread() is not threading.main_thread():
        return main() or 0  # Python delivers signals to the main thread only: nothing to install
    previous = {signum: signal.getsignal(signum) for signum in STOPPING_SIGNALS}
    for signum, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(signum, _SIGNALS.handle)
    try:
        return main() or 0
    except Stopped as stop:
        print(f"{prog}: {stop}{what_ended()}", file=sys.stderr, flush=True)
        return stop.exit_code
    finally:
        _SIGNALS.stopping = True  # a signal while the handlers are put back comes after the work: nothing to stop
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _SIGNALS.__init__()


def what_ended() -> str:
    """The end of the stop line: whether the processes the command started ended; nothing if it started none."""
    if _SIGNALS.outlived:
        return f"; processes {_SIGNALS.outlived} it started outlived the kill"
    return "; it ended every process it had started" if _SIGNALS.trees else ""


def start_time(pid: int) -> str:
    """Field 22 of /proc/PID/stat, the process's start time; empty once it is gone (or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat.rsplit(")", 1)[1].split()
    return "" if fields[0] == "Z" else fields[19]


def descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs, from Linux's /proc (the test harness uses it too)."""
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:  # the process ended meanwhile (pathlib's glob raised for it, mid-scan)
        return []
    for task in tasks:
        try:
            children = [int(child) for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:  # the task ended meanwhile
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


class ProcessTree:
    """``pid`` and every process below it, remembered as each is seen, by start time: a pid the kernel
    gives to an unrelated process later is never taken for one of these."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seen: dict[int, str] = {pid: start_time(pid)}

    def refresh(self) -> None:
        for pid in descendants(self.pid):
            self.seen.setdefault(pid, start_time(pid))

    def alive(self) -> list[int]:
        return [pid for pid, started in self.seen.items() if started and start_time(pid) == started]

    def kill_all(self) -> None:
        """SIGKILL every process of the tree. Each is first frozen (SIGSTOP), and the tree looked at again
        until no new process appears: one that forked between the last look and its kill would escape."""
        frozen: list[int] = []
        while True:
            self.refresh()
            fresh = [pid for pid in self.alive() if pid not in frozen]
            if not fresh:
                break
            for pid in fresh:
                send(pid, signal.SIGSTOP)
            frozen += fresh
        for pid in frozen:
            send(pid, signal.SIGKILL)

    def gone_within(self, seconds: float) -> list[int]:
        """Those still alive after ``seconds``: a killed process takes a moment to end (its exit, then its
        parent's reaping), so a look right after the kill would name processes on their way out."""
        deadline = time.monotonic() + seconds
        while (left := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the kernel's process table, with a bound
        return left


def send(pid: int, signum: int) -> None:
    # Gone meanwhile, or not ours to signal any more (a setuid program): gone_within names what stays.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


@dataclass
class Ended:
    returncode: int
    timed_out: bool
    left_running: list[int]  # processes that outlived the kill (none, unless the kernel was slow to end them)


def run_tree(
    command: list[str],
    output: IO,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = math.inf,
    done: Callable[[], bool] = lambda: False,
) -> Ended:
    """Run ``command`` (stdout and stderr to ``output``) until it exits, ``done()`` says its result is in, or
    ``timeout`` seconds pass; then kill every process it started, and return once they are gone.

    torchrun writes its own log folder into the temporary directory and never removes it; here it goes
    into one that is removed at the end (torchrun reads its --log-dir from PET_LOG_DIR too; a user's own
    PET_LOG_DIR is kept).
    """
    with scratch_folder("torchrun-logs-") as logs:
        env = {**(os.environ if env is None else env)}
        env.setdefault("PET_LOG_DIR", str(logs))
        tree: ProcessTree | None = None
        deadline, timed_out = time.monotonic() + timeout, False
        try:
            # A signal held here is raised as the block ends: inside the try, so the tree is ended too.
            with _SIGNALS.holding():
                process = subprocess.Popen(
                    command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
                )
                tree = ProcessTree(process.pid)
                _SIGNALS.trees += 1
            while process.poll() is None and not done():
                tree.refresh()
                if time.monotonic() >= deadline:
                    timed_out = True
                    break
                time.sleep(POLL_S)  # polling a child with a bound, not synchronisation
        finally:
            if tree is not None:  # else Popen failed, and its error is on its way up
                with _SIGNALS.holding():
                    tree.kill_all()
                    process.wait()
                    left = tree.gone_within(5.0)
                    _SIGNALS.outlived += left
    return Ended(process.returncode, timed_out, left)


@contextlib.contextmanager
def scratch_folder(prefix: str) -> Iterator[Path]:
    """A new folder in the temporary directory, removed at the end of the block, a stop included."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield folder
    finally:
        with _SIGNALS.holding():
            shutil.rmtree(folder, ignore_errors=True)


def output_of(command: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> tuple[int, str]:
    """``run_tree`` to the end: the exit code and everything the command printed."""
    with tempfile.TemporaryFile("w+", errors="replace") as output:
        ended = run_tree(command, output, env=env, cwd=cwd)
        output.seek(0)
        return ended.returncode, output.read()


# Where torchrun places a process: its rank and world (common.distributed.LAUNCH_VARIABLES) and where the
# ranks meet. Spelled here too because a command's own process never imports torch (tests/test_layout.py
# keeps the two lists in step).
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def outside_any_job() -> dict[str, str]:
    """This process's environment without torchrun's variables: what a command passes to the ranks it
    starts, which must make a job of their own, not join the one this command may run in."""
    return {key: value for key, value in os.environ.items() if key not in TORCHRUN_VARIABLES}


def standalone_torchrun(nproc: int) -> list[str]:
    """``torchrun --standalone --nproc_per_node=N`` with this interpreter: a job of its own on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def one_thread_per_rank() -> dict[str, str]:
    """``outside_any_job()`` with one thread per process unless OMP_NUM_THREADS says otherwise: torchrun's own
    default for several workers, given to one process as well, so that every run of a comparison has it."""
    env = outside_any_job()
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
