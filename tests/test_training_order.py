"""What each rank trains on, epoch by epoch, and the learning rate a run logs for each step.

The equivalence tests run 20 steps, shorter than an epoch, and judge a script against one process of
the same script: a shuffle repeated every epoch, or a logged learning rate one step late, is the same
in both and passes there. These tests look at the epochs and at the schedule themselves.
"""

from __future__ import annotations

import json
import math
import runpy
from pathlib import Path

from tests.harness.noise_floor import MNIST_ARGS, TRANSFORMER_ARGS, NoiseRuns
from tests.harness.runs import REPO, Run, run_script

# Runs the script it is given (argv[1]) and writes, per rank, the batches of example indices the training
# loader deals at each pass over it: one pass per epoch. The training loader is the one over a data set of
# --train-sequences examples. Written into the test's folder when the test runs: no other test needs it.
DEALT_RECORDER = """
import json, os, runpy, sys
from pathlib import Path

from torch.utils.data import DataLoader

script, *flags = sys.argv[1:]
run_dir = Path(flags[flags.index("--run-dir") + 1])
train_size = int(flags[flags.index("--train-sequences") + 1])
passes = []
deal = DataLoader.__iter__


def recording_deal(loader):
    if len(loader.dataset) == train_size:
        passes.append([list(batch) for batch in loader.batch_sampler])
    return deal(loader)


DataLoader.__iter__ = recording_deal
sys.argv = [script, *flags]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    (run_dir / f"dealt-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(passes))
"""

# 63 sequences do not split evenly between 2 ranks: 31 a rank make 3 batches of 8 and 7 left over (a sampler
# that pads instead deals 32, 4 batches, one example twice). 3 steps an epoch, so 7 steps start 3 epochs
# (2 where a mistake makes an epoch 4 steps). 5 held-out sequences in batches of 2: rank 0 scores 2 batches,
# rank 1 one, then runs its first again to keep in step, which must not count.
RANKS, TRAIN_SEQUENCES, BATCH, STEPS, HELDOUT = 2, 63, 8, 7, 5
ORDER_ARGS = [
    *("--train-sequences", str(TRAIN_SEQUENCES), "--batch-size", str(BATCH)),
    *("--heldout-sequences", str(HELDOUT), "--eval-batch-size", "2"),
    *("--max-steps", str(STEPS), "--eval-interval", str(STEPS), "--block-size", "16", "--n-layer", "1"),
    *("--d-model", "32", "--warmup-steps", "1"),
]


def dealt_batches(run: Run) -> list[list[list[list[int]]]]:
    """[rank][epoch][batch] -> the example indices the training loader dealt there."""
    dealt = [json.loads((run.run_dir / f"dealt-rank{rank}.json").read_text()) for rank in range(RANKS)]
    epochs = {len(passes) for passes in dealt}
    assert len(epochs) == 1 and min(epochs) >= 2, (f"epochs begun by each rank: {epochs}", run.describe())
    return dealt


def assert_each_epoch_dealt_once_and_anew(dealt: list[list[list[list[int]]]]) -> None:
    for epoch in range(len(dealt[0])):
        batches = [dealt[rank][epoch] for rank in range(RANKS)]
        counts = [len(of_rank) for of_rank in batches]
        assert len(set(counts)) == 1, f"epoch {epoch + 1}: the ranks got different numbers of batches: {counts}"
        sizes = {len(batch) for of_rank in batches for batch in of_rank}
        assert sizes == {BATCH}, f"epoch {epoch + 1}: a batch not of --batch-size {BATCH}: sizes {sorted(sizes)}"
        examples = [index for of_rank in batches for batch in of_rank for index in batch]
        twice = sorted({index for index in examples if examples.count(index) > 1})
        assert not twice, f"epoch {epoch + 1}: examples dealt twice (to one rank or to two): {twice}"
        for earlier in range(epoch):
            assert batches != [dealt[rank][earlier] for rank in range(RANKS)], (
                f"epoch {epoch + 1} dealt the same order as epoch {earlier + 1}: one shuffle repeated"
            )


