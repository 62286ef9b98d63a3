"""The SLURM launchers against real Slurm: one slurmctld and two slurmd on this machine.

tests/harness/slurm_cluster.py starts the cluster once for the session. The cases share it, so under -n they
all run on one pytest-xdist worker (tests/conftest.py's scheduler), and jobs that can share the
cluster do: the time-limit job runs in the background while the others run.

Every job is submitted with the real sbatch from a checkout of its own, as a user of a small
CPU-only cluster would submit it, with only what such a cluster needs changed:

    NPROC_PER_NODE=P sbatch --gpus-per-node=0 --cpus-per-task=P [--nodes=2] slurm/ddp.sbatch ...

--gpus-per-node=0: the launchers ask for 8 GPUs, and Slurm refuses the job on a cluster without
any ("Invalid generic resource (gres) specification"). --cpus-per-task=P: they ask for 64 CPUs; a
job asking for more than a node has is accepted and then pends forever (Reason=PartitionConfig).
NPROC_PER_NODE: with no GPUs to count, the launchers start one process per node. The time-limit
case also sets --time and --signal. The tests read what a user reads: scontrol's JobState,
ExitCode and Restarts, the job's <name>-<id>.out in the submit directory, and the run directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TypeVar

import pytest

from tests.harness.record_reads import assert_trained_once
from tests.harness.runs import REPO, clean_env, run_script
from tests.harness.slurm_cluster import INSTALL_COMMAND, SlurmCluster, missing_programs, process_environ
from tests.harness.wrappers import PAUSE_ONCE, RECORD_READS

T = TypeVar("T")

MISSING = missing_programs()
SLURM_MISSING = f"Slurm is not installed (no {', '.join(MISSING)}): {INSTALL_COMMAND}"
if MISSING and os.environ.get("CI") != "true":
    pytest.skip(SLURM_MISSING, allow_module_level=True)

# The tiny transformer: a few dozen steps take a second or two. A step per progress line, so that
# a test sees each step as it happens. --dist-timeout outlasts the time-limit case's pause (below), and
# leaves ending a job whose node died to Slurm.
TRANSFORMER_ARGS = [
    *("--dist-timeout", "180", "--block-size", "32", "--global-batch-size", "16"),
    *("--train-sequences", "320", "--heldout-sequences", "40", "--warmup-steps", "3", "--log-interval", "1"),
]
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
STEP = r"^step +(\d+)/"
WARNING = "SLURM says the job ends soon"
REQUEUE = "stopped with a checkpoint: requeueing job"
REQUEUED_BY_THE_LAUNCHER = "requeueing job"  # after a warning, or a preemption within its GraceTime
TERMINATED = "SLURM sent SIGTERM (scancel, the time limit or a preemption)"
# Slurm's KillWait (its default, which the local cluster keeps): SIGTERM, then SIGKILL this much later.
KILL_WAIT_S = 30
# Startup of torchrun and its processes on this shared 2-core machine, with room for its load.
START_S = 180


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    if MISSING:  # only under CI=true, which must not pass without Slurm
        pytest.fail(f"{SLURM_MISSING}; under CI=true a missing Slurm is a failure")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    yield cluster
    leftovers = cluster.stop()
    assert not leftovers, f"processes of the cluster outlived it (killed): {leftovers}\n{cluster.log_tail()}"


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where jobs are submitted from: the repository's code, linked, so that logs and runs/ land here."""
    root = tmp_path_factory.mktemp("checkout")
    for part in ("common", "ddp", "fsdp", "slurm", "tests"):
        (root / part).symlink_to(REPO / part)
    return root


@dataclass
class JobProcess:
    pid: int
    parent: int
    node: str
    argv: list[str]

    @property
    def is_torchrun(self) -> bool:
        return "torch.distributed.run" in self.argv and not self.argv[0].endswith("srun")


