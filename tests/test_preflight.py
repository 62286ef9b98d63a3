"""tools.checks.preflight: the six scripts pass (the FSDP2 + TP one at 2 x 2); broken copies are named at their
line, quickly, and nothing hangs.

The ranks start from the warm launcher (tests/harness/launcher.py) and the verdict is read in process with
``preflight.judge``; one test runs the real command, torchrun and all, on a broken copy.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import pytest

from tests.harness import launcher
from tests.harness.cases import FSDP2_SCRIPT, NEEDS_FSDP2_ON_CPU, cases
from tests.harness.runs import REPO, clean_env, run_command
from tools.checks import lockstep, preflight

TINY = ["--model", "tiny", "--train-sequences", "200", "--heldout-sequences", "40", "--eval-batch-size", "20"]
MNIST = ["--batch-size", "16"]
WAIT_S = 20.0
NAMED_WITHIN_S = 60  # the bound for naming a broken copy


def data_flags(script: str, mnist_dir: Path) -> list[str]:
    return [*MNIST, "--data-dir", str(mnist_dir)] if "mnist" in script else TINY


def run_preflight(script: str, flags: list[str], root: Path, nproc: int = 2) -> tuple[preflight.Verdict, float]:
    """An ``nproc``-rank pre-flight of ``script`` with its ranks forked from the warm server; the verdict and the
    seconds it took."""
    planned = preflight.plan(script, flags, root, WAIT_S)
    started = time.monotonic()
    finished = launcher.launch(str(REPO / "tools/checks/preflight.py"), planned.rank_argv, clean_env(), nproc, 120)
    elapsed = time.monotonic() - started
    assert not finished.timed_out, finished.output
    verdict = preflight.judge(planned.report_dir, planned.run_dir, nproc, finished.returncode, finished.output, script)
    return verdict, elapsed


SCRIPTS = [(name, name) for name in
           ["ddp/train_mnist.py", "ddp/train_transformer.py", "fsdp/train_mnist.py", "fsdp/train_transformer.py",
            FSDP2_SCRIPT]]  # fmt: skip


@NEEDS_FSDP2_ON_CPU
def test_the_tensor_parallel_script_passes_on_a_2x2_mesh(tmp_path: Path) -> None:
    """At 4 ranks, 2 x 2: the only shape where FSDP2's collectives over "dp" and TP's over "tp" both run, and a
    rank that took the wrong group would wait on the other dimension's."""
    verdict, _ = run_preflight("fsdp/train_transformer_fsdp2_tp.py", TINY, tmp_path, nproc=4)
    assert verdict.code == preflight.OK, verdict.text
    assert "at 4 rank(s)" in verdict.text and "reduce_scatter" in verdict.text, verdict.text


@pytest.mark.parametrize("script", cases(SCRIPTS, keep_id=False))
def test_unbroken_script_passes(script: str, tmp_path: Path, tiny_mnist_dir: Path) -> None:
    verdict, _ = run_preflight(script, data_flags(script, tiny_mnist_dir), tmp_path)
    assert verdict.code == preflight.OK, verdict.text
    assert "1 checkpoint(s), the final save" in verdict.text, verdict.text
    assert "per training step:" in verdict.text, verdict.text


# Scripts of the user's own that write no metrics.jsonl: each still gets its verdict, not a traceback.
NO_METRICS = [
    ("exits-0-early", "import sys\n\nsys.exit(0)\n"),
    ("plain-process-group", "import torch\nimport torch.distributed as dist\n\n"
     "dist.init_process_group('gloo')\ndist.all_reduce(torch.ones(3))\ndist.destroy_process_group()\n"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "text"), NO_METRICS, ids=[case for case, _ in NO_METRICS])
def test_a_script_without_metrics_gets_its_verdict(case: str, text: str, tmp_path: Path) -> None:
    script = tmp_path / "project" / "plain.py"
    script.parent.mkdir()
    script.write_text(text)
    verdict, _ = run_preflight(str(script), [], tmp_path / "preflight")
    assert verdict.code == preflight.OK, verdict.text
    assert "the script wrote no metrics.jsonl" in verdict.text, verdict.text
    collectives = 1 if case == "plain-process-group" else 0
    assert f"all {collectives} collectives matched" in verdict.text, verdict.text


