"""When a job hangs, it ends with one report: which rank, which collective, which line (common/hangs.py).

Three hangs on gloo, 2 processes, each in a job of its own under torchrun: (a) rank 1 skips DDP's gradient all-reduce
once (a patch of a copy of ddp/train_transformer.py; gloo then aborts rank 1 at its next, mismatched, collective),
(b) rank 1 sleeps in data loading past --hang-timeout (a patch too), (c) rank 1 of an FSDP2 run is SIGKILLed mid-step
(tests/harness/inject_fault.py). Each job must end by itself within --hang-timeout + 30 s with a non-zero exit, print
one report naming rank 1, the collective and the script's line, leave a trace per live rank in RUN_DIR/hang/ and the
last complete checkpoint as it was. ``tools.checks.hang_report`` reads (a)'s folder to the same report afterwards.
"""

from __future__ import annotations

import os
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch

from common.bookkeeping import MetricsLog, ProgressReporter
from common.distributed import DistContext, distributed
from common.hangs import HANG_DIR, REPORT_FILE, STACKS_PREFIX, TRACE_PREFIX, HangWatch
from common.run_dir import complete_checkpoints
from tests.harness.copies import copy_common, project_env
from tests.harness.runs import REPO, Run, launcher_prefix, run_command, script_invocation
from tests.harness.wrappers import INJECT_FAULT
from tools.checks import hang_report

HANG_TIMEOUT_S = 6
ARGS = [
    *("--max-steps", "8", "--log-interval", "1", "--block-size", "32", "--train-sequences", "320"),
    *("--heldout-sequences", "40", "--checkpoint-interval", "2", "--hang-timeout", str(HANG_TIMEOUT_S)),
]
BACKWARD = "            loss.backward()\n"  # where DDP's reducer all-reduces the gradients
REPORT = "            run.report(step, epoch, loss, grad_norm, scheduler.get_last_lr()[0])  # on the steps that log\n"
LOAD = "            micro_batches = [next(batches) for _ in range(args.grad_accum_steps)]\n"
# (a): on rank 1, the third call's last micro-step skips DDP's gradient all-reduce (a branch only one rank takes).
SKIP_ALL_REDUCE = {
    "        with nullcontext() if last_micro_step else model.no_sync():\n": (
        "        forward_backward.calls = getattr(forward_backward, 'calls', 0) + 1\n"
        "        skip = ctx.rank == 1 and forward_backward.calls == 3\n"
        "        with nullcontext() if last_micro_step and not skip else model.no_sync():\n"
    )
}
# (b): rank 1 waits in data loading before step 4 (a file system that stopped answering).
SLEEP_IN_LOADING = {LOAD: "            if ctx.rank == 1 and step == 3:\n                time.sleep(3600)\n" + LOAD}


def patched_copy(project: Path, edits: dict[str, str]) -> Path:
    """A project with ddp/train_transformer.py's text edited (each text occurs once), as the zoo's patches are."""
    text = (REPO / "ddp" / "train_transformer.py").read_text().replace("import math\n", "import math\nimport time\n")
    for old, new in edits.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (copy_common(project) / "train_transformer.py").write_text(text)
    return project / "train" / "train_transformer.py"


def hang_of_patched_copy(project: Path, edits: dict[str, str]) -> tuple[Path, Run]:
    """The DDP script, edited as ``patched_copy`` does, run at 2 processes from its copy to the end of its hang."""
    script = patched_copy(project, edits)
    run_dir = project / "run"
    command = [*launcher_prefix(2), *script_invocation(str(script), ARGS, run_dir, [])]
    return script, run_hang(command, run_dir, project_env(project), project)


def line_of(script: Path, text: str) -> int:
    return script.read_text().splitlines(keepends=True).index(text) + 1


