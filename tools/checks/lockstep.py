"""The rank side of the pre-flight: each collective's fingerprint, held back until every rank of its group
agrees on it.

Runs inside every rank that ``python -m tools.checks.preflight`` starts: it wraps the user's script in a collective
recorder, publishes what each collective would be through the job's store, and waits (bounded) for the
other ranks' own. A rank that sees a different collective, an ended peer or a peer that never came writes
its report and stops without issuing it. Each rank's report is one JSON file in the report folder, which
the launching process reads (``read_reports``). Torch is imported inside the functions that a rank runs:
the launching process imports this module for ``read_reports`` and has no use for torch.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import runpy
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from common.outputs import write_text

STOPPED = 1  # a rank that stops before a collective exits non-zero: torchrun then ends the run


@dataclass
class Fingerprint:
    """What one rank is about to issue; two ranks' fingerprints of the same collective must be equal."""

    op: str
    kind: str
    group: list[int]
    tensors: list[str]  # dtype and shape of each tensor argument whose shape is the same on every rank
    scalars: list[str]  # root ranks, reduce ops given as strings, split sizes...
    script_line: str  # "file:line" of the innermost frame in the user's script
    innermost: str  # "file:line in function": where torch.distributed was called from

    def same_collective(self, other: Fingerprint) -> bool:
        # The script line counts: in an SPMD script every rank issues a collective from the same
        # line, and one that pairs with a collective of another line pairs the wrong data, silently
        # when kind, shapes and dtypes agree (two all-reduces of one float, of different meanings).
        mine, theirs = asdict(self), asdict(other)
        return all(mine[name] == theirs[name] for name in ("op", "group", "tensors", "scalars", "script_line"))


# Arguments whose shapes differ between ranks by design: a gather's outputs exist on its root only,
# a scatter's inputs likewise, and an all-to-all's tensors follow each rank's split sizes.
RANK_DEPENDENT_ARGUMENTS = {
    "c10d::gather_": {"output_tensors"},
    "c10d::scatter_": {"input_tensors"},
    "c10d::alltoall_": {"output_tensors", "input_tensors"},
    "c10d::alltoall_base_": {"output", "input", "output_split_sizes", "input_split_sizes"},
    "_c10d_functional::all_to_all_single": {"input", "output_split_sizes", "input_split_sizes"},
}
IGNORED_ARGUMENTS = {"timeout", "group_name", "tag", "async_op", "asyncOp"}  # the group is compared as its ranks


def describe_tensor(tensor: Any) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}[{','.join(str(size) for size in tensor.shape)}]"


def fingerprint(func: Any, kind: str, group: Any, args: tuple, kwargs: dict, script: str) -> Fingerprint:
    import torch
    import torch.distributed as dist
    from torch.utils._pytree import tree_leaves

    from common.collectives import is_process_group, named_arguments

    op = func._schema.name
    skipped = RANK_DEPENDENT_ARGUMENTS.get(op, set()) | IGNORED_ARGUMENTS
    tensors, scalars = [], []
    for name, value in named_arguments(func._schema, args, kwargs).items():
        if name in skipped or is_process_group(value):
            continue
        leaves = tree_leaves(value)
        tensors += [f"{name}: {describe_tensor(t)}" for t in leaves if isinstance(t, torch.Tensor)]
        scalars += [f"{name}={leaf}" for leaf in leaves if isinstance(leaf, int | float | str | bool)]
    script_line, innermost = call_sites(script)
    return Fingerprint(op, kind, dist.get_process_group_ranks(group), tensors, scalars, script_line, innermost)


_THIS_FILE = os.path.realpath(__file__)


@functools.cache
def _real_path(filename: str) -> str:
    return os.path.realpath(filename)


@functools.cache
def _torch_folder() -> str:
    import torch  # here, not at the top: the parent process never needs torch

    return os.path.realpath(os.path.dirname(torch.__file__)) + os.sep


def call_sites(script: str) -> tuple[str, str]:
    """The innermost frame in ``script``, and the innermost outside torch (the script's or a helper's, such
    as common/training.py), each as "file:line"; torch's own frame would be the same for every all-reduce."""
    frame, script_line, innermost = sys._getframe(1), "", ""
    while frame is not None and not script_line:
        path = _real_path(frame.f_code.co_filename)
        plumbing = (
            path == _THIS_FILE or path.startswith(_torch_folder()) or frame.f_code.co_name == "__torch_dispatch__"
        )
        if not innermost and not plumbing:
            innermost = f"{shorten(path)}:{frame.f_lineno} in {frame.f_code.co_name}"
        if path == script:
            script_line = f"{shorten(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return script_line or "(not inside the script)", innermost


def shorten(path: str) -> str:
    """A path relative to the working directory when it is below it; torch's files from their package."""
    marker = f"{os.sep}site-packages{os.sep}"
    if marker in path:
        return path.split(marker, 1)[1]
    with contextlib.suppress(ValueError):
        return str(Path(path).relative_to(Path.cwd()))
    return path


@dataclass
class Peer:
    """What another rank published for the collective this rank waits at: its fingerprint, or its end."""

    rank: int
    fingerprint: dict | None = None
    ended: dict | None = None  # {"how": ..., "detail": ..., "issued": ...} when it ended first
    last: dict | None = None  # its last fingerprint, when it neither published nor ended in time


