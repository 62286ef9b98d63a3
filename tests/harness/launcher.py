"""Start a script's ranks as torchrun does, but from a process that has already imported torch.

Every process that torchrun starts is a new interpreter that spends seconds of CPU importing
torch, torchvision and torch.distributed before its first line of training, and torchrun's own
agent pays the same again. The suite starts a few hundred ranks, so most tests start them here
instead: a fork server (Python's ``multiprocessing`` "forkserver") imports everything once per
pytest worker (tests/harness/preload.py), and each rank is a fresh fork of it that runs the script with
``runpy``, exactly as ``python script.py`` would, under torchrun's environment contract: RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and the TORCHELASTIC_*
variables.

What torchrun does for a run, this does too:
- the rendezvous store: a TCPStore on a port the kernel picks, served by this process, as the
  agent serves it (``TORCHELASTIC_USE_AGENT_STORE``), so parallel tests never collide on a port;
- when a rank fails, the others get a grace period to finish (a FatalError ends every rank
  together, and rank 0 prints it), then are killed;
- every rank gets a fresh process: nothing a run changes (random state, deterministic flags,
  signal handlers, process groups) reaches the next, because the server itself never runs one.

It adds a hard timeout that kills every rank with all it started. It leaves out what tests of
the launcher itself need: restarts and torchrun's error summary. Those tests run torchrun.

One difference from a real interpreter: a forked process ends with ``os._exit``, so it skips
interpreter shutdown. Shutdown-time faults show only under real launchers, which some tests keep.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import runpy
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRELOAD = ["tests.harness.preload"]
# How long the other ranks get to end by themselves after one fails, before they are killed.
GRACE_S = 15.0

_server: ForkServerContext | None = None


@dataclass
class Finished:
    returncode: int  # the first failing rank's exit code (negative: killed by that signal), else 0
    output: str  # every rank's stdout and stderr, interleaved as they wrote it
    timed_out: bool


def fork_server(env: dict[str, str]) -> ForkServerContext:
    """This process's fork server, started on first use with ``env`` as its environment.

    The environment matters once, at the start: OpenMP reads OMP_NUM_THREADS when torch loads, so
    the server must load torch with the value its ranks run with. Each rank sets its own on top.
    """
    global _server
    if _server is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        with environment(env):
            multiprocessing.forkserver.ensure_running()
        _server = context
    return _server


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def torchrun_env(base: dict[str, str], rank: int, world_size: int, port: int, run_id: str) -> dict[str, str]:
    """What ``torchrun --standalone --nproc_per_node=world_size`` gives the rank ``rank``."""
    return {
        **base,
        **{"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank)},
        **{"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "ROLE_WORLD_SIZE": str(world_size)},
        **{"GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the store below is the agent's: every rank is its client
        **{"TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"},
    }


def _run_rank(
    program: str, argv: list[str], env: dict[str, str], output: Connection, cwd: Path, namespaces_of: int | None
) -> None:
    """The body of one rank, in a fork of the server."""
    os.setsid()  # a process group of its own, so that a timeout kills whatever it started too
    for stream in (1, 2):
        os.dup2(output.fileno(), stream)
    output.close()
    os.environ.clear()
    os.environ.update(env)
    if namespaces_of is not None:
        _join_namespaces(namespaces_of)
    os.chdir(cwd)
    if cwd != REPO:
        _forget_this_repository(program)
    sys.argv = [program, *argv]
    runpy.run_path(program, run_name="__main__")


# setns(2)'s flags for the two kinds of namespace a rank can join (linux/sched.h).
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000


def _join_namespaces(pid: int) -> None:
    """Enter the user and mount namespaces of process ``pid``: the rank sees the file systems mounted there.

    The user namespace first: it gives the rights to enter the mount namespace it owns. Joining a user
    namespace needs a process of one thread, which a fresh fork of the server is.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    for kind, flag in (("user", CLONE_NEWUSER), ("mnt", CLONE_NEWNS)):
        descriptor = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY)
        try:
            if libc.setns(descriptor, flag) != 0:
                error = ctypes.get_errno()
                raise OSError(error, f"cannot join the {kind} namespace of process {pid}: {os.strerror(error)}")
        finally:
            os.close(descriptor)


def _forget_this_repository(program: str) -> None:
    """Make this rank what ``python PROGRAM`` started elsewhere would be: a script of another project
    (a copy of one of ours) imports its own ``common``, never the one the server preloaded.

    Drops every module loaded from this repository (the virtual environment's aside), and makes
    sys.path what python gives a script: its folder, then PYTHONPATH, then the installation's.
    """
    installation = Path(sys.prefix).resolve()
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        folders = Path(file).resolve().parents if file else []
        if REPO in folders and installation not in folders:
            del sys.modules[name]
    pythonpath = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    rest = [entry for entry in sys.path if entry and Path(entry).resolve() != REPO and entry not in pythonpath]
    sys.path[:] = [str(Path(program).resolve().parent), *pythonpath, *rest]