def run_hang(command: list[str], run_dir: Path, env: dict[str, str] | None = None, cwd: Path = REPO) -> Run:
    """The job to its end under torchrun; it must end by itself within --hang-timeout + 30 s (it is killed after)."""
    began = time.monotonic()
    run = run_command(command, run_dir, timeout=HANG_TIMEOUT_S + 90, env=env, cwd=cwd)
    elapsed = time.monotonic() - began
    assert run.returncode != 0, run.describe()
    # From the start: torchrun, two ranks and a few steps take 10 to 20 s of it here.
    assert elapsed < HANG_TIMEOUT_S + 30 + 20, f"took {elapsed:.0f} s\n{run.describe()}"
    assert not processes_naming(run_dir), run.describe()
    return run


def processes_naming(run_dir: Path) -> list[int]:
    """Processes whose command line names ``run_dir``: a rank left running."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if str(run_dir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def the_report(run: Run) -> str:
    """The one report the job printed; it is also RUN_DIR/hang/report.txt."""
    assert run.output.count("HANG:") == 1, run.describe()
    report = (run.run_dir / HANG_DIR / REPORT_FILE).read_text()
    assert report in run.output, run.describe()
    return report


def assert_traces_of(run: Run, ranks: list[int]) -> None:
    files = sorted(path.name for path in (run.run_dir / HANG_DIR).iterdir())
    per_rank = [name for r in ranks for name in (f"{TRACE_PREFIX}{r}", f"{STACKS_PREFIX}{r}.txt")]
    expected = sorted([REPORT_FILE, *per_rank])
    assert files == expected, run.describe()


def assert_checkpoint_intact(run: Run) -> None:
    """The newest complete checkpoint is step 2's (one every 2 steps, the hang in step 3 or 4) and loads."""
    (*_, newest) = complete_checkpoints(run.run_dir)
    assert newest.name.startswith("step-2"), run.describe()
    if newest.is_file():
        torch.load(newest, weights_only=True)


def test_a_rank_that_skips_an_all_reduce_is_named_and_the_command_reads_the_same_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """(a), and tools.checks.hang_report on its folder; on a folder of a run that never hung, or a trace cut short,
    the command says so in one line (exit code 1)."""
    script, run = hang_of_patched_copy(tmp_path, SKIP_ALL_REDUCE)
    run_dir = run.run_dir
    report = the_report(run)
    assert report.startswith("HANG: rank(s) 1 never entered collective #"), run.describe()
    # Rank 1 met a collective of another size where rank 0 all-reduced its gradients: gloo aborted it (no trace).
    assert "rank 1: no trace" in report, run.describe()
    backward = f"train_transformer.py:{line_of(script, BACKWARD)} in forward_backward"
    assert "rank 0: stopped in #" in report and "gloo:all_reduce" in report and backward in report, run.describe()
    assert_traces_of(run, [0])
    assert_checkpoint_intact(run)

    assert hang_report.main([str(run_dir)]) == 0
    assert capsys.readouterr().out == report
    finished = tmp_path / "finished"  # a run that never hung: no hang/ in it
    finished.mkdir()
    assert hang_report.main([str(finished)]) == 1
    said = capsys.readouterr()
    assert said.out == "" and said.err.count("\n") == 1 and "holds no trace" in said.err, said
    cut = tmp_path / "cut"
    shutil.copytree(run_dir / HANG_DIR, cut / HANG_DIR)
    trace = cut / HANG_DIR / f"{TRACE_PREFIX}0"
    trace.write_bytes(trace.read_bytes()[:1000])  # a dump cut short by a full disk
    assert hang_report.main([str(cut)]) == 1
    said = capsys.readouterr()
    assert said.out == "" and said.err.count("\n") == 1 and "is cut short or not a trace" in said.err, said


def test_a_rank_stuck_in_data_loading_is_named_with_its_line(tmp_path: Path) -> None:
    script, run = hang_of_patched_copy(tmp_path, SLEEP_IN_LOADING)
    report = the_report(run)
    assert report.startswith("HANG: rank(s) 1 never entered collective #"), run.describe()
    assert "no step ended on rank" in report and f"--hang-timeout {HANG_TIMEOUT_S}" in report, run.describe()
    backward = f"train_transformer.py:{line_of(script, BACKWARD)} in forward_backward"
    assert "rank 0: stopped in #" in report and backward in report, run.describe()
    sleeping = f"train_transformer.py:{line_of(script, '                time.sleep(3600)' + chr(10))} in train"
    assert "rank 1: never entered it" in report and sleeping in report, run.describe()
    assert_traces_of(run, [0, 1])
    assert_checkpoint_intact(run)