class Lockstep:
    """The store protocol: publish collective n on a group, wait for the group's other members' n.

    Keys live under a PrefixStore of the job's own store (MASTER_ADDR:MASTER_PORT): no port of its
    own to pick, and nothing left behind once the job's store goes.
    """

    def __init__(self, store: Any, rank: int, wait_s: float) -> None:
        self.store, self.rank, self.wait_s = store, rank, wait_s
        self.counts: Counter[str] = Counter()

    def publish(self, group_name: str, fp: Fingerprint) -> int:
        self.counts[group_name] += 1
        n = self.counts[group_name]
        text = json.dumps(asdict(fp) | {"n": n, "group_name": group_name})
        self.store.set(f"c/{group_name}/{n}/{self.rank}", text)
        self.store.set(f"last/{self.rank}", text)
        return n

    def await_peer(self, group_name: str, n: int, peer: int) -> Peer:
        """Poll the store, bounded: a peer's collective n, its end marker, or the bound running out."""
        key, ended = f"c/{group_name}/{n}/{peer}", f"ended/{peer}"
        deadline = time.monotonic() + self.wait_s
        while True:
            if self.store.check([key]):
                return Peer(peer, fingerprint=json.loads(self.store.get(key)))
            if self.store.check([ended]):
                return Peer(peer, ended=json.loads(self.store.get(ended)))
            if time.monotonic() >= deadline:
                last = f"last/{peer}"
                return Peer(peer, last=json.loads(self.store.get(last)) if self.store.check([last]) else None)
            with contextlib.suppress(Exception):  # the short wait running out is the normal case
                self.store.wait([key], timedelta(milliseconds=50))

    def end(self, how: str, detail: str = "") -> None:
        issued = sum(self.counts.values())
        self.store.set(f"ended/{self.rank}", json.dumps({"how": how, "detail": detail, "issued": issued}))


def make_lockstep_recorder(lockstep: Lockstep, script: str, report_dir: Path) -> Any:
    """A CollectiveRecorder that holds each collective back until the group agrees on it (built here,
    not at import: the parent never imports torch)."""
    from common.collectives import CollectiveRecorder

    class LockstepRecorder(CollectiveRecorder):
        def before_collective(self, func: Any, kind: str, group: Any, args: tuple, kwargs: dict) -> None:
            if kind == "send_recv":
                return  # one side sends, the other receives: there is nothing to pair
            fp = fingerprint(func, kind, group, args, kwargs, script)
            n = lockstep.publish(group.group_name, fp)
            for peer in fp.group:
                if peer == lockstep.rank:
                    continue
                seen = lockstep.await_peer(group.group_name, n, peer)
                if seen.fingerprint is not None and Fingerprint(
                    **{k: seen.fingerprint[k] for k in Fingerprint.__dataclass_fields__}
                ).same_collective(fp):
                    continue
                stop_before_collective(lockstep, report_dir, fp, n, seen)

    return LockstepRecorder()


def stop_before_collective(lockstep: Lockstep, report_dir: Path, fp: Fingerprint, n: int, seen: Peer) -> None:
    """Write this rank's report and end the process without issuing the collective: issued, it would hang."""
    verdict = "mismatch" if seen.fingerprint is not None else "peer_ended" if seen.ended is not None else "timeout"
    write_report(report_dir, lockstep.rank, {"verdict": verdict, "n": n, "mine": asdict(fp), "peer": asdict(seen)})
    lockstep.end(verdict, f"collective #{n} on group {fp.group}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(STOPPED)


def write_report(report_dir: Path, rank: int, report: dict) -> None:
    # Renamed into place whole: a reader never sees half a report. Each rank writes its own, once.
    write_text(report_dir / f"rank-{rank}.json", json.dumps(report | {"rank": rank}), overwrite=True)


def read_reports(report_dir: Path) -> dict[int, dict]:
    reports = {}
    for path in sorted(report_dir.glob("rank-*.json")):
        with contextlib.suppress(OSError, ValueError):
            report = json.loads(path.read_text())
            reports[report["rank"]] = report
    return reports


def job_store(prefix: str) -> Any:
    """A client of the job's store (torchrun's agent or the test launcher serves it), under ``prefix``."""
    import torch.distributed as dist

    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
    )
    return dist.PrefixStore(prefix, client)


def run_rank(script: str, flags: list[str], report_dir: Path, wait_s: float) -> None:
    """One rank: the script as ``python SCRIPT FLAGS`` runs it, every collective held to lockstep."""
    rank = int(os.environ.get("RANK", "0"))
    lockstep = Lockstep(job_store("preflight"), rank, wait_s)
    recorder = make_lockstep_recorder(lockstep, os.path.realpath(script), report_dir)
    sys.argv = [script, *flags]
    # As `python SCRIPT` puts the script's folder first: a copy imports the model file beside it.
    sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
    ended: tuple[str, str, int] = ("returned", "", 0)
    try:
        with recorder:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        ended = ("returned", "", 0) if code == 0 else ("exited", f"exit code {code}", code)
        raise
    except BaseException as err:
        ended = (
            "raised",
            "".join(traceback.format_exception(type(err), err, from_script(err.__traceback__, script))),
            1,
        )
        raise
    finally:
        how, detail, code = ended
        totals = Counter()
        for c in recorder.collectives:
            totals[f"{c.kind} count"] += 1
            totals[f"{c.kind} bytes"] += c.message_bytes
        write_report(report_dir, rank, {"verdict": how, "detail": detail, "code": code, "totals": dict(totals)})
        lockstep.end(how, detail)


def from_script(tb: Any, script: str) -> Any:
    """The traceback from the script's first frame on: the pre-flight's own and runpy's frames say nothing."""
    start = tb
    while start is not None and _real_path(start.tb_frame.f_code.co_filename) != os.path.realpath(script):
        start = start.tb_next
    return start or tb
