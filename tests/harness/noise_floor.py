"""The settings every test that compares trainings shares, and the noise floor it is judged against.

A candidate run is the same training as the one-process reference when it drifts from it no more
than tools.runs.compare_runs' factor times the twins do: one-process runs of the same training in K
micro-steps, the K that tools.checks.check_equivalence picks. Made once per session by
``shared_noise_runs``, for conftest's ``transformer_noise``, ``variable_length_noise`` and
``mnist_noise`` fixtures.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

from tests.harness.runs import Run, run_script
from tests.harness.wrappers import RECORD_READS
from tools.checks.check_equivalence import plan
from tools.runs.compare_runs import NoiseVerdict, compare_with_noise, noise_report, train_records

GLOBAL_BATCH = 24
COMMON = ["--deterministic", "--global-batch-size", str(GLOBAL_BATCH), "--log-interval", "1"]
# The transformer at its own lr (1e-2) for 20 steps: where fixed tolerances failed (its parameters
# drift 3e-5 to 7e-5 from one process, twins and distributed runs alike). 61 held-out sequences:
# no world size here splits them evenly.
TRANSFORMER_STEPS = 20
TRANSFORMER_ARGS = [
    *COMMON,
    *("--max-steps", str(TRANSFORMER_STEPS), "--eval-interval", str(TRANSFORMER_STEPS)),
    *("--block-size", "32", "--train-sequences", "600", "--heldout-sequences", "61", "--warmup-steps", "3"),
]
# The CNN on the rendered-digit fixture (conftest's tiny_mnist_dir, given with --data-dir) for 20
# steps as well. Not on --synthetic: clamping its noisy pixels to 0..255 leaves many near-ties
# between the max-pool's inputs, and rounding that breaks one tie differently moves the run 1e-3 at
# once; over 20 steps 2 of 15 runs broke one that their six twins had not (README, "Is it the same
# training?"). The fixture's 200 test images also evaluate ten times faster than 2000.
MNIST_STEPS = 20
MNIST_ARGS = [*COMMON, "--max-steps", str(MNIST_STEPS)]
# Sequences of 1 to 32 tokens, padded: where a mean per micro-batch would weigh tokens unequally. Clipped
# at a quarter of the default limit: the reference's gradient norms run 0.47 to 1.47, so it clips at every
# step, and a clip that acts on a micro-step's partial gradient changes what the twins and the candidates
# compute (at 1.0 it clipped 8 of 20 steps, the partial gradients almost never).
VARIABLE_LENGTH_CLIP = 0.25
VARIABLE_LENGTH_ARGS = [*TRANSFORMER_ARGS, "--variable-length", "--grad-clip", str(VARIABLE_LENGTH_CLIP)]
FAMILIES = {
    "transformer": ("ddp/train_transformer.py", TRANSFORMER_ARGS),
    "mnist": ("ddp/train_mnist.py", MNIST_ARGS),
    "variable-length": ("ddp/train_transformer.py", VARIABLE_LENGTH_ARGS),
}
# A broken copy must not only leave the band: it must leave it by this much, so that the band is
# known to be far tighter than the bugs it is there to catch.
BROKEN_MARGIN = 100
# At step 1 every twin starts from the reference's weights and sums the gradient of the same examples in
# another order: its loss and gradient norm are the reference's to rounding. Measured: 2.6e-7 relative at the
# most, in the three families, on AVX-512, AVX2 and torch's plain vector code. A twin further off is not the
# reference's training (a clip of each micro-step's partial gradient put them 0.33 to 0.73 apart), and its
# drift would widen the band until any candidate passed.
STEP_1_RTOL = 1e-5
# The test that holds the reference script against a loop not built from its file, and says which one is wrong.
REFERENCE_AGAINST_A_LOOP = "test_the_reference_script_trains_what_a_loop_of_its_own_trains"


@dataclass
class NoiseRuns:
    """The run directories of the one-process reference and of its twins."""

    reference: Path
    twins: list[Path]

    @property
    def reference_reads(self) -> Path:
        """What the reference's training loader read (tests/harness/record_reads.py)."""
        return self.reference.with_name(self.reference.name + "-reads")

    def unlike_the_reference_at_step_1(self) -> list[str]:
        """Each twin whose step-1 loss or gradient norm is further from the reference's than rounding goes."""
        return [f"{twin.name}'s {unlike}" for twin in self.twins for unlike in self.step_1_unlike(twin)]

    def step_1_unlike(self, run_dir: Path) -> list[str]:
        """The step-1 loss and gradient norm of ``run_dir`` that are further from the reference's than rounding goes
        (all of them where it logged no step 1)."""
        reference = train_records(self.reference)[1]
        first = train_records(run_dir).get(1) if (run_dir / "metrics.jsonl").exists() else None
        if first is None:
            return ["no step 1"]
        return [
            f"{key} {first[key]:.6g} against {reference[key]:.6g}"
            for key in ("loss", "grad_norm")
            if abs(first[key] - reference[key]) > STEP_1_RTOL * abs(reference[key])
        ]

    def verdict(self, candidate: Path) -> NoiseVerdict:
        """How far ``candidate`` drifts from the reference, against how far the twins do."""
        return compare_with_noise(self.reference, candidate, self.twins)


