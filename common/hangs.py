"""When a job hangs: torch's Flight Recorder records each collective, and a watchdog of this process's own ends the
job with one report of which rank stopped at which collective, and where.

The Flight Recorder (``TORCH_FR_BUFFER_SIZE``) keeps each collective's sequence number per group, its name, sizes and
the Python frames that called it, on gloo as on NCCL. ``HangWatch`` reacts to
no step ending for ``--hang-timeout`` seconds, a collective that fails (a peer died, the group's timeout), or a stop
signal (SIGTERM, SIGUSR1) that no step boundary answers: each rank still alive writes its trace and its Python stacks
into RUN_DIR/hang/, one rank prints the report (``hang_report``), and every rank ends with exit code 1. The ranks
meet in the rendezvous store, which a hung collective does not block. On NCCL, torch's own watchdog dumps its trace
into the same folder on a timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``).
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import re
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.distributed import STOP_SIGNALS, DistContext
from common.outputs import write_outputs, write_text

HANG_DIR = "hang"
TRACE_PREFIX = "fr_trace_rank_"  # + rank: the names torch's fr_trace analyzer reads a folder of
STACKS_PREFIX = "stacks_rank_"
REPORT_FILE = "report.txt"
# Entries of the ring buffer: the DDP and FSDP2 scripts issue 10 to 40 collectives a step at the presets, so a few
# steps of the largest fit, and each entry holds a short stack (about a KiB).
FR_BUFFER_ENTRIES = 2000
EXIT_CODE = 1
POLL_S = 1.0  # how often the watchdog looks at the clock and at the store
DUMPS_WAIT_S = 5.0  # for the other ranks' traces: a live rank writes its own within a poll or two; a dead one never
STOP_WAIT_S = 10.0  # for the watchdog to end with training: it is back from the store within a poll
REPORT_WAIT_S = 20.0  # for the report: then this rank ends anyway
KEY = "hang/"


def record_collectives(run_dir: Path, enabled: bool) -> None:
    """Turn the Flight Recorder on, and on NCCL torch's own dump on a collective timeout into RUN_DIR/hang/; before
    the process group exists: ProcessGroupNCCL reads its variables when it is made (gloo's recorder starts at the
    first collective, measured on torch 2.14.1). A variable set already is kept."""
    if not enabled:
        return
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FR_BUFFER_ENTRIES))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    # torch appends the rank to this prefix (torch_nccl_environment_variables; TORCH_NCCL_DEBUG_INFO_TEMP_FILE before)
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(run_dir.absolute() / HANG_DIR / "nccl_trace_rank_"))


def step_finished() -> None:
    """Called at the end of every optimizer step (common.collectives' StepObserver): the watchdog's heartbeat."""
    now = time.monotonic()
    if HangWatch.last_step_end is not None:
        HangWatch.slowest_step = max(HangWatch.slowest_step, now - HangWatch.last_step_end)
    HangWatch.last_step_end = now


@contextmanager
def watch_paused() -> Iterator[None]:
    """An evaluation or a checkpoint save (Bookkeeping.paused, around both in every script): no step ends in it for as
    long as the held-out set or the file system takes, which on a cluster can pass --hang-timeout and is no hang. A
    rank stuck in one of their collectives is still named: the collective fails at --dist-timeout, then the report."""
    HangWatch.paused += 1
    try:
        yield
    finally:
        HangWatch.paused -= 1
        if HangWatch.last_step_end is not None:  # the clock starts again from here
            HangWatch.last_step_end = time.monotonic()


def training_ended() -> None:
    """After the last step: the last checkpoint and model.pt (a gather of the whole model to rank 0, then its write)
    take what they take, and a collective that fails among them still ends in the report."""
    HangWatch.last_step_end = None


class HangWatch:
    """The watchdog of one rank, as a context around training: made before the process group (it turns the Flight
    Recorder on, which torch reads when it makes the group), started once the group exists, stopped when training
    ends; a collective that fails inside it ends the job with the report instead of a traceback per rank."""

    last_step_end: float | None = None  # armed by the first step's end (a first step may compile for minutes)
    slowest_step = 0.0
    paused = 0  # inside watch_paused

    def __init__(self, run_dir: Path, ctx: DistContext, timeout_s: float, enabled: bool) -> None:
        self.folder, self.ctx, self.timeout_s = run_dir / HANG_DIR, ctx, timeout_s
        self.enabled = enabled and ctx.world_size > 1
        self.done = threading.Event()
        self.handling = threading.Lock()  # one path per rank reports: the watchdog's or the failed collective's
        self.signalled_at: float | None = None
        self.wakeup: tuple[int, int] | None = None
        self.previous_wakeup = -1
        record_collectives(run_dir, self.enabled)
        if self.enabled and ctx.backend == "nccl":
            self.folder.mkdir(parents=True, exist_ok=True)  # torch's dump opens its file there, making no folder

    def __enter__(self) -> HangWatch:
        if self.enabled:
            self.store = dist.distributed_c10d._get_default_store()
            # A signal's number reaches this pipe even while the main thread waits inside a collective, where its
            # Python handler (common.distributed's StopRequest) cannot run until the collective returns.
            self.wakeup = os.pipe()
            os.set_blocking(self.wakeup[1], False)
            self.previous_wakeup = signal.set_wakeup_fd(self.wakeup[1], warn_on_full_buffer=False)
            self.thread = threading.Thread(target=self._watch, name="hang watchdog", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, kind: type | None, err: BaseException | None, tb: object) -> None:
        if not self.enabled:
            return
        if err is not None and is_collective_failure(err):
            self.report_and_exit(f"a collective failed on rank {self.ctx.rank}: {first_line(err)}")
        self.done.set()
        self.stop_watching()
        with suppress(Exception):  # a rank that leaves writes no trace: a report need not wait for one
            self.store.add(KEY + "accounted", 1)

    def stop_watching(self) -> None:
        """The watchdog thread ended before training's context does. Left running, it could be inside the store's
        C++ call when the interpreter exits, which then ends the thread as it takes the GIL back, inside a C++
        destructor: the process aborts ("terminate called without an active exception") after a finished run. A
        run of the checkpoint benchmark ended so once in 9 (torch 2.14.1); this is one way to it, not proved the
        way it went."""
        assert self.wakeup is not None
        signal.set_wakeup_fd(self.previous_wakeup)
        with suppress(BlockingIOError):
            os.write(self.wakeup[1], b"\0")  # wakes the select: the thread sees done and returns
        self.thread.join(timeout=STOP_WAIT_S)
        if not self.thread.is_alive():  # else it still selects on the pipe (a store that stopped answering)
            for end in self.wakeup:
                os.close(end)

    def _watch(self) -> None:
        while not self.done.is_set():
            self._wait_for_signal()
            if self.done.is_set():  # training ended meanwhile: nothing to watch
                return
            reason = self._reason_to_stop()
            if reason is not None or self.store.check([KEY + "alarm"]):
                self.report_and_exit(reason or "another rank raised the alarm")

    def _wait_for_signal(self) -> None:
        """Wait up to POLL_S for a signal's number on the wakeup pipe, and note when the first stop signal came."""
        assert self.wakeup is not None
        ready, _, _ = select.select([self.wakeup[0]], [], [], POLL_S)
        if ready and any(number in STOP_SIGNALS for number in os.read(self.wakeup[0], 64)):
            self.signalled_at = time.monotonic() if self.signalled_at is None else self.signalled_at

    def _reason_to_stop(self) -> str | None:
        now, last = time.monotonic(), HangWatch.last_step_end
        if last is None or HangWatch.paused:  # before the first step's end, after the last, in evaluations and saves
            return None
        if now - last > self.timeout_s:
            return f"no step ended on rank {self.ctx.rank} for {now - last:.0f} s (--hang-timeout {self.timeout_s:g})"
        if self.signalled_at is not None:
            if last > self.signalled_at:
                self.signalled_at = None  # a step ended since: the stop request is on its way (StopRequest)
                return None
            # A stop acts at a step boundary: one that does not come soon is a rank blocked in a collective.
            grace = min(self.timeout_s, max(10.0, 3 * HangWatch.slowest_step))
            if now - self.signalled_at > grace:
                return f"a stop signal reached rank {self.ctx.rank}, and no step ended within {grace:.0f} s"
        return None

    def report_and_exit(self, reason: str) -> None:
        """Raise the alarm, write this rank's trace and stacks, wait for the others', report once, end the process."""
        if not self.handling.acquire(blocking=False):
            self.done.wait()  # the other path of this rank ends the process
            return
        try:
            mine = f"{self.ctx.rank} at {time.strftime('%Y-%m-%d %H:%M:%S')}: {reason}"  # the time tells hangs apart
            alarm = self.store.compare_set(KEY + "alarm", "", mine).decode()
            write_dumps(self.folder, self.ctx, reason, alarm)
            self.store.add(KEY + "accounted", 1)
            deadline = time.monotonic() + DUMPS_WAIT_S
            while int(self.store.add(KEY + "accounted", 0)) < self.ctx.world_size and time.monotonic() < deadline:
                time.sleep(0.2)  # polls the store's count, up to the deadline (a killed rank never adds to it)
            if self.store.compare_set(KEY + "reporter", "", str(self.ctx.rank)).decode() == str(self.ctx.rank):
                report = hang_report(self.folder)
                write_text(self.folder / REPORT_FILE, report + "\n", overwrite=True)  # this hang's report
                print(report, file=sys.stderr, flush=True)
                self.store.set(KEY + "reported", "1")
            else:
                self.store.wait([KEY + "reported"], timedelta(seconds=REPORT_WAIT_S))
        except Exception as err:  # the store went with torchrun: what this rank wrote is all there is
            print(f"rank {self.ctx.rank}: hang report incomplete ({first_line(err)}); see {self.folder}", flush=True)
        finally:
            sys.stdout.flush()
            os._exit(EXIT_CODE)


def is_collective_failure(err: BaseException) -> bool:
    """A collective that failed: NCCL's errors (DistError), gloo's (RuntimeError from its transport: a peer gone, a
    timeout)."""
    return isinstance(err, dist.DistError) or (isinstance(err, RuntimeError) and "gloo" in str(err))


def first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


def write_dumps(folder: Path, ctx: DistContext, reason: str, alarm: str) -> None:
    """This rank's Flight Recorder trace (torch's pickle, with what this hang is added) and its Python stacks."""
    c10d = torch._C._distributed_c10d
    trace = pickle.loads(c10d._dump_fr_trace())
    if ctx.backend == "nccl":  # NCCL's collectives have a recorder of their own, beside gloo's (the host group)
        nccl = pickle.loads(c10d._dump_nccl_trace())
        trace["entries"] += nccl.get("entries", [])
        trace["pg_config"] = {**trace.get("pg_config", {}), **nccl.get("pg_config", {})}
    main = sys.modules["__main__"]
    trace["hang"] = {
        "alarm": alarm,  # the first rank's reason: the same in every file of one hang
        "reason": reason,
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "script": str(Path(getattr(main, "__file__", "") or "").absolute()),
    }
    write_outputs(  # this hang's own: an earlier hang's files are replaced
        [
            (folder / f"{TRACE_PREFIX}{ctx.rank}", lambda file: file.write(pickle.dumps(trace))),
            (
                folder / f"{STACKS_PREFIX}{ctx.rank}.txt",
                lambda file: faulthandler.dump_traceback(file, all_threads=True),
            ),
        ],
        overwrite=True,
    )


# What reading a file that is plain data, but not a trace, raises.
NOT_A_TRACE = (KeyError, TypeError, ValueError, IndexError, AttributeError)


class HangFilesError(Exception):
    """RUN_DIR/hang/ holds no hang of this repository's scripts, or a trace cut short."""


class PlainData(pickle.Unpickler):
    """A Flight Recorder trace holds dicts, lists, strings and numbers only: anything that names code is refused,
    so a report never runs what a file of a run directory smuggles in."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"names {module}.{name}, which a trace never does")


def read_traces(folder: Path) -> dict[int, dict[str, Any]]:
    """Every rank's trace in ``folder`` of the newest hang (the alarm of the newest file), by rank."""
    paths = sorted(folder.glob(f"{TRACE_PREFIX}*"), key=lambda path: path.stat().st_mtime)
    if not paths:
        raise HangFilesError(f"{folder} holds no trace ({TRACE_PREFIX}N): this run did not stop on a hang")
    traces = []
    for path in paths:
        try:
            with path.open("rb") as file:
                trace = PlainData(file).load()
            rank, world_size = int(trace["hang"]["rank"]), int(trace["hang"]["world_size"])
            if not 0 <= rank < world_size:
                raise ValueError(f"rank {rank} of a world of {world_size}")
            traces.append((rank, trace["hang"]["alarm"], trace))
        except OSError as err:
            raise HangFilesError(f"{path} cannot be read: {err.strerror or err}") from None
        except (pickle.UnpicklingError, EOFError, *NOT_A_TRACE) as err:
            raise HangFilesError(f"{path} is cut short or not a trace of a hang ({reason(err)})") from None
    newest = traces[-1][1]  # files an earlier hang of this run directory left are not this one's
    return {rank: trace for rank, alarm, trace in traces if alarm == newest}


@dataclass(frozen=True)
class Call:
    """One collective as a rank recorded it."""

    group: str
    seq: int
    name: str
    sizes: list
    dtypes: list
    frames: list[dict[str, Any]]

    def text(self) -> str:
        return f"#{self.seq} {self.name} of group {self.group}, sizes {self.sizes} {'/'.join(set(self.dtypes))}"


def last_calls(trace: dict[str, Any]) -> dict[str, Call]:
    """Each group's newest collective in one rank's trace."""
    newest: dict[str, Call] = {}
    for entry in trace["entries"]:
        if entry.get("is_p2p"):
            continue
        group = entry["process_group"][1] or entry["process_group"][0]
        call = Call(group, entry["collective_seq_id"], entry["profiling_name"], entry["input_sizes"],
                    entry["input_dtypes"], entry.get("frames", []))  # fmt: skip
        if group not in newest or call.seq > newest[group].seq:
            newest[group] = call
    return newest


def is_in(file: str, script: str) -> bool:
    """Whether a frame's file is the script: the path it was started by may be relative (runpy keeps it so)."""
    path = Path(file)
    return file == script or (not path.is_absolute() and Path(script).parts[-len(path.parts) :] == path.parts)


def where(frames: list[tuple[str, int, str]], script: str) -> str:
    """The innermost frame outside torch, then the script's line (its innermost frame in it); frames innermost first."""
    own = [(file, line, name) for file, line, name in frames if is_in(file, script)][:1]
    outside_torch = [frame for frame in frames if "/torch/" not in frame[0] and "<frozen" not in frame[0]][:1]
    shown = [f"{Path(file).parent.name}/{Path(file).name}:{line} in {name}" for file, line, name in own]
    shown += [f"{Path(file).parent.name}/{Path(file).name}:{line} in {name}" for file, line, name in outside_torch
              if not is_in(file, script)]  # fmt: skip
    return " <- ".join(reversed(shown)) if shown else "no frame of the script"


def main_thread_frames(stacks: str) -> list[tuple[str, int, str]]:
    """The frames of the thread that runs the script, from faulthandler's text, innermost first."""
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", stacks):
        frames = [(f, int(n), name) for f, n, name in re.findall(r'File "(.+)", line (\d+) in (\S+)', block)]
        if frames and frames[-1][2] == "<module>":
            return frames
    return []


def stalled_group(calls: dict[int, dict[str, Call]]) -> str:
    """The process group whose ranks got to different collectives; else the default group (or any)."""
    groups = sorted({group for found in calls.values() for group in found})
    apart = [g for g in groups if len({found[g].seq for found in calls.values() if g in found}) > 1]
    return next(iter(apart), next((g for g in groups if "default" in g), groups[0] if groups else ""))


def hang_report(folder: Path) -> str:
    """The report of the newest hang in ``folder``: which rank stopped at which collective, which never entered it,
    and the script's line of each."""
    traces = read_traces(folder)
    try:
        return report_of(folder, traces)
    except NOT_A_TRACE as err:  # a file that unpickles to plain data, but not to what torch's recorder writes
        raise HangFilesError(f"{folder} holds a trace that is not the Flight Recorder's ({reason(err)})") from None


def reason(err: Exception) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def report_of(folder: Path, traces: dict[int, dict[str, Any]]) -> str:
    meta = next(iter(traces.values()))["hang"]
    script, world_size = meta["script"], int(meta["world_size"])
    calls = {rank: last_calls(trace) for rank, trace in traces.items()}
    group = stalled_group(calls)
    furthest = max((found[group].seq for found in calls.values() if group in found), default=0)
    missing = [rank for rank in range(world_size) if rank not in traces]
    behind = sorted(rank for rank, found in calls.items() if group not in found or found[group].seq < furthest)
    waiting = sorted(rank for rank, found in calls.items() if group in found and found[group].seq == furthest)
    kinds = {(calls[r][group].name, str(calls[r][group].sizes)) for r in waiting}
    culprits = missing + behind
    if culprits:
        first = f"rank(s) {', '.join(map(str, culprits))} never entered collective #{furthest} of group {group}"
    elif len(kinds) > 1:
        first = f"the ranks called different collectives as #{furthest} of group {group}"
    else:
        first = f"every rank entered collective #{furthest} of group {group}, and it never completed"
    lines = [f"HANG: {first}", f"  alarm: rank {meta['alarm']}"]
    for rank in waiting:
        call = calls[rank][group]
        frames = [(f["filename"], int(f["line"]), f["name"]) for f in call.frames]
        lines.append(f"  rank {rank}: stopped in {call.text()}, at {where(frames, script)}")
    for rank in behind:
        last = calls[rank].get(group)
        done = f"its last was #{last.seq} {last.name}" if last else "it issued none in this group"
        stacks_file = folder / f"{STACKS_PREFIX}{rank}.txt"
        stacks = stacks_file.read_text(errors="replace") if stacks_file.exists() else ""
        lines.append(f"  rank {rank}: never entered it ({done}); it was at {where(main_thread_frames(stacks), script)}")
    for rank in missing:
        lines.append(f"  rank {rank}: no trace: the process had ended (killed, crashed or aborted by its backend)")
    lines.append(f"  traces and Python stacks: {folder}/ (python -m tools.checks.hang_report {folder.parent})")
    return "\n".join(lines)
