"""When a rank fails mid-training, the job ends fast, says which rank, and keeps the last checkpoint;
under torchrun --max-restarts a killed rank is restarted and the run goes on; under an elastic
rendezvous a lost node leaves the others to go on in a smaller world.

Faults are injected into rank 1 by tests/harness/inject_fault.py: an exception and a
SIGKILL at step 3 (the other rank would otherwise wait in a collective until
--dist-timeout), and a NaN loss at step 3.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from common.distributed import FatalError, distributed, generation_store, torch_at_least
from common.models import GPT, GPTConfig
from common.run_dir import complete_checkpoints
from common.tokens import token_file_data
from tests.harness.noise_floor import GLOBAL_BATCH, NoiseRuns, assert_same_training
from tests.harness.noise_floor import TRANSFORMER_ARGS as EQUIVALENCE_ARGS
from tests.harness.noise_floor import TRANSFORMER_STEPS as EQUIVALENCE_STEPS
from tests.harness.record_reads import assert_trained_once
from tests.harness.runs import descendants, kill_all, run_command, run_script, script_invocation, start
from tests.harness.wrappers import INJECT_FAULT, RECORD_READS

SCRIPT = "ddp/train_transformer.py"
FSDP2 = "fsdp/train_transformer_fsdp2.py"
ARGS = [
    *("--max-steps", "20", "--log-interval", "1", "--block-size", "32", "--train-sequences", "320"),
    *("--heldout-sequences", "40", "--checkpoint-interval", "2"),
]
# How torchrun's summary of a failed job names a rank.
FAILED_RANK_LINE = "rank      : 1 (local_rank: 1)"


def test_a_failing_rank_ends_the_job_within_a_minute_and_is_named(tmp_path: Path) -> None:
    """An exception in rank 1 at step 3. (A SIGKILLed rank is the restart test's first generation, below.)"""
    began = time.monotonic()
    run = run_script(
        SCRIPT,
        ARGS,
        tmp_path / "run",
        nproc=2,
        wrapper=[INJECT_FAULT, "raise"],
        timeout=120,
        real_launcher=True,
    )
    elapsed = time.monotonic() - began
    assert run.returncode != 0, run.describe()
    assert elapsed < 60, f"took {elapsed:.0f} s\n{run.describe()}"
    # The other rank fails too (its collective lost a peer); the summary tells which came first.
    assert "Root Cause (first observed failure)" in run.output, run.describe()
    root_cause = run.output.split("Root Cause (first observed failure)")[1]
    assert FAILED_RANK_LINE in root_cause, run.describe()
    assert "RuntimeError: injected failure on rank 1 at step 3" in root_cause, run.describe()


def test_a_worker_killed_once_is_restarted_by_torchrun_and_the_run_is_the_same(
    transformer_noise: NoiseRuns, tmp_path: Path
) -> None:
    """torchrun --max-restarts=1, and rank 1 SIGKILLed at step 3 in the first generation only.

    The second generation meets in torchrun's store, where the first one left its addresses; it must
    start cleanly, resume from step 2 and train what an uninterrupted run trains: the examples the noise
    floor's one-process reference read at each step, and within the noise floor of its twins.

    The store prefix per generation is common.distributed's, the same for every script: DDP is the script that
    failed most often without it (3 restarts of 5, DESIGN.md), and test_each_restart_meets_in_a_store_of_its_own
    below compares two generations' keys every time, where a run sees the fault only now and then. So the run is
    FSDP2's, the script whose restart reshards; DDP's run of it (15 CPU-seconds) paid for the hang tests.
    """
    run_dir, reads = tmp_path / "restarted", tmp_path / "reads"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1"]
    args = [*EQUIVALENCE_ARGS, "--checkpoint-interval", "2", "--resume"]
    invocation = script_invocation(FSDP2, args, run_dir, [RECORD_READS, str(reads), INJECT_FAULT, "sigkill-once"])
    restarted = run_command([*torchrun, *invocation], run_dir, timeout=150)
    assert restarted.returncode == 0, restarted.describe()
    assert [record["step"] for record in restarted.events("resume")] == [2], restarted.describe()
    assert [record["step"] for record in restarted.events("train")] == list(range(1, EQUIVALENCE_STEPS + 1))
    assert_trained_once(reads, transformer_noise.reference_reads, GLOBAL_BATCH, restarted.describe())
    assert_same_training(transformer_noise, run_dir, restarted.describe(), EQUIVALENCE_STEPS)


# Rendezvous ports for the two-agent case: out of the kernel's ephemeral range (32768 and up), where
# --standalone's and the test launcher's stores get theirs.
PORT_BAND = range(29500, 30500)


def port_in_band() -> int:
    """A port of PORT_BAND that nothing listens on now, tried from a random place in the band."""
    start = random.randrange(len(PORT_BAND))
    for offset in range(len(PORT_BAND)):
        port = PORT_BAND[(start + offset) % len(PORT_BAND)]
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORT_BAND}")