@dataclass
class Job:
    """A submitted job, seen the way its user sees it."""

    cluster: SlurmCluster
    id: int
    name: str
    submit_dir: Path
    submitted: float = field(default_factory=time.monotonic)
    abandoned: threading.Event = field(default_factory=threading.Event)

    @property
    def log(self) -> Path:
        return self.submit_dir / f"{self.name}-{self.id}.out"

    @property
    def run_dir(self) -> Path:
        return self.submit_dir / "runs" / f"{self.name}-{self.id}"

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def state(self) -> dict[str, str]:
        return self.cluster.job(self.id)

    def elapsed(self) -> float:
        return time.monotonic() - self.submitted

    def queued_s(self) -> float:
        """Seconds from submission to the start of the (last) run, by Slurm's own clock (whole seconds)."""
        fields = self.state()
        start, submit = (datetime.fromisoformat(fields[key]) for key in ("StartTime", "SubmitTime"))
        return (start - submit).total_seconds()

    def is_running_again(self) -> bool:
        fields = self.state()
        return fields["JobState"] == "RUNNING" and fields["Restarts"] != "0"

    def describe(self) -> str:
        fields = self.state()
        summary = " ".join(f"{key}={fields.get(key)}" for key in ("JobState", "Reason", "ExitCode", "Restarts"))
        running = "\n".join(f"{p.pid} on {p.node}: {' '.join(p.argv)}" for p in self.processes())
        return (
            f"job {self.id}: {summary}\nits processes still running:\n{running or '(none)'}\n"
            f"--- {self.log.name} ---\n{self.output()}\n{self.cluster.log_tail()}"
        )

    def wait(self, probe: Callable[[], T | None], timeout: float, what: str) -> T:
        """``probe()``'s first true result, polled until ``timeout``; else the test fails with the job's story."""
        deadline = time.monotonic() + timeout
        while not self.abandoned.is_set():
            result = probe()
            if result:
                return result
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        pytest.fail(f"waited {timeout:.0f} s for {what}\n{self.describe()}")

    def wait_for_output(self, pattern: str, timeout: float, start: int = 0) -> re.Match:
        """The first match of ``pattern`` in the log at or after offset ``start``."""
        regex = re.compile(pattern, re.MULTILINE)
        return self.wait(lambda: regex.search(self.output(), start), timeout, f"{pattern!r} in {self.log.name}")

    def wait_until_ended(self, timeout: float) -> dict[str, str]:
        """scontrol's fields once the job has ended: a final state, its processes cleaned up."""

        def ended() -> dict[str, str] | None:
            fields = self.state()
            return fields if fields["JobState"] in FINAL_STATES else None

        return self.wait(ended, timeout, "the end of the job")

    def processes(self) -> list[JobProcess]:
        """Every process of this job still running, on either node."""
        found = []
        for pid in self.cluster.processes(SLURM_JOB_ID=str(self.id)):
            environ = process_environ(pid)
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
                # /proc/PID/stat: "pid (name) state ppid ..."; the name may hold spaces, not ")".
                parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            if environ is not None:
                found.append(JobProcess(pid, parent, environ.get("SLURMD_NODENAME", ""), argv))
        return found

    def has_no_processes(self) -> bool:
        # A process can still be exiting when Slurm has recorded the end of the job.
        return not self.processes()

    def trainers(self) -> list[int]:
        """The training processes: the children of the job's torchrun agents."""
        processes = self.processes()
        agents = {p.pid for p in processes if p.is_torchrun}
        return [p.pid for p in processes if p.parent in agents]

    def metrics(self, run_dir: Path | None = None) -> list[dict]:
        lines = ((run_dir or self.run_dir) / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]


