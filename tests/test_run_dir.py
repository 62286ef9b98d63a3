"""A run directory keeps what earlier runs saved, whatever the next run does or meets.

Tried from the user's side: a second run on the same folder, a fresh run over a
finished one, a killed run, a stop request during startup, weights that
overflow, a disk that fills mid-run and one that is read-only. The disks are
real: a tmpfs of a few MiB in a mount namespace of the test's own (``unshare``),
which the runs' ranks join, filled by tests/harness/inject_fault.py until the kernel
answers ENOSPC.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from common.bookkeeping import MetricsLog
from common.distributed import StopRequest, distributed
from common.run_dir import LOCK_FILE, PREEMPTED_FILE, STOP_FILE, RunDirLock, checkpoint_step, complete_checkpoints
from common.safe_io import then_resume
from tests.harness.runs import (
    REPO,
    Run,
    clean_env,
    kill_all,
    launcher_prefix,
    run_command,
    run_script,
    run_warm,
    script_invocation,
)
from tests.harness.wrappers import INJECT_FAULT

SCRIPT = "ddp/train_transformer.py"
SMALL = ["--block-size", "32", "--train-sequences", "320", "--heldout-sequences", "40"]
# A traceback through this repository's code: what "one message" rules out (torchrun's own summary
# of a failed worker is torchrun's, and comes with any non-zero exit).
OUR_TRACEBACK = re.compile(r'File "[^"]*/(common|ddp|fsdp)/')


def one_message(run: Run, text: str) -> None:
    """``text`` is said once, as the run's only error, and no rank printed a traceback through our code."""
    assert run.returncode != 0, run.describe()
    assert run.output.count(text) == 1, run.describe()
    assert run.output.count("error:") == 1, run.describe()
    assert not OUR_TRACEBACK.search(run.output), run.describe()
    # What a real interpreter prints when a finalizer fails at exit (a __del__, a thread): a second message.
    assert "Exception ignored" not in run.output, run.describe()


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes, to show that nothing was touched."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


# -- a run directory belongs to one run ----------------------------------------------------------