def test_a_rank_killed_mid_step_in_fsdp2_is_named(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    script = "fsdp/train_transformer_fsdp2.py"
    command = [*launcher_prefix(2), *script_invocation(script, ARGS, run_dir, [INJECT_FAULT, "sigkill"])]
    run = run_hang(command, run_dir)
    report = the_report(run)
    assert report.startswith("HANG: rank(s) 1 never entered collective #"), run.describe()
    assert "a collective failed on rank 0" in report and "rank 1: no trace" in report, run.describe()
    # Rank 1 died after its optimizer step of step 3; rank 0's next collective is the loss it logs (all-reduced).
    logged = f"train_transformer_fsdp2.py:{line_of(REPO / script, REPORT)} in train"
    assert "rank 0: stopped in #" in report and "in mean_over_ranks" in report and logged in report, run.describe()
    assert_traces_of(run, [0])
    assert_checkpoint_intact(run)


def test_a_stop_signal_is_a_hang_only_when_no_step_boundary_answers_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM or SIGUSR1 (torchrun's, when another worker died; the scheduler's) reaches a rank blocked in a
    collective: no step ends, and the watchdog reports after 3 slowest steps (10 s at least). A rank that is not
    blocked reaches a step boundary first, where common.distributed's StopRequest saves and stops."""
    ctx = DistContext(0, 0, 2, 2, torch.device("cpu"), "gloo")
    watch = HangWatch(tmp_path, ctx, timeout_s=300, enabled=False)  # only its clock: no thread, no variable set
    now = time.monotonic()
    monkeypatch.setattr(HangWatch, "slowest_step", 1.0)
    monkeypatch.setattr(HangWatch, "last_step_end", now - 12)
    watch.signalled_at = now - 11
    assert "a stop signal reached rank 0, and no step ended within 10 s" in (watch._reason_to_stop() or "")
    watch.signalled_at = now - 5
    assert watch._reason_to_stop() is None  # within the grace
    monkeypatch.setattr(HangWatch, "slowest_step", 5.0)
    watch.signalled_at = now - 11
    assert watch._reason_to_stop() is None  # slow steps: 3 of them, 15 s
    monkeypatch.setattr(HangWatch, "last_step_end", now - 1)  # a step ended after the signal
    watch.signalled_at = now - 100
    assert watch._reason_to_stop() is None and watch.signalled_at is None
    monkeypatch.setattr(HangWatch, "last_step_end", now - 301)
    assert "no step ended on rank 0 for 301 s (--hang-timeout 300)" in (watch._reason_to_stop() or "")


def test_the_watch_waits_out_evaluations_and_saves_and_rests_after_the_last_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a cluster a large held-out set, a checkpoint on a network file system, or the gather and write of model.pt
    after the last step can outlast --hang-timeout with every rank at work. Bookkeeping's paused, which every script
    puts around its evaluations and saves, holds the watch's clock and starts it again at its end (a stop signal
    meanwhile waits for the step boundary after it); the last step's report stops the clock."""
    watch = HangWatch(tmp_path, DistContext(0, 0, 2, 2, torch.device("cpu"), "gloo"), timeout_s=300, enabled=False)
    monkeypatch.setattr(HangWatch, "paused", 0)
    monkeypatch.setattr(HangWatch, "last_step_end", time.monotonic() - 301)
    one = torch.tensor(1.0)
    with distributed("cpu", 60) as ctx:
        reporter = ProgressReporter(MetricsLog(tmp_path, ctx), ctx, 2, 10, 1, 0)  # 2 steps
        with reporter.paused():  # 301 s after the last step's end, and a stop signal 100 s ago
            watch.signalled_at = time.monotonic() - 100
            assert watch._reason_to_stop() is None
        assert watch._reason_to_stop() is None and watch.signalled_at is None  # the clock runs from the save's end
        reporter.report(1, 1, one, one, 0.1)
        monkeypatch.setattr(HangWatch, "last_step_end", time.monotonic() - 301)
        assert "no step ended on rank 0 for 301 s" in (watch._reason_to_stop() or "")  # between steps it counts
        reporter.report(2, 1, one, one, 0.1)  # the last step
        assert HangWatch.last_step_end is None and watch._reason_to_stop() is None


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs: NCCL takes one GPU per rank")
def test_on_nccl_the_report_names_the_rank_and_torch_dumps_its_own_trace_on_a_timeout(tmp_path: Path) -> None:
    """(b) on NCCL: the watchdog's report as on gloo; then with --hang-timeout above --dist-timeout, NCCL's own
    watchdog times the collective out and writes its Flight Recorder trace into RUN_DIR/hang/ (nccl_trace_rank_N)."""
    script = patched_copy(tmp_path, SLEEP_IN_LOADING)
    for name, flags in [("ours", []), ("torch's", ["--dist-timeout", "10", "--hang-timeout", "120"])]:
        run_dir = tmp_path / name
        # script_invocation passes --device cpu first: the later --device cuda wins.
        invocation = script_invocation(str(script), [*ARGS, *flags, "--device", "cuda"], run_dir, [])
        run = run_hang([*launcher_prefix(2), *invocation], run_dir, project_env(tmp_path), tmp_path)
        if name == "ours":
            report = the_report(run)
            assert report.startswith("HANG: rank(s) 1 never entered collective #"), run.describe()
            assert "nccl:all_reduce" in report and "rank 1: never entered it" in report, run.describe()
        else:
            dumps = sorted((run_dir / HANG_DIR).glob("nccl_trace_rank_*"))
            assert dumps, run.describe()
            assert all(pickle.loads(dump.read_bytes())["entries"] for dump in dumps), run.describe()


