"""A project made from a copy of a script, as docs/your-own-project.md and docs/hugging-face.md make one.

The copy lives in a folder outside the repository with its own ``common/``, the script one folder
below (``train/``), and runs from that folder with only it on PYTHONPATH. Its ranks are forked from
the warm launcher, started in the copy's folder with this repository's modules dropped
(tests/harness/launcher.py): nothing of the repository is importable there.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.harness import launcher
from tests.harness.runs import REPO, Run, clean_env, launcher_prefix
from tools.checks import check_equivalence


def copy_common(project: Path) -> Path:
    """Step 1 of the guides: ``common/`` into ``project``, and an empty ``train/`` for the script; returns it."""
    shutil.copytree(REPO / "common", project / "common", ignore=shutil.ignore_patterns("__pycache__"))
    (project / "train").mkdir(exist_ok=True)
    return project / "train"


def project_env(project: Path) -> dict[str, str]:
    env = clean_env()
    env["PYTHONPATH"] = str(project)  # the copy's common/, never this repository's
    return env


def run_copy(
    project: Path,
    script: str,
    flags: list[str],
    run_dir: Path,
    nproc: int | None,
    timeout: float = 300,
    on_line: Callable[[str], None] | None = None,
) -> Run:
    """``python script`` or ``torchrun --nproc_per_node=nproc script`` from the copy's folder, warm."""
    argv = ["--device", "cpu", "--dist-timeout", "60", *flags, "--run-dir", str(run_dir)]
    finished = launcher.launch(str(project / script), argv, project_env(project), nproc, timeout, on_line, project)
    run = Run([*launcher_prefix(nproc), script, *argv], finished.returncode, finished.output, run_dir, warm=True)
    if finished.timed_out:
        pytest.fail(f"timed out after {timeout} s\n{run.describe()}")
    return run


def warm_runner(project: Path, made: dict[tuple, Path] | None = None) -> check_equivalence.Runner:
    """check_equivalence's way to start a run, with the ranks forked warm in the copy's folder.

    ``made`` (when given) remembers each one-process run by its script and flags: a later check that
    asks for the same run (its reference and twins, from one --reference-script) gets a copy of the
    folder it made, as a rerun of the same deterministic run would make it.
    """

    def run(script: str, flags: list[str], nproc: int | None, run_dir: Path) -> tuple[int, str]:
        key = (script, *flags)
        if made is not None and nproc is None and key in made:
            shutil.copytree(made[key], run_dir)
            return 0, (made[key].parent / f"{made[key].name}.log").read_text()
        program, argv = str(project / script), [*flags, "--run-dir", str(run_dir)]
        finished = launcher.launch(program, argv, project_env(project), nproc, timeout=300, cwd=project)
        if finished.timed_out:
            pytest.fail(f"timed out after 300 s: {script} {' '.join(argv)}\n{finished.output}")
        if made is not None and nproc is None and finished.returncode == 0:
            made[key] = run_dir
        return finished.returncode, finished.output

    return run


def check_warm(
    project: Path,
    script: str,
    flags: list[str],
    runs_dir: Path,
    capsys: pytest.CaptureFixture[str],
    reference_script: str | None = None,
    made: dict[tuple, Path] | None = None,
) -> Run:
    """``python -m tools.checks.check_equivalence --nproc 2 [--reference-script R] SCRIPT FLAGS`` from the copy's
    folder, its runs forked warm; fails the test unless it says SAME. Returns the two-process run."""
    runner = warm_runner(project, made)
    code = check_equivalence.check(
        script, ["--device", "cpu", *flags], 2, runs_dir, runner, reference_script=reference_script
    )
    output = capsys.readouterr()
    command = [sys.executable, "-m", "tools.checks.check_equivalence", "--nproc", "2", script, *flags]
    check = Run(command, code, output.out + output.err, runs_dir / "candidate", warm=True)
    assert code == check_equivalence.SAME, check.describe()
    assert output.out.splitlines()[-1].startswith("SAME:"), check.describe()
    return check