def wait_until_listening(port: int, agent: subprocess.Popen, timeout: float) -> bool:
    """Whether something listens on ``port`` within ``timeout`` while ``agent`` runs."""
    deadline = time.monotonic() + timeout
    while agent.poll() is None and time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.1)
    return False


def train_steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(line)["step"] for line in lines if '"train"' in line), default=0)


def lose_the_node(agent: subprocess.Popen) -> None:
    """What a machine that goes down does to its torchrun and its workers: all of them end at once.

    The agent is held still first: a worker whose torchrun dies before it would get SIGTERM
    (PR_SET_PDEATHSIG) and ask the others to stop with a checkpoint, which a dead machine never does.
    """
    workers = descendants(agent.pid)
    os.kill(agent.pid, signal.SIGSTOP)
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    kill_all(agent.pid)


def test_a_node_lost_the_other_continues_alone_and_the_run_is_the_same(
    transformer_noise: NoiseRuns, tmp_path: Path
) -> None:
    """Two torchrun agents, a "node" of one process each, in an elastic rendezvous (--nnodes=1:2). At step 6
    the second node is lost. The first node's worker fails in its next collective; its torchrun starts it
    again in a rendezvous of the one node left, and it resumes from the newest checkpoint at world size 1.
    --global-batch-size keeps each step's batch, so the run is still the same training.

    The DDP script, as docs/checkpoints.md runs it: what a lost node asks of a script is the same for all of them
    (common/distributed.py's rendezvous, a resume at another world size). FSDP2's run of it (15 CPU-seconds) would
    add what two other tests show: FSDP2 resuming at other world sizes (test_checkpoint.py's switches) and an
    FSDP2 worker restarted by its torchrun (the test above).

    The second agent is the one lost: the first hosts the rendezvous store (the endpoint's port), which
    must outlive any node that can be lost (README, "Which layer recovers from what").
    """
    run_dir, reads = tmp_path / "run", tmp_path / "reads"
    port = port_in_band()
    elastic = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=1"),
        *("--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={tmp_path.name}"),
        # Once a node has gone, how long the survivors wait for it to come back before going on without it
        # (last_call_timeout), and how soon a node that stopped its heartbeats counts as gone: 1 s x 3,
        # where torch's default of 5 s x 3 left the survivor waiting 15 s (the case took 8 s longer).
        "--rdzv-conf=last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3",
    ]
    args = [*EQUIVALENCE_ARGS, "--checkpoint-interval", "2", "--resume"]
    command = [*elastic, *script_invocation(SCRIPT, args, run_dir, [RECORD_READS, str(reads)])]
    survivor = start(command)
    # Both agents are on this machine, so either could host the store: the first to listen on the port.
    # The survivor must: a store whose node is lost is gone, and the survivors with it (measured).
    hosting = wait_until_listening(port, survivor, 60)
    lost = start(command)
    survived = None
    try:
        assert hosting, "the first torchrun never listened on the rendezvous port"
        deadline = time.monotonic() + 120
        while train_steps_logged(run_dir) < 6 and survivor.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # polls the run's own record of its progress, up to the deadline
        lose_the_node(lost)
        survived = survivor.communicate(timeout=150)[0]
    except subprocess.TimeoutExpired:
        pass
    finally:
        for agent in (survivor, lost):
            kill_all(agent.pid)
    outputs = [survived if survived is not None else survivor.communicate()[0], lost.communicate()[0]]
    describe = "\n".join([f"$ {' '.join(command)}  (twice)", "--- the node that stays ---", outputs[0],
                          "--- the node lost ---", outputs[1]])  # fmt: skip
    assert survived is not None, f"the node that stays did not finish within 150 s\n{describe}"
    assert survivor.returncode == 0, describe
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (resume,) = [record for record in records if record["event"] == "resume"]
    # The newest checkpoint when the node went: step 4 or later (one every 2 steps, the loss at step 6).
    assert resume["world_size"] == 1 and resume["step"] >= 4, describe
    assert [record["step"] for record in records if record["event"] == "train"] == list(range(1, EQUIVALENCE_STEPS + 1))
    assert_trained_once(reads, transformer_noise.reference_reads, GLOBAL_BATCH, describe)
    assert_same_training(transformer_noise, run_dir, describe, EQUIVALENCE_STEPS)