def launch(
    program: str,
    argv: list[str],
    env: dict[str, str],
    nproc: int | None,
    timeout: float,
    on_line: Callable[[str], None] | None = None,
    cwd: Path = REPO,
    namespaces_of: int | None = None,
) -> Finished:
    """Run ``program argv`` as ``python`` (``nproc`` None) or ``torchrun --nproc_per_node=nproc`` would,
    started in ``cwd``.

    ``on_line`` sees each line of output as it arrives. When ``timeout`` runs out, every rank is
    killed and ``timed_out`` is set. A ``cwd`` outside this repository runs a script of another
    project: its ranks see none of this repository's modules (``_forget_this_repository``). With
    ``namespaces_of``, a process's id, the ranks run in its user and mount namespaces, as a command
    that ``unshare`` starts would (``_join_namespaces``).
    """
    server = fork_server(env)
    reader, writer = server.Pipe(duplex=False)
    store = None
    if nproc is None:
        rank_envs = [env]
    else:
        # Imported here: the parent needs torch only for the store.
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, nproc, True, timedelta(seconds=timeout), wait_for_workers=False)
        run_id = uuid.uuid4().hex
        rank_envs = [torchrun_env(env, rank, nproc, store.port, run_id) for rank in range(nproc)]
    ranks = [
        server.Process(target=_run_rank, args=(program, argv, rank_env, writer, cwd, namespaces_of))
        for rank_env in rank_envs
    ]
    for rank in ranks:
        rank.start()
    writer.close()  # the ranks hold the only write ends now: end of file means all of them are gone
    try:
        return _supervise(ranks, reader, timeout, on_line)
    finally:
        _kill(ranks)  # whatever went wrong in here, no rank outlives the call
        reader.close()
        del store


def _supervise(
    ranks: list[multiprocessing.Process],
    reader: Connection,
    timeout: float,
    on_line: Callable[[str], None] | None,
) -> Finished:
    """Collect output until every rank has ended; end the others when one fails, all at the timeout."""
    now = time.monotonic()
    kill_at = now + timeout  # moves closer when a rank fails: the others get GRACE_S
    stop_reading_at = math.inf  # once no rank runs: what they left in the pipe, then no more
    output, pending = bytearray(), bytearray()
    running, reading = list(ranks), True
    failed: multiprocessing.Process | None = None
    timed_out = False
    while running or (reading and now < stop_reading_at):
        if running and now >= kill_at:
            timed_out = failed is None  # killing the survivors of a failure is clean-up, not a hang
            _kill(running)
            kill_at = math.inf
        waitables = [*([reader] if reading else []), *(rank.sentinel for rank in running)]
        wake_at = min(kill_at, stop_reading_at)
        ready = multiprocessing.connection.wait(waitables, None if wake_at == math.inf else max(0.0, wake_at - now))
        if reader in ready:
            chunk = os.read(reader.fileno(), 1 << 16)
            reading = bool(chunk)
            output += chunk
            pending += chunk
            *lines, rest = pending.split(b"\n")
            pending = bytearray(rest)
            for line in lines if on_line is not None else []:
                on_line(line.decode(errors="replace") + "\n")  # type: ignore[misc]
        now = time.monotonic()
        for rank in [rank for rank in running if rank.sentinel in ready]:
            rank.join()
            running.remove(rank)
            if rank.exitcode != 0 and failed is None:
                failed = rank
                kill_at = min(kill_at, now + GRACE_S)  # like torchrun: a while to end alone, then killed
        if not running:
            stop_reading_at = min(stop_reading_at, now + GRACE_S)
    _kill(running)
    for rank in ranks:
        rank.join(timeout=GRACE_S)
    first_failure = failed if failed is not None else next((rank for rank in ranks if rank.exitcode), None)
    returncode = 0 if first_failure is None else first_failure.exitcode
    return Finished(-signal.SIGKILL if returncode is None else returncode, output.decode(errors="replace"), timed_out)


def _kill(ranks: list[multiprocessing.Process]) -> None:
    """SIGKILL each rank's process group: the rank and anything it started."""
    for rank in ranks:
        if rank.pid is not None and rank.exitcode is None:
            with contextlib.suppress(ProcessLookupError):  # ended on its own meanwhile
                os.killpg(rank.pid, signal.SIGKILL)