def test_the_watchdog_thread_has_ended_when_training_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A watchdog still polling the store at the interpreter's exit aborted a finished run (rank 1 of one run of the
    checkpoint benchmark in 9: "terminate called without an active exception"): it ends with the context."""
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE"):
        monkeypatch.setenv(name, "kept")  # the watch keeps a variable set already; monkeypatch restores each
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_store", torch.distributed.HashStore)
    ctx = DistContext(0, 0, 2, 2, torch.device("cpu"), "gloo")
    with HangWatch(tmp_path, ctx, timeout_s=300, enabled=True) as watch:
        assert watch.thread.is_alive()
    assert not watch.thread.is_alive()
    assert watch.store.add("hang/accounted", 0) == 1  # this rank counted as gone: a report would not wait for it


class RunsCode:
    def __reduce__(self) -> tuple:
        return (os.system, ("echo the report ran code",))


HANG = {"rank": 0, "alarm": "0 at noon: test", "reason": "test", "world_size": 2, "script": "train.py"}
HOSTILE_TRACES = {
    "a folder by a trace's name": (None, "cannot be read: Is a directory"),
    "a pickle that runs code": ({"hang": HANG, "entries": [RunsCode()]}, "names posix.system"),
    "no entries": ({"hang": HANG}, "not the Flight Recorder's (KeyError: 'entries')"),
    "an entry without its group": ({"hang": HANG, "entries": [{"collective_seq_id": 1}]}, "KeyError: 'process_group'"),
    "entries that are text": ({"hang": HANG, "entries": "text"}, "AttributeError"),
    "a rank outside its world": ({"hang": {**HANG, "rank": 5}, "entries": []}, "rank 5 of a world of 2"),
}


@pytest.mark.parametrize("case", HOSTILE_TRACES)
def test_a_trace_that_is_not_one_is_one_message(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Files of a run directory are anyone's: each of these is one line naming what is wrong, exit code 1."""
    content, message = HOSTILE_TRACES[case]
    trace = tmp_path / HANG_DIR / f"{TRACE_PREFIX}0"
    if content is None:
        trace.mkdir(parents=True)
    else:
        trace.parent.mkdir()
        trace.write_bytes(pickle.dumps(content))
    assert hang_report.main([str(tmp_path)]) == 1
    said = capsys.readouterr()
    assert said.out == "" and said.err.count("\n") == 1 and message in said.err, said