def broken_copy(script: str, find: str, replace: str, folder: Path) -> tuple[Path, int]:
    """``script`` with the one line that holds ``find`` (its first) changed as ``replace`` says; the copy and
    that line's number."""
    lines = (REPO / script).read_text().splitlines(keepends=True)
    numbers = [number for number, line in enumerate(lines, 1) if find in line]
    assert numbers, f"{script} no longer has a line with {find!r}: update this test"
    number = numbers[0]
    lines[number - 1] = lines[number - 1].replace(find, replace)
    folder.mkdir(parents=True)
    copy = folder / Path(script).name
    copy.write_text("".join(lines))
    return copy, number


# Each: the script, the line to find, what it becomes, the rank whose side of the report names the line.
EVAL_CLASSIFIER = "result = evaluate_classifier(model, loader, ctx, normalize_images)"
BROKEN = [
    # Rank 0 alone evaluates: its evaluation's all-reduce meets the other rank's next training collective.
    ("ddp-eval-on-rank-0", "ddp/train_transformer.py",
     "result = evaluate_language_model(model, loader, ctx)",
     "result = evaluate_language_model(model, loader, ctx) if ctx.is_main else {'loss': 0.0, 'samples': 0}", 0),
    # Under FSDP the evaluation's forward gathers parameters: the same shapes as training's, from another line.
    ("fsdp-eval-on-rank-0", "fsdp/train_mnist.py", EVAL_CLASSIFIER,
     f"{EVAL_CLASSIFIER} if ctx.is_main else "
     "{'loss': 0.0, 'accuracy': 0.0, 'samples': 0}", 0),
    # An extra all-reduce on odd ranks (a debug line left in).
    ("extra-collective-on-odd-ranks", "ddp/train_mnist.py", "step_loss += loss.detach()",
     "step_loss += loss.detach(); ctx.rank % 2 and torch.distributed.all_reduce(loss.detach())", 1),
    # The valid targets of each rank's batch, summed across ranks: their number differs with --variable-length.
    ("shape-differs-by-rank", "ddp/train_transformer.py", "step_loss += loss.detach()",
     "step_loss += loss.detach(); torch.distributed.all_reduce(targets[targets >= 0].float())", 0),
    # Only rank 0 gathers the full state dict, but every rank holds a shard of it.
    ("state-dict-on-rank-0", FSDP2_SCRIPT,
     "state = get_model_state_dict(model, options=full_state_dict_options(ctx.device))",
     "state = get_model_state_dict(model, options=full_state_dict_options(ctx.device)) if ctx.is_main else None", 0),
]  # fmt: skip
EXTRA_FLAGS = {"shape-differs-by-rank": ["--variable-length"]}


@pytest.mark.parametrize(("case", "script", "find", "replace", "rank"), cases(BROKEN))
def test_broken_copy_is_named_at_its_line(
    case: str, script: str, find: str, replace: str, rank: int, tmp_path: Path, tiny_mnist_dir: Path
) -> None:
    copy, line = broken_copy(script, find, replace, tmp_path / "project" / "train")
    flags = [*data_flags(script, tiny_mnist_dir), *EXTRA_FLAGS.get(case, [])]
    verdict, elapsed = run_preflight(str(copy), flags, tmp_path / "preflight")
    assert verdict.code == preflight.FOUND, verdict.text
    side = verdict.side(rank)
    assert side is not None, verdict.text
    assert side["script_line"] == f"{copy}:{line}", verdict.text
    assert f"{copy}:{line}" in verdict.text
    assert elapsed < NAMED_WITHIN_S, f"{elapsed:.1f} s\n{verdict.text}"


def test_a_script_that_fails_is_its_error(tmp_path: Path, tiny_mnist_dir: Path) -> None:
    copy, line = broken_copy("ddp/train_mnist.py", "step_loss += loss.detach()",
                             "step_loss += loss.detach(); assert ctx.rank == 0, 'only rank 0 gets here'",
                             tmp_path / "project" / "train")  # fmt: skip
    verdict, _ = run_preflight(str(copy), data_flags("ddp/train_mnist.py", tiny_mnist_dir), tmp_path / "preflight")
    assert verdict.code == preflight.FOUND, verdict.text
    assert "the script failed on rank 1" in verdict.text and "only rank 0 gets here" in verdict.text, verdict.text
    assert f'{copy}", line {line}' in verdict.text, verdict.text