def submit(
    cluster: SlurmCluster,
    checkout: Path,
    launcher: str,
    args: list[str],
    processes_per_node: int,
    options: tuple[str, ...] = (),
    **env: str,
) -> Job:
    """``NPROC_PER_NODE=P sbatch --gpus-per-node=0 --cpus-per-task=P OPTIONS LAUNCHER ARGS`` from ``checkout``."""
    job_env = cluster.client_env(clean_env())
    # The launcher's own thread count (CPUs per task / processes per node), not the harness's.
    job_env.pop("OMP_NUM_THREADS", None)
    # As with the virtual environment activated: `python` is this one.
    job_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{job_env['PATH']}"
    job_env.update(NPROC_PER_NODE=str(processes_per_node), **env)
    cpus = f"--cpus-per-task={processes_per_node}"
    command = ["sbatch", "--parsable", "--gpus-per-node=0", cpus, *options, launcher, *args]
    result = subprocess.run(command, cwd=checkout, env=job_env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, f"$ {' '.join(command)}\n{result.stdout}{result.stderr}"
    name = "ddp" if launcher.endswith("ddp.sbatch") else "fsdp"
    return Job(cluster, int(result.stdout.strip().split(";")[0]), name, checkout)


def steps_of(records: list[dict]) -> list[int]:
    return [record["step"] for record in records if record["event"] == "train"]


def report(case: str, **seconds: float) -> None:
    """The case's measured times, for the README; shown with `pytest -s`."""
    times = ", ".join(f"{what.replace('_', ' ')} {value:.1f} s" for what, value in seconds.items())
    print(f"\n[slurm timing] {case}: {times} (load {os.getloadavg()[0]:.1f})")


# The time-limit case, in the background while the other cases run: Slurm's warning comes on Slurm's
# clock, so waiting for it costs time but no work. --time=2 with --signal=B:USR1@45: Slurm checks time
# limits every 30 s, so USR1 reaches the batch script 45 to 75 s before the end, that is 45 to 75 s
# after the start. Each run of the job gets that window; the resumed run has a few steps left and
# usually ends before it. If it does not, the job is warned and requeued again, which is as right.
# On node1: the preemption case takes all of node2, and an urgent job there must find no job it cannot preempt.
TIME_LIMIT_OPTIONS = ("--time=2", "--signal=B:USR1@45", "--nodelist=node1")
TIME_LIMIT_STEPS = 30


@dataclass
class TimeLimitRun:
    job: Job
    follower: Future


@pytest.fixture(scope="module")
def time_limit_job(slurm_cluster: SlurmCluster, checkout: Path) -> Iterator[TimeLimitRun]:
    script = "fsdp/train_transformer_fsdp2.py"
    args = [PAUSE_ONCE, script, *TRANSFORMER_ARGS, "--max-steps", str(TIME_LIMIT_STEPS)]
    job = submit(slurm_cluster, checkout, "slurm/fsdp.sbatch", args, 2, TIME_LIMIT_OPTIONS)
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield TimeLimitRun(job, pool.submit(follow_time_limit_job, job))
        job.abandoned.set()  # a failed test does not wait for the follower's deadlines


def follow_time_limit_job(job: Job) -> dict[str, float]:
    """Watch the job through Slurm's warning, the requeue and the resumed run; the times of each."""
    job.wait_for_output(STEP, START_S)
    times = {"submit to first step": job.elapsed()}
    # Until Slurm's warning comes the trainers hold themselves still after step 5 (tests/harness/pause_once.py),
    # so that waiting for Slurm's clock costs this machine nothing.
    warning = job.wait_for_output(WARNING, 180)
    times["submit to warning"] = job.elapsed()
    # They continue (SIGCONT) to see the launcher's STOP; one that paused only after the warning came
    # is continued too, until the job has requeued itself.
    regex = re.compile(REQUEUE, re.MULTILINE)

    def continued_until_requeued() -> re.Match | None:
        for pid in stopped(job.trainers()) or []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        return regex.search(job.output(), warning.end())

    requeue = job.wait(continued_until_requeued, 60, f"{REQUEUE!r} in {job.log.name}")
    requeued_at = time.monotonic()
    times["warning to requeue"] = requeued_at - job.submitted - times["submit to warning"]
    # Slurm holds a requeued job for its requeue delay (cred_expire), then schedules it again.
    job.wait(job.is_running_again, 120, "Slurm to start the job again")
    times["requeue to running again"] = time.monotonic() - requeued_at
    job.wait_for_output(STEP, 120, requeue.end())
    times["requeue to resumed step"] = time.monotonic() - requeued_at
    job.wait_until_ended(240)
    times["submit to end"] = job.elapsed()
    return times


def stopped(pids: list[int]) -> list[int] | None:
    """``pids`` if there are some and every one is stopped (state T in /proc/PID/stat), else None."""
    try:
        states = [Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] for pid in pids]
    except OSError:
        return None
    return pids if pids and all(state == "T" for state in states) else None


# The preemption case: a job in each preemptible partition, with each launcher.
PREEMPTIBLE = [
    ("scavenger", "ddp", "ddp/train_transformer.py"),
    ("scavenger-nograce", "fsdp", "fsdp/train_transformer_fsdp2.py"),
]
# The trainers pause after step 5 by themselves, so the count no longer decides whether a run is
# still training when it is preempted (at 200, steps seen from outside, one run ended first).
PREEMPTED_STEPS = 60


# The comm check at its smallest: a few sizes, few iterations; what it reports is checked, not how fast.
COMM_CHECK_FLAGS = "--max-bytes 256K --warmup 2 --iters 5"