def planned_noise_runs(flags: list[str]) -> list[tuple[str, list[str]]]:
    """The reference and the twins tools.checks.check_equivalence would run: (folder name, flags)."""
    return [(run.name, run.flags) for run in plan(flags, nproc=2) if run.name != "candidate"]


def noise_runs_in(root: Path, flags: list[str]) -> NoiseRuns:
    """The reference and twins ``planned_noise_runs(flags)`` names, in folders under ``root``."""
    names = [name for name, _ in planned_noise_runs(flags)]
    return NoiseRuns(root / names[0], [root / name for name in names[1:]])


def assert_same_training(noise: NoiseRuns, candidate: Path, description: str, steps: int) -> NoiseVerdict:
    """Fail, with the comparison's report and ``description``, unless ``candidate`` ran ``steps`` steps
    within the noise floor of ``noise``, and the twins of that floor are the reference's training at step 1."""
    unlike = noise.unlike_the_reference_at_step_1()
    assert not unlike, (
        "the twins are not the reference's training: at step 1, one process in K micro-steps computed "
        f"{'; '.join(unlike)} (rounding alone: within {STEP_1_RTOL:g} relative). The reference script itself may be "
        f"wrong: tests/test_equivalence.py::{REFERENCE_AGAINST_A_LOOP} says\n{description}"
    )
    verdict = noise.verdict(candidate)
    report = noise_report(verdict)
    assert verdict.steps == steps, f"{report}\n{description}"
    # The reference is the DDP script: when the cases of several scripts fail together, it may be the one wrong.
    assert verdict.same, (
        f"{report}\n(the reference script against a loop of its own: {REFERENCE_AGAINST_A_LOOP})\n{description}"
    )
    return verdict


def assert_step_1_as_one_process(noise: NoiseRuns, run: Run, what: str) -> None:
    """Before anything else, fail naming ``what`` (the layout under test) unless ``run``'s first step computed the
    reference's loss and gradient norm to rounding: the same weights and examples, before any update, so a layout
    that splits the wrong dimension shows here, whatever the run does later (trains on, or crashes)."""
    unlike = noise.step_1_unlike(run.run_dir)
    if unlike == ["no step 1"]:
        run.check()  # a run that failed before its first step: its own error is the reason
    assert not unlike, (
        f"{what}: at step 1, before any update, the run computed {'; '.join(unlike)} of one process "
        f"(rounding alone: within {STEP_1_RTOL:g} relative)\n{run.describe()}"
    )


def shared_noise_runs(tmp_path_factory: pytest.TempPathFactory, family: str, data: tuple[str, ...] = ()) -> NoiseRuns:
    """The one-process reference and its twins for ``family`` (a key of ``FAMILIES``), made once a
    session; ``data`` are the flags that say where its data is.

    Under ``pytest -n`` the first worker to take the lock runs them into a folder all workers share.
    """
    # getbasetemp() is per worker under xdist, and its parent is this session's, shared by the
    # workers. Without xdist the parent is shared by every session of this user, other torch
    # versions' and CPU kernels' too: there the session's own folder is the one to use.
    session = tmp_path_factory.getbasetemp()
    root = (session.parent if "PYTEST_XDIST_WORKER" in os.environ else session) / "noise-floor" / family
    script, flags = FAMILIES[family]
    flags = [*flags, *data]
    root.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{root}.lock"):
        if not (root / "done").exists():
            runs = noise_runs_in(root, flags)
            for name, run_flags in planned_noise_runs(flags):
                recorded = [RECORD_READS, str(runs.reference_reads)] if root / name == runs.reference else []
                run_script(script, run_flags, root / name, wrapper=recorded).check()
            (root / "done").touch()
    return noise_runs_in(root, flags)