def test_the_ranks_are_dealt_each_example_once_an_epoch_and_an_evaluation(tmp_path: Path) -> None:
    """Every epoch the ranks get as many full batches each, no example twice, in an order no earlier
    epoch had: otherwise a rank waits alone in a collective, examples weigh double, or every epoch
    repeats the first one's order. The evaluation, over shards one batch apart, counts each held-out
    sequence once."""
    recorder = tmp_path / "record_dealt.py"
    recorder.write_text(DEALT_RECORDER)
    run = run_script("ddp/train_transformer.py", ORDER_ARGS, tmp_path / "run", nproc=RANKS, wrapper=[str(recorder)])
    run.check()
    assert_each_epoch_dealt_once_and_anew(dealt_batches(run))
    counted = run.final()["eval_samples"]
    assert counted == HELDOUT, f"the evaluation counted {counted} held-out sequences of {HELDOUT}"


def schedule_lr(peak: float, warmup: int, total: int, min_ratio: float, steps_taken: int) -> float:
    """The documented schedule: the learning rate of the step after ``steps_taken`` steps. It climbs in
    equal parts to ``peak`` over the first ``warmup`` steps, then falls along half a cosine to
    ``min_ratio * peak`` once all ``total`` steps are taken."""
    if steps_taken < warmup:
        return peak * (steps_taken + 1) / warmup
    done = (steps_taken - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * min(1.0, done))) / 2)


def test_the_logged_lr_is_the_schedules_after_each_step(transformer_noise: NoiseRuns, tmp_path: Path) -> None:
    """A train record of step s logs the learning rate the run goes on with after s steps (the schedule at s),
    checked on the DDP transformer's one-process reference run, against the formula rather than another run."""
    parse_args = runpy.run_path(str(REPO / "ddp/train_transformer.py"))["parse_args"]
    args, _ = parse_args([*TRANSFORMER_ARGS, "--run-dir", str(tmp_path / "unused")])
    records = [json.loads(line) for line in (transformer_noise.reference / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["lr"] for r in records if r["event"] == "train"}
    assert sorted(logged) == list(range(1, args.max_steps + 1)), sorted(logged)
    wrong = {
        step: (lr, expected)
        for step, lr in logged.items()
        if not math.isclose(
            lr, expected := schedule_lr(args.lr, args.warmup_steps, args.max_steps, args.min_lr_ratio, step)
        )
    }
    assert not wrong, f"logged lr is not the schedule's after that step, (logged, schedule) by step: {wrong}"


def test_the_logged_lr_of_the_cnn_decays_once_an_epoch(mnist_noise: NoiseRuns, tmp_path: Path) -> None:
    """The MNIST scripts' StepLR: every step of epoch e logs --lr times --gamma to the power e - 1, checked on
    the DDP CNN's one-process reference run (its steps are all in the first epoch, at the full --lr)."""
    parse_args = runpy.run_path(str(REPO / "ddp/train_mnist.py"))["parse_args"]
    args, _ = parse_args([*MNIST_ARGS, "--synthetic", "--run-dir", str(tmp_path / "unused")])
    records = [json.loads(line) for line in (mnist_noise.reference / "metrics.jsonl").read_text().splitlines()]
    logged = [(r["step"], r["epoch"], r["lr"]) for r in records if r["event"] == "train"]
    assert [step for step, _, _ in logged] == list(range(1, args.max_steps + 1)), logged
    wrong = [(step, lr) for step, epoch, lr in logged if not math.isclose(lr, args.lr * args.gamma ** (epoch - 1))]
    assert not wrong, f"logged lr is not --lr {args.lr} x --gamma {args.gamma} per epoch before, (step, lr): {wrong}"