def test_non_finite_loss_stops_before_the_step_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run = run_script(SCRIPT, ARGS, run_dir, nproc=2, wrapper=[INJECT_FAULT, "nan"])
    assert run.returncode != 0, run.describe()
    message = "the training loss is not finite (NaN or inf) at step 3; stopped before the optimizer applied it"
    assert run.output.count(message) == 1, run.describe()
    (checkpoint,) = complete_checkpoints(run_dir)
    assert checkpoint.name == "step-2.pt"
    saved = torch.load(checkpoint, weights_only=True)
    assert all(torch.isfinite(tensor).all() for tensor in saved["model"].values())
    assert [record["step"] for record in run.events("train")] == [1, 2]


def gloo_worker_threads() -> int:
    """Threads of this process that belong to a gloo process group (they are named by torch)."""
    return sum((task / "comm").read_text().startswith("pt_gloo_runloop") for task in Path("/proc/self/task").iterdir())


def refuse_after_wrapping(before: int) -> None:
    """What a script's train() does before a refused resume: wrap a model, then raise."""
    model = DDP(GPT(GPTConfig(vocab_size=16, block_size=32, n_layer=2, n_head=4, d_model=64)))
    assert gloo_worker_threads() > before  # so that the check after teardown could fail
    raise FatalError(f"refused ({type(model).__name__})")


# Seen: torch 2.13 and 2.14 name gloo's threads; 2.6, 2.9 and 2.10 do not, and there they cannot be told apart.
@pytest.mark.skipif(not torch_at_least((2, 13)), reason="this torch does not name gloo's threads")
def test_a_refusal_frees_the_process_groups_before_the_interpreter_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A FatalError must end in its exit code. It used to abort now and then (SIGABRT, exit 134):
    the failed frame kept the model, and through it the gloo group, alive into interpreter
    shutdown, whose gloo worker threads then cannot take the GIL. Teardown must free what the
    failed run held, so the group's threads end while the interpreter still runs."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # set_cpu_threads must not resize this test process
    before = gloo_worker_threads()
    with pytest.raises(SystemExit) as exit_info, distributed("cpu", timeout_s=60):
        refuse_after_wrapping(before)
    assert exit_info.value.code == 2
    assert gloo_worker_threads() == before


def test_a_token_file_cut_short_under_a_running_job_stops_with_its_name(tmp_path: Path) -> None:
    """Another job rewrote the file shorter after the run checked it: a memory-mapped read past its new end
    was a SIGBUS ("Fatal Python error: Bus error"), no word of the file, on every rank that read there."""
    tokens = tmp_path / "corpus"
    np.arange(64 * 33, dtype="<u2").__mod__(256).astype("<u2").tofile(tokens)
    info = {"tokenizer": "bytes", "vocab_size": 256, "dtype": "uint16", "tokens": 64 * 33}
    Path(f"{tokens}.json").write_text(json.dumps(info))
    data = token_file_data(tokens, 32, 4)
    assert len(data.train[0][0]) == 32  # read before the cut, as a run's first steps are
    os.truncate(tokens, 100)
    with pytest.raises(ValueError, match=f"{tokens} changed under the run: it ends at token 50, "):
        data.train[5]


def test_each_restart_meets_in_a_store_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's agent keeps one store for every generation of workers it starts. What a failed generation
    left there (its ranks' addresses) must not be what the next one reads: it would connect to dead peers.
    The restart case above sees this only now and then; here the two generations' keys are compared."""
    agent_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent_store.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    timeout = timedelta(seconds=30)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    generation_store(1, 2, timeout).set("rank-1-address", "the worker that was killed")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = generation_store(1, 2, timeout)
    assert not restarted.check(["rank-1-address"]), "the restarted workers read the failed generation's keys"
    restarted.set("rank-1-address", "its replacement")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert generation_store(1, 2, timeout).get("rank-1-address") == b"the worker that was killed"