def finished_run(run_dir: Path) -> dict[str, bytes]:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"event": "final", "steps": 600}\n')
    (run_dir / "model.pt").write_bytes(b"the weights of a finished run")
    return tree(run_dir)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "already holds an earlier run (metrics.jsonl, model.pt); a fresh run would replace it"),
        (["--resume"], "holds a finished run's model.pt and no checkpoint to continue from"),
    ],
    ids=["fresh", "resume-without-checkpoint"],
)
def test_a_new_run_never_replaces_a_finished_one(args: list[str], message: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    before = finished_run(run_dir)
    run = run_script(SCRIPT, [*SMALL, "--max-steps", "2", *args], run_dir)
    one_message(run, message)
    assert tree(run_dir) == before


def test_another_runs_checkpoint_does_not_continue_in_a_used_run_dir(tmp_path: Path) -> None:
    other = tmp_path / "other" / "checkpoints" / "step-5.pt"
    other.parent.mkdir(parents=True)
    other.write_bytes(b"a checkpoint of another run")
    run_dir = tmp_path / "run"
    before = finished_run(run_dir)
    run = run_script(SCRIPT, [*SMALL, "--resume-from", str(other)], run_dir)
    one_message(run, "is another run's checkpoint, and --run-dir")
    assert tree(run_dir) == before


def wait_for_output(process: subprocess.Popen, text: str, timeout: float) -> str:
    """What ``process`` printed up to the first line holding ``text``; fails showing it all if none comes."""
    seen = b""
    deadline = time.monotonic() + timeout
    while text.encode() not in seen:
        left = deadline - time.monotonic()
        ready = select.select([process.stdout], [], [], max(0, left))[0] if left > 0 else []
        chunk = os.read(process.stdout.fileno(), 65536) if ready else b""  # type: ignore[union-attr]
        if not chunk:
            kill_all(process.pid)
            pytest.fail(f"no {text!r} within {timeout} s (exit {process.poll()})\n{seen.decode(errors='replace')}")
        seen += chunk
    return seen.decode(errors="replace")


def test_one_run_at_a_time_and_a_killed_run_leaves_no_lock(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*SMALL, "--checkpoint-interval", "2", "--log-interval", "1"]
    command = [sys.executable, *script_invocation(SCRIPT, [*args, "--max-steps", "100000"], run_dir, [])]
    first = subprocess.Popen(command, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_output(first, "checkpoint:", 120)
        # Started again on the same folder (a job submitted twice): refused before it reads or writes anything.
        second = run_script(SCRIPT, [*args, "--resume", "--max-steps", "4"], run_dir)
        one_message(second, f"is in use by another run (pid {first.pid} on ")
        assert "resumed from" not in second.output, second.describe()
    finally:
        kill_all(first.pid)  # SIGKILL: no chance to release anything by itself
        first.communicate()
    newest = complete_checkpoints(run_dir)[-1]
    steps = str(checkpoint_step(newest) + 2)  # type: ignore[operator]
    third = run_script(SCRIPT, [*args, "--resume", "--max-steps", steps], run_dir).check()
    assert f"resumed from {newest}" in third.output, third.describe()


@pytest.mark.parametrize("make", [Path.touch, Path.mkdir], ids=["file", "folder"])
def test_a_stop_request_during_startup_stops_the_run(make: Callable[[Path], None], tmp_path: Path) -> None:
    """A STOP made with mkdir asks as `touch STOP` does: it was an IsADirectoryError traceback after the save.

    Made before the run starts, so it is there through all of the run's startup: made when the run
    printed a line, it raced the first step's look at it (under load the run took a step first).
    """
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    make(run_dir / "STOP")
    invocation = script_invocation(SCRIPT, [*SMALL, "--max-steps", "50"], run_dir, [])
    run = run_warm(invocation, run_dir, None, 120).check()
    assert run.output.count("stopped at step 0 on request (a STOP file)") == 1, run.describe()
    assert (run_dir / "PREEMPTED").exists() and not (run_dir / "STOP").exists()
    assert [path.name for path in complete_checkpoints(run_dir)] == ["step-0.pt"]


# -- weights that overflow ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("ddp/train_transformer.py", ["--checkpoint-interval", "3"], "the weights after step 3 are not finite"),
        # FSDP: rank 0 gathers the whole model for model.pt, rank 1's infinite shard included.
        ("fsdp/train_transformer.py", ["--max-steps", "3"], "the final weights are not finite"),
    ],
    ids=["checkpoint", "model.pt"],
)
def test_weights_that_overflow_are_never_saved(script: str, args: list[str], message: str, tmp_path: Path) -> None:
    """A finite loss does not make the update after it finite: rank 1's weights overflow at step 3."""
    run_dir = tmp_path / "run"
    flags = [*SMALL, "--max-steps", "6", "--log-interval", "1", *args]
    run = run_script(script, flags, run_dir, nproc=2, wrapper=[INJECT_FAULT, "overflow"])
    one_message(run, message)
    assert run.returncode == 1, run.describe()
    assert [record["step"] for record in run.events("train")] == [1, 2, 3], "the loss of step 3 was finite"
    assert complete_checkpoints(run_dir) == [] and not (run_dir / "model.pt").exists()


# -- real disks: full, and read-only -----------------------------------------------------------


@contextmanager
def small_disk(tmp_path: Path, size: str, read_only: bool) -> Iterator[int]:
    """A tmpfs of ``size`` at tmp_path/disk, in a user and mount namespace of its own; yields the id of the
    shell that holds them, whose namespaces the runs join. On exit what the disk holds is copied to tmp_path/kept.

    The tmpfs is gone with the shell, whatever happens to the test; only processes in its namespace see it.
    """
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    kept.mkdir()
    mount = f"mount -t tmpfs -o size={size} tmpfs {disk}"
    if read_only:
        mount += f" && mkdir {disk}/run && mount -o remount,ro {disk}"
    shell = f"{mount} && echo mounted && read done; cp -a {disk}/. {kept}/"
    holder = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", shell],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        said = holder.stdout.readline()  # type: ignore[union-attr]
        assert said == "mounted\n", f"no tmpfs: {said}{holder.communicate(timeout=30)[0]}"
        yield holder.pid
        holder.communicate("\n", timeout=60)
    finally:
        kill_all(holder.pid)