def processes_working_in(folder: Path) -> list[int]:
    """The processes whose working directory is ``folder``: every one the command started, and only those."""
    found = []
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        with contextlib.suppress(OSError):  # a process that ended meanwhile, or one not ours to read
            if cwd.resolve(strict=True) == folder.resolve():
                found.append(int(cwd.parent.name))
    return found


def test_real_command_names_the_line_and_leaves_nothing_running(tmp_path: Path, tiny_mnist_dir: Path) -> None:
    """The command as the README gives it, from a copy's folder with the copy's common/: torchrun, its
    ranks, one report and nothing left running."""
    _, script, find, replace, rank = BROKEN[2]
    project = tmp_path / "project"
    shutil.copytree(REPO / "common", project / "common", ignore=shutil.ignore_patterns("__pycache__"))
    copy, line = broken_copy(script, find, replace, project / "train")
    # the copy's common/ first, never this repository's; the command itself from this repository's tools/
    env = clean_env() | {"PYTHONPATH": os.pathsep.join([str(project), str(REPO)])}
    command = [sys.executable, "-m", "tools.checks.preflight", "--nproc", "2", "--wait", str(WAIT_S),
               str(copy.relative_to(project)), *data_flags(script, tiny_mnist_dir)]  # fmt: skip
    started = time.monotonic()
    run = run_command(command, tmp_path, timeout=120, env=env, cwd=project)
    elapsed = time.monotonic() - started
    assert run.returncode == preflight.FOUND, run.describe()
    assert run.output.count("pre-flight:") == 1, run.describe()  # one report, not one per rank
    assert "MISMATCH" in run.output and f"train/{copy.name}:{line}" in run.output, run.describe()
    assert processes_working_in(project) == [], run.describe()
    assert elapsed < NAMED_WITHIN_S, f"{elapsed:.1f} s\n{run.describe()}"


def test_every_wait_is_bounded_and_an_ended_rank_is_seen_at_once(tmp_path: Path) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), wait_for_workers=False)
    waiting, absent = lockstep.Lockstep(store, 0, wait_s=0.5), lockstep.Lockstep(store, 1, wait_s=0.5)
    started = time.monotonic()
    peer = waiting.await_peer("0", 1, peer=1)
    assert peer.fingerprint is None and peer.ended is None and peer.last is None
    assert 0.5 <= time.monotonic() - started < 5
    absent.end("returned")
    started = time.monotonic()
    assert waiting.await_peer("0", 1, peer=1).ended == {"how": "returned", "detail": "", "issued": 0}
    assert time.monotonic() - started < 0.5

    mine = lockstep.Fingerprint("c10d::allreduce_", "all_reduce", [0, 1], ["tensors: float32[4]"], [], "t.py:7", "")
    report = {"verdict": "timeout", "n": 3, "mine": asdict(mine), "peer": asdict(lockstep.Peer(1))}
    lockstep.write_report(tmp_path, 0, report)
    verdict = preflight.judge(tmp_path, tmp_path, 2, 1, "", "t.py")
    assert verdict.code == preflight.FOUND
    assert "rank 0 waited for rank 1 at collective #3 on group [0, 1]" in verdict.text, verdict.text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ddp/train_mnist.py"], "--nproc N"),
        (["--nproc", "2", "no/such/script.py"], "no/such/script.py: no such file"),
    ],
)
def test_bad_input_is_one_message_and_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as stopped:
        preflight.main(argv)
    assert stopped.value.code == preflight.BAD_INPUT
    assert message in capsys.readouterr().err


def test_the_launching_process_never_imports_torch(tmp_path: Path) -> None:
    """The command's own process only plans, launches and judges: importing torch would cost it seconds
    for nothing (its ranks import it). The run directory's names come from common.run_dir, whose lock
    alone needs torch."""
    probe = (
        "import sys, tools.checks.preflight; "
        "print(found := [name for name in sys.modules if name[:5] == 'torch'][:3]); sys.exit(bool(found))"
    )
    imported = run_command([sys.executable, "-c", probe], tmp_path, timeout=60)
    assert imported.returncode == 0, imported.describe()