def assert_comm_check_ran_first(job: Job) -> None:
    """Its table in the log before training's first step; its JSON in the run directory, for 2 ranks on 2 nodes."""
    output = job.output()
    header = "| collective | size (B) | count (elements) | time (us) | algbw (GB/s) | busbw (GB/s) |"
    first_step = re.search(STEP, output, re.MULTILINE)
    assert output.count(header) == 1 and first_step and output.index(header) < first_step.start(), job.describe()
    assert "2 ranks on 2 node(s), gloo" in output, job.describe()
    summary = json.loads((job.run_dir / "comm_check.json").read_text())
    assert (summary["world_size"], summary["local_world_size"], summary["nodes"]) == (2, 1, 2), summary
    assert (summary["backend"], summary["iters"]) == ("gloo", 5), summary  # COMM_CHECK_FLAGS reached it
    sizes = [2**16, 2**17, 2**18]  # the CPU's default smallest, doubled up to --max-bytes 256K
    measured = [(row["op"], row["bytes"]) for row in summary["results"]]
    assert measured == [(op, size) for op in ("all_reduce", "all_gather", "reduce_scatter") for size in sizes]


class TestOnARealCluster:
    """Issue 13's five cases, and issue 26's preemption. The time-limit job is submitted first and checked last."""

    @pytest.fixture(autouse=True)
    def _start_time_limit_job(self, time_limit_job: TimeLimitRun) -> None:
        pass

    def test_two_nodes_meet_in_one_rendezvous(self, slurm_cluster: SlurmCluster, checkout: Path) -> None:
        job = submit(
            slurm_cluster, checkout, "slurm/fsdp.sbatch", [*TRANSFORMER_ARGS, "--max-steps", "20"], 2, ("--nodes=2",)
        )
        # Both nodes run a torchrun; the world is both nodes' processes.
        job.wait(
            lambda: {p.node for p in job.processes() if p.is_torchrun} == {"node1", "node2"},
            START_S,
            "a torchrun on each node",
        )
        job.wait_for_output(STEP, START_S)
        first_step = job.elapsed()
        ended = job.wait_until_ended(120)
        assert (ended["JobState"], ended["ExitCode"]) == ("COMPLETED", "0:0"), job.describe()
        final = job.metrics()[-1]
        assert final["script"] == "fsdp/train_transformer.py" and final["world_size"] == 2 * 2, job.describe()
        # The node names do not resolve here; the rendezvous is at the address Slurm uses for node1.
        address = slurm_cluster.command("sinfo", "--noheader", "--nodes=node1", "--format=%o").stdout.strip()
        port = 10000 + job.id % 50000
        assert f"--rdzv-endpoint={address}:{port} --rdzv-id={job.id}" in job.output(), job.describe()
        report(
            "two nodes x 2 processes (fsdp.sbatch)",
            queued=job.queued_s(),
            **{"submit to first step": first_step},
            total=job.elapsed(),
        )

    def test_scancel_stops_the_run_cleanly_and_sbatch_resumes_it(
        self, slurm_cluster: SlurmCluster, checkout: Path
    ) -> None:
        args = ["ddp/train_transformer.py", *TRANSFORMER_ARGS, "--max-steps", "40"]
        first = submit(slurm_cluster, checkout, "slurm/ddp.sbatch", args, 2)
        first.wait_for_output(r"^step +5/", START_S)
        slurm_cluster.command("scancel", str(first.id))
        cancelled = time.monotonic()
        # scancel: SIGTERM to every process of the job, SIGKILL after KillWait. The trainers take the
        # SIGTERM as a stop request: they finish the step, save, write PREEMPTED and exit.
        ended = first.wait_until_ended(KILL_WAIT_S + 30)
        stopped_in = time.monotonic() - cancelled
        assert (ended["JobState"], ended["Restarts"]) == ("CANCELLED", "0"), first.describe()
        assert stopped_in < KILL_WAIT_S, "the run ended on its own, before Slurm's SIGKILL"
        first.wait(first.has_no_processes, 10, "every process of the job to be gone")
        marker = json.loads((first.run_dir / "PREEMPTED").read_text())
        assert marker["step"] >= 5 and marker["reason"] == "SIGTERM", marker
        assert (checkout / marker["checkpoint"]).exists()
        assert TERMINATED in first.output() and REQUEUED_BY_THE_LAUNCHER not in first.output(), first.describe()

        # The user submits again with the same run directory: it resumes there. A STOP left from before
        # (one that came too late, or that a killed run never read) is the launcher's to clear, not a
        # request to this job: the trainers no longer delete a STOP at startup.
        (first.run_dir / "STOP").touch()
        run_dir = str(first.run_dir.relative_to(checkout))
        second = submit(slurm_cluster, checkout, "slurm/ddp.sbatch", args, 2, RUN_DIR=run_dir)
        ended = second.wait_until_ended(START_S)
        # One node, two processes, to the end: the job a user's first sbatch is. (Which script a launcher
        # runs when given none is test_launchers.py's, with Slurm's commands stood in for.)
        assert (ended["JobState"], ended["ExitCode"]) == ("COMPLETED", "0:0"), second.describe()
        assert second.log.parent == checkout, "the log is in the submit directory"
        assert "1 node(s) x 2 process(es)" in second.output(), second.describe()
        records = second.metrics(first.run_dir)
        (resume,) = [record for record in records if record["event"] == "resume"]
        assert resume["step"] == marker["step"]
        assert steps_of(records) == list(range(1, 41)), "every step once, none lost or repeated"
        assert records[-1]["event"] == "final" and records[-1]["world_size"] == 2, second.describe()
        assert (first.run_dir / "model.pt").is_file()
        report("scancel mid-run", **{"scancel to the end of the job": stopped_in}, resubmitted=second.elapsed())

    def test_a_dying_node_fails_the_job_and_leaves_nothing_running(
        self, slurm_cluster: SlurmCluster, checkout: Path
    ) -> None:
        args = ["ddp/train_transformer.py", *TRANSFORMER_ARGS, "--max-steps", "2000"]
        # No torchrun restarts: with the launchers' default of one, the surviving node's torchrun starts
        # its workers again and waits in the rendezvous until srun's KillWait ends it, which makes the job
        # FAILED 30 s later (measured: 45 s instead of 15) without changing anything checked here.
        # COMM_CHECK=1: this job also carries the comm check across 2 nodes (a job of its own would cost the
        # serial Slurm cases another start); it runs and ends before training does.
        check = {"COMM_CHECK": "1", "COMM_CHECK_FLAGS": COMM_CHECK_FLAGS}
        job = submit(slurm_cluster, checkout, "slurm/ddp.sbatch", args, 1, ("--nodes=2",), MAX_RESTARTS="0", **check)
        job.wait_for_output(r"^step +5/", START_S)
        assert_comm_check_ran_first(job)
        (torchrun,) = [p.pid for p in job.processes() if p.is_torchrun and p.node == "node2"]
        os.kill(torchrun, signal.SIGKILL)
        killed = time.monotonic()
        ended = job.wait_until_ended(60)
        failed_in = time.monotonic() - killed
        assert ended["JobState"] == "FAILED" and ended["ExitCode"] != "0:0", job.describe()
        assert ended["Restarts"] == "0" and REQUEUED_BY_THE_LAUNCHER not in job.output(), (
            "a failure is not a preemption"
        )
        job.wait(job.has_no_processes, 10, "every process of the job, on both nodes, to be gone")
        report("a node's torchrun killed", **{"kill to FAILED": failed_in})

    def test_a_preempted_job_comes_back_by_itself_and_trains_every_step_once(
        self, slurm_cluster: SlurmCluster, checkout: Path
    ) -> None:
        """PreemptMode=REQUEUE, as scavenger partitions have it (tests/harness/slurm_cluster.py): a job in a partition
        with GraceTime=60 and one in a partition with none share node2, and one job of a higher PriorityTier
        asks for all of node2's CPUs. Slurm preempts both. Each job, DDP's and FSDP2's, trains every step once,
        and each step the examples an uninterrupted run reads for it (tests/harness/record_reads.py).

        One CPU each, so one thread each: at two, the two jobs and the time-limit job's two processes ran six
        threads on this machine's two cores, and the 195 steps after the requeue took 40 s instead of 3."""
        # A global batch of 4 (the last --global-batch-size wins): the steps at a quarter of the cost. Checkpoints
        # written in the background (issue 71), one every 5 steps: the one of step 5 begins as the trainers go on
        # after their hold, and the stop's own save, a step or two later, first waits for it.
        args = [*TRANSFORMER_ARGS, "--global-batch-size", "4", "--max-steps", str(PREEMPTED_STEPS),
                "--checkpoint-interval", "5", "--async-checkpoint"]  # fmt: skip
        reads = checkout.parent / f"{checkout.name}-reads"
        jobs = {
            partition: submit(
                slurm_cluster,
                checkout,
                f"slurm/{launcher}.sbatch",
                [RECORD_READS, str(reads / partition), PAUSE_ONCE, script, *args],
                1,
                (f"--partition={partition}", "--nodelist=node2"),
            )  # fmt: skip
            for partition, launcher, script in PREEMPTIBLE
        }
        # The trainers hold themselves still after step 5 (tests/harness/pause_once.py) until Slurm preempts them
        # (it sends SIGCONT before SIGTERM): preempted mid-run however fast the steps go, and waiting for
        # the urgent job costs no work.
        paused: list[int] = []
        for job in jobs.values():
            paused += job.wait(lambda job=job: stopped(job.trainers()), START_S, "the trainer to hold itself still")
        urgent_at = time.monotonic()
        try:
            urgent = slurm_cluster.command(
                "sbatch", "--parsable", "--partition=urgent", "--nodelist=node2", "--cpus-per-task=4",
                "--output=/dev/null", "--wrap", "sleep 1",
            ).stdout.strip()  # fmt: skip
            for job in jobs.values():
                job.wait(lambda job=job: job.state().get("PreemptTime", "None") != "None" or job.is_running_again(), 60,
                         "Slurm to preempt the job")  # fmt: skip
        finally:
            for pid in paused:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        assert slurm_cluster.job(int(urgent))["Partition"] == "urgent"
        # What each step of the jobs must train: the examples an uninterrupted one-process run reads.
        uninterrupted = [RECORD_READS, str(reads / "uninterrupted")]
        run_script("ddp/train_transformer.py", args, reads / "uninterrupted-run", wrapper=uninterrupted).check()
        times = {}
        for partition, job in jobs.items():
            ended = job.wait_until_ended(START_S + 60)
            times[f"{partition}: preemption to COMPLETED"] = time.monotonic() - urgent_at
            assert (ended["JobState"], ended["ExitCode"]) == ("COMPLETED", "0:0"), job.describe()
            assert int(ended["Restarts"]) >= 1, job.describe()
            records = job.metrics()
            (resume,) = [record for record in records if record["event"] == "resume"]
            assert 5 <= resume["step"] < PREEMPTED_STEPS, job.describe()  # held at step 5 until preempted
            assert steps_of(records) == list(range(1, PREEMPTED_STEPS + 1)), "every step once"
            assert_trained_once(reads / partition, reads / "uninterrupted", 4, job.describe())
            assert not (job.run_dir / "PREEMPTED").exists()
        # GraceTime=60: the trainers save and end within it, and the job would end FAILED, never requeued;
        # the launcher reads the preemption in PreemptTime and requeues it. GraceTime=0: Slurm requeues it.
        assert "preempted (PreemptTime=" in jobs["scavenger"].output(), jobs["scavenger"].describe()
        assert REQUEUED_BY_THE_LAUNCHER not in jobs["scavenger-nograce"].output(), jobs["scavenger-nograce"].describe()
        assert "DUE TO PREEMPTION" in jobs["scavenger-nograce"].output(), jobs["scavenger-nograce"].describe()
        report("preempted under PreemptMode=REQUEUE", **times)

    def test_slurm_warns_before_the_time_limit_requeues_and_the_job_resumes(self, time_limit_job: TimeLimitRun) -> None:
        job = time_limit_job.job
        times = time_limit_job.follower.result(timeout=600)
        ended = job.state()
        assert (ended["JobState"], ended["ExitCode"]) == ("COMPLETED", "0:0"), job.describe()
        restarts = int(ended["Restarts"])
        assert restarts >= 1, job.describe()
        # One log for every run of the job, since it keeps its id: appended, not overwritten.
        output = job.output()
        assert output.count(f"job {job.id}: 1 node(s) x 2 process(es)") == restarts + 1, job.describe()
        assert output.count(REQUEUE) == restarts, job.describe()
        # A warning can also come when the last run has no step left to stop: nothing to requeue then.
        assert output.count(WARNING) >= restarts, job.describe()
        records = job.metrics()
        resumes = [index for index, record in enumerate(records) if record["event"] == "resume"]
        assert len(resumes) == restarts
        for index in resumes:  # each run starts at the step after the checkpoint it resumes from
            following = next(record for record in records[index:] if record["event"] == "train")
            assert following["step"] == records[index]["step"] + 1
        assert 0 < records[resumes[0]]["step"] < TIME_LIMIT_STEPS, "stopped mid-run"
        assert steps_of(records) == list(range(1, TIME_LIMIT_STEPS + 1)), "every step once"
        assert not (job.run_dir / "PREEMPTED").exists()
        report(f"Slurm's time-limit warning, {restarts} requeue(s)", **times)