def run_on_a_small_disk(
    tmp_path: Path,
    script: str,
    args: list[str],
    nproc: int | None,
    fault: str | None = None,
    size: str = "64m",
    read_only: bool = False,
    real_launcher: bool = False,
) -> Run:
    """``script``, its run dir (tmp_path/disk/run) on a ``small_disk``; what it left is then in tmp_path/kept/run.

    ``real_launcher``: python or torchrun itself, started in the disk's namespaces by ``nsenter``, for what
    only a real interpreter's shutdown would show: the warm launcher's ranks end with ``os._exit``, which
    runs no finalizer, so none can print an error there.
    """
    wrapper = [INJECT_FAULT, fault] if fault else []
    invocation = script_invocation(script, args, tmp_path / "disk" / "run", wrapper)
    kept = tmp_path / "kept" / "run"
    with small_disk(tmp_path, size, read_only) as holder:
        if not real_launcher:
            return run_warm(invocation, kept, nproc, 150, namespaces_of=holder)
        enter = ["nsenter", f"--target={holder}", "--user", "--mount", f"--wd={REPO}"]
        return run_command([*enter, *launcher_prefix(nproc), *invocation], kept, 150)


def leftovers(folder: Path) -> list[str]:
    return [str(path) for path in folder.rglob("*") if path.name.startswith(".tmp")]


# Full after step 3 of a run that saves every 2 steps: the save at step 4 meets it.
CHECKPOINT_ON_FULL_DISK = [*SMALL, "--max-steps", "8", "--checkpoint-interval", "2", "--log-interval", "100"]


@pytest.mark.parametrize(
    ("script", "saved"),
    [("ddp/train_transformer.py", "step-2.pt"), ("fsdp/train_transformer.py", "step-2")],
    ids=["ddp-full", "fsdp-sharded"],
)
def test_a_full_disk_at_a_checkpoint_is_one_message_and_keeps_the_last(script: str, saved: str, tmp_path: Path) -> None:
    run = run_on_a_small_disk(tmp_path, script, CHECKPOINT_ON_FULL_DISK, 2, "fill-disk@3")
    one_message(run, "No space left on device")
    assert run.returncode == 1, run.describe()
    step = "step-4.pt" if saved.endswith(".pt") else "step-4"
    assert f"could not write checkpoint {tmp_path}/disk/run/checkpoints/{step}" in run.output, run.describe()
    kept = tmp_path / "kept" / "run"
    assert [path.name for path in complete_checkpoints(kept)] == [saved], run.describe()
    assert leftovers(kept) == [], run.describe()
    if saved.endswith(".pt"):
        state = torch.load(kept / "checkpoints" / saved, weights_only=True)
        assert state["trainer"]["step"] == 2


@pytest.mark.parametrize(
    ("fault", "steps", "unwritten"),
    # tmpfs gives a file a page at a time: metrics.jsonl meets the full disk when its 4 KiB page is.
    [("fill-disk@3", 40, "metrics.jsonl"), ("fill-disk@3,leave=64", 4, "model.pt")],
    ids=["metrics", "model.pt"],
)
def test_a_full_disk_without_checkpoints_is_one_message(fault: str, steps: int, unwritten: str, tmp_path: Path) -> None:
    """The default --checkpoint-interval 0: the disk fills before the run's last write."""
    args = [*SMALL, "--max-steps", str(steps), "--log-interval", "1"]
    # One case through a real interpreter: its shutdown after the failure is part of what the user sees.
    run = run_on_a_small_disk(tmp_path, SCRIPT, args, None, fault, real_launcher=unwritten == "metrics.jsonl")
    one_message(run, f"could not write {tmp_path}/disk/run/{unwritten}: No space left on device")
    assert "this run has saved no checkpoint" in run.output, run.describe()
    assert leftovers(tmp_path / "kept") == [] and not (tmp_path / "kept" / "run" / "model.pt").exists()


def test_a_disk_too_small_for_the_run_is_refused_before_training(tmp_path: Path) -> None:
    args = [*SMALL, "--max-steps", "4", "--checkpoint-interval", "2"]
    run = run_on_a_small_disk(tmp_path, SCRIPT, args, None, size="2m")
    one_message(run, "this run needs about")
    assert "step " not in run.output.split("this run needs about")[0], "refused before the first step"
    assert list((tmp_path / "kept").iterdir()) == [], "a refused run leaves nothing"


def test_a_read_only_run_dir_is_refused_first(tmp_path: Path) -> None:
    run = run_on_a_small_disk(tmp_path, SCRIPT, SMALL, None, read_only=True)
    one_message(run, f"--run-dir: {tmp_path}/disk/run: cannot create anything in {tmp_path}/disk/run (Read-only")
    assert "model:" not in run.output, "refused before the model was built"


def test_metrics_deleted_under_a_run_start_again_and_it_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An rm -rf of the run dir mid-run: appending to the deleted file would lose every record in silence."""
    run_dir = tmp_path / "run"
    with distributed("cpu", 60) as ctx:
        log = MetricsLog(run_dir, ctx)
        log.write("train", step=1)
        shutil.rmtree(run_dir)
        log.write("train", step=2)
        log.close()
    assert capsys.readouterr().out.count("metrics.jsonl was deleted while this run wrote it") == 1
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [2]


def test_metrics_moved_under_a_run_start_again_and_it_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run dir renamed mid-run: the open file went with it, and the run went on writing there in silence."""
    run_dir = tmp_path / "run"
    with distributed("cpu", 60) as ctx:
        log = MetricsLog(run_dir, ctx)
        log.write("train", step=1)
        run_dir.rename(tmp_path / "moved")
        log.write("train", step=2)
        log.close()
    assert capsys.readouterr().out.count("metrics.jsonl was moved or replaced while this run wrote it") == 1
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [2]
    assert [json.loads(line)["step"] for line in (tmp_path / "moved" / "metrics.jsonl").read_text().splitlines()] == [1]


@pytest.fixture
def signal_handlers() -> Iterator[None]:
    """What StopRequest installs in this process is put back after the test."""
    numbers = (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGUSR1)
    saved = {number: signal.getsignal(number) for number in numbers}
    yield
    for number, handler in saved.items():
        signal.signal(number, handler)


@pytest.mark.usefixtures("signal_handlers")
def test_ctrl_c_asks_for_a_stop_and_a_second_one_ends_the_run_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C mid-run was a KeyboardInterrupt traceback on every rank, and the steps since the last checkpoint
    were lost. The first is now a stop request, as SIGTERM is; a second does not wait for the step to end."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, whatever started pytest
    try:
        with pytest.raises(SystemExit) as exit_info, distributed("cpu", 60) as ctx:
            stop = StopRequest(tmp_path / STOP_FILE, tmp_path / PREEMPTED_FILE, ctx)
            os.kill(os.getpid(), signal.SIGINT)  # os.kill runs the handler before it returns
            assert stop.requested() and stop.received == "SIGINT"
            os.kill(os.getpid(), signal.SIGINT)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C reached the top as a KeyboardInterrupt: a traceback from every rank")
    assert exit_info.value.code == 128 + signal.SIGINT
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.err.count("\n") == 1, captured.err
    assert "interrupted (SIGINT)" in captured.err and "--resume" in captured.err


def test_metrics_replaced_by_a_folder_is_one_message_that_does_not_blame_the_disk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder took metrics.jsonl's name mid-run: the message said to free some space, on a disk with room."""
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info, distributed("cpu", 60) as ctx:
        log = MetricsLog(run_dir, ctx)
        log.write("train", step=1)
        (run_dir / "metrics.jsonl").unlink()
        (run_dir / "metrics.jsonl").mkdir()
        log.write("train", step=2)
    error = capsys.readouterr().err
    assert exit_info.value.code == 1 and error.count("error:") == 1, error
    assert "metrics.jsonl: Is a directory" in error and "Free some space" not in error, error
    assert then_resume("No space left on device (errno 28)").startswith("Free some space")  # a full disk still is


def test_a_run_dir_deleted_under_a_run_is_locked_again(tmp_path: Path) -> None:
    """After an rm -rf of the run dir the run made it again without its lock: a second run with --resume took
    the folder, and the two pruned and replaced each other's checkpoints and metrics.jsonl."""
    run_dir = tmp_path / "run"
    with distributed("cpu", 60) as ctx, RunDirLock(run_dir, ctx) as lock:
        log = MetricsLog(run_dir, ctx, lock=lock)
        log.write("train", step=1)
        shutil.rmtree(run_dir)
        log.write("train", step=2)
        second_run = os.open(run_dir / LOCK_FILE, os.O_RDWR)  # another open of the file: a lock of its own
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(second_run, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(second_run)
        log.close()
