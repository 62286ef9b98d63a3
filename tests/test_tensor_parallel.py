"""FSDP2 plus tensor parallelism on a 2-D mesh (fsdp/train_transformer_fsdp2_tp.py) trains what one process trains.

The one-process reference and its twins are the session's ``transformer_noise``: the DDP script at one
process, which builds the same weights and trains the same examples as the TP script at one process (a
world of one trains the model unsplit). So each case here costs only its own ranks.

Two cases, the cheapest that cover the acceptance of issue 57: 1 x 2 (tensor parallelism alone, all 20
steps), and 2 x 2 stopped after a few steps, then resumed at 1 x 2 from its sharded checkpoint. The second
is the 2 x 2 equivalence too: the resumed run's history holds the 2 x 2 steps, and the comparison reads
every step. A separate 2 x 2 run of all 20 steps would add about 40 CPU-seconds (four ranks on two cores)
and check nothing these two do not.

The estimators' side (tools.estimates.tensor_parallel): the 1 x 2 run's collectives, and a 2 x 2 run of three
steps (its third is the measured one), against the formula, the estimate and the simulation on the fake
process group; at 256 ranks, where padding shows which dimension FSDP2 cuts, the estimate against the
simulation alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.collectives import Traffic
from common.models import GPT, GPTConfig
from tests.harness.cases import NEEDS_FSDP2_ON_CPU
from tests.harness.noise_floor import (
    TRANSFORMER_ARGS,
    TRANSFORMER_STEPS,
    NoiseRuns,
    assert_same_training,
    assert_step_1_as_one_process,
)
from tests.harness.runs import Run, run_script, run_until_stopped
from tools.benchmarks.compare_strategies import estimated_state, markdown_table, tensor_parallel_of
from tools.estimates import estimate_communication, estimate_memory, simulate
from tools.estimates.modelled_collectives import run_estimate
from tools.model_shapes import gpt_parameter_shapes
from tools.runs import export_checkpoint

TP_SCRIPT = "fsdp/train_transformer_fsdp2_tp.py"
TP_2 = ["--tp-degree", "2"]
# What a first step unlike one process's points at: the split is the only thing a TP run adds to it. A batch split
# where the sequence is meant trained 20 steps silently; an even held-out count would have let it reach the end.
PLACEMENT = (
    "the tensor-parallel split (each tensor's placement, each rank's share of the batch) does not compute what one "
    "process computes"
)

pytestmark = NEEDS_FSDP2_ON_CPU


def assert_mesh(run: Run, groups: int) -> None:
    line = f"2-D mesh: {groups} data-parallel group(s) of 2 tensor-parallel rank(s)"
    assert run.output.count(line) >= 1, f"no {line!r}\n{run.describe()}"


def assert_scored_once(run: Run, reference: Path) -> None:
    """The ranks of a group score the same sequences: the evaluation must count them once."""
    scored = run.final()["eval_samples"]
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    expected = records[-1]["eval_samples"]
    assert scored == expected, f"eval_samples {scored}, one process {expected}\n{run.describe()}"


def shapes_of(final: dict) -> dict[str, tuple[int, ...]]:
    return gpt_parameter_shapes(GPTConfig(**final["model_config"]))


def tensor_parallel_bytes(final: dict) -> dict[str, int]:
    """The formula of issue 57 in its sequence-parallel form, for a step of one micro-batch: per Block, 2
    all-gathers of the sequence and 2 reduce-scatters forward, and the same backward, each the micro-batch's
    hidden states (batch x block_size x d_model, fp32 here); the head's gather and its gradient's scatter; the
    embeddings' gradient gathered. All-reduces: loss_parallel's 3 fp32 values per token."""
    config, groups = final["model_config"], final["shard_group_size"]
    batch = final["global_batch_size"] // groups
    hidden = batch * config["block_size"] * config["d_model"] * 4
    layers = config["n_layer"]
    return {
        "all_gather": (4 * layers + 2) * hidden,
        "reduce_scatter": (4 * layers + 1) * hidden,
        "all_reduce": 3 * batch * config["block_size"] * 4,
    }


def assert_sent_as_estimated(final: dict) -> None:
    """The measured step's collectives, by kind, equal the estimate's (tools.estimates.tensor_parallel)."""
    estimate = run_estimate(
        "fsdp2_tp", shapes_of(final), final["world_size"], final["shard_group_size"], tp=tensor_parallel_of(final)
    )
    sent = final["comm_bytes_per_step"]
    assert (estimate.bytes, estimate.counts) == (sent, final["collectives_per_step"]), final
    assert estimate.ring_bytes == pytest.approx(final["comm_ring_bytes_per_step"], rel=1e-12)


def assert_sent_as_the_formula_says(final: dict) -> None:
    """At 1 x 2 FSDP2 shards over one group and sends nothing: every gather and scatter is tensor parallelism's,
    and the all-reduces are the loss's plus a few small ones: the LayerNorms' gradients (d_model values each),
    the gradient norm (one fp32 per tensor), the loss check (8 bytes)."""
    formula, sent = tensor_parallel_bytes(final), final["comm_bytes_per_step"]
    assert {kind: sent[kind] for kind in ("all_gather", "reduce_scatter")} == {
        kind: formula[kind] for kind in ("all_gather", "reduce_scatter")
    }, (formula, sent)
    config = final["model_config"]
    norms = (2 * config["n_layer"] + 1) * 2 * config["d_model"] * 4
    assert formula["all_reduce"] + norms < sent["all_reduce"] < formula["all_reduce"] + norms + 1024, (formula, sent)


def test_tensor_parallel_alone_1x2_matches_one_process(transformer_noise: NoiseRuns, tmp_path: Path) -> None:
    run = run_script(TP_SCRIPT, [*TRANSFORMER_ARGS, *TP_2], tmp_path, nproc=2)
    assert_step_1_as_one_process(transformer_noise, run, PLACEMENT)
    run.check()
    assert_mesh(run, groups=1)
    assert_same_training(transformer_noise, tmp_path, run.describe(), TRANSFORMER_STEPS)
    assert_scored_once(run, transformer_noise.reference)
    assert_sent_as_estimated(run.final())
    assert_sent_as_the_formula_says(run.final())


def test_2x2_stopped_and_resumed_at_1x2_matches_one_process(transformer_noise: NoiseRuns, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    stopped = run_until_stopped(TP_SCRIPT, [*TRANSFORMER_ARGS, *TP_2], run_dir, nproc=4, stop_after=4)
    assert_step_1_as_one_process(transformer_noise, stopped, PLACEMENT)
    stopped.check()
    assert_mesh(stopped, groups=2)
    run = run_script(TP_SCRIPT, [*TRANSFORMER_ARGS, *TP_2, "--resume"], run_dir, nproc=2).check()
    assert_mesh(run, groups=1)
    (resume,) = run.events("resume")
    assert resume["world_size"] == 2 and 4 <= resume["step"] < TRANSFORMER_STEPS, resume
    # The 2 x 2 steps before the checkpoint and the 1 x 2 steps after it, against one process.
    assert_same_training(transformer_noise, run_dir, run.describe(), TRANSFORMER_STEPS)
    assert_scored_once(run, transformer_noise.reference)
    assert_exported_as_the_model_holds_it(run_dir, tmp_path, GPTConfig(**run.final()["model_config"]))


def assert_exported_as_the_model_holds_it(run_dir: Path, tmp_path: Path, config: GPTConfig) -> None:
    """The stop's sharded checkpoint, which the resumed run just trained on as one process would, exported loads
    strictly into the GPT it belongs to: an export once wrote its split q|k|v weights as (3, d, d)."""
    (checkpoint,) = (run_dir / "checkpoints").glob("step-*")
    assert export_checkpoint.main([str(checkpoint), str(tmp_path / "exported.pt")]) == 0
    exported = torch.load(tmp_path / "exported.pt", weights_only=True)
    GPT(config).load_state_dict(exported)  # strict: every name and shape


def test_2x2_holds_and_sends_what_the_estimate_and_the_simulation_say(tmp_path: Path) -> None:
    """Per-rank state at 2 x 2, measured (the busiest rank's), equals the estimate's and the simulated rank's,
    byte for byte; so do the step's collectives. Three steps: the runs measure their third."""
    flags = ["--model", "tiny", "--max-steps", "3", "--eval-interval", "1000", "--heldout-sequences", "8"]
    final = run_script(TP_SCRIPT, [*flags, "--batch-size", "4", *TP_2], tmp_path, nproc=4).check().final()
    assert (final["world_size"], final["shard_group_size"]) == (4, 2)
    (job,) = simulate.parse_args(["--world-size", "4", "--strategy", "fsdp2_tp", "--batch-size", "4"]).jobs
    simulated = simulate.simulate(job)
    assert {kind: simulated[f"{kind}_bytes"] for kind in ("params", "grads", "optimizer")} == final["local_state_bytes"]
    assert estimated_state(final, shapes_of(final)).as_dict() == final["local_state_bytes"]
    memory = estimate_memory.parse_args(
        ["--model", "tiny", "--world-size", "4", "--gpu-memory", "1", "--tp-degree", "2"]
    )
    (row,) = [e for e in estimate_memory.measure_model(memory).estimates if e.strategy == "fsdp2_tp"]
    assert row.state.as_dict() == final["local_state_bytes"]
    assert_sent_as_estimated(final)
    # The simulated step does not log, so it skips the loss check's one int64 all-reduce over the world.
    simulated_sent = Traffic.of(simulated["collectives"]) + Traffic.of([("all_reduce", 8, 4)])
    assert simulated_sent.bytes == final["comm_bytes_per_step"]
    # compare_strategies' row of this run: each measured figure beside the same estimate.
    cells = [cell.strip() for cell in markdown_table([(final, shapes_of(final))]).splitlines()[2].split("|")[1:-1]]
    assert cells[:3] == ["fsdp2_tp", "4", "4"], cells
    for cell in [*cells[3:7], *cells[11:]]:
        measured, estimated = cell.rstrip(")").split(" (")
        assert measured == estimated, cells


@pytest.mark.parametrize(
    ("world_size", "tp_degree", "fine_tuning"), [(8, 2, ["--freeze", "blocks.0.ln*"]), (256, 4, [])]
)
def test_estimators_agree_with_the_simulation_of_fsdp2_tp(world_size: int, tp_degree: int, fine_tuning: list) -> None:
    """At 256 ranks (64 groups of 4) each rank's pieces are padded to whole rows or columns: the q|k|v piece is
    cut by its 64 columns (the script's shard_placement_fn), not its 48 rows, and only the right one adds up.
    At 8, a frozen LayerNorm: torch's SequenceParallel once gave it a gradient again, silently (the script
    turns it off anew), and it held gradients and Adam's moments the estimate had not counted."""
    argv = ["--world-size", str(world_size), "--strategy", "fsdp2_tp", "--tp-degree", str(tp_degree), *fine_tuning]
    (job,) = simulate.parse_args(argv).jobs  # the script's batch, 32 sequences a group
    result = simulate.simulate(job)
    for name in ("params_bytes", "grads_bytes", "optimizer_bytes", "sent_bytes_per_step"):
        assert result["estimate"][name] == result[name], name
    # The peak: the activations of what one rank computes (its slice of the sequence between the Blocks, its heads
    # and hidden units inside them, its slice of the vocabulary). Measured: equal to 4 bytes at 8 ranks; at 256, where
    # the step peaks in forward at the head's gather of the sequence, the simulated rank holds 0.22% more.
    assert result["estimate"]["peak_bytes"] == pytest.approx(result["peak_bytes"], rel=0.005)


def test_estimators_refuse_groups_that_do_not_divide_the_width(capsys: pytest.CaptureFixture[str]) -> None:
    """FSDP2 cuts the q|k|v piece by its columns and refuses an uneven cut there: 256 groups of 4 cannot share
    the tiny preset's 64 columns. Both commands say so before any work, as the script would fail."""
    why = "the 256 data-parallel groups must divide the width (64)"
    commands = [
        (simulate.parse_args, ["--world-size", "1024", "--strategy", "fsdp2_tp", "--tp-degree", "4"]),
        (estimate_communication.parse_args, ["--model", "tiny", "--world-size", "1024", "--tp-degree", "4"]),
    ]
    for parse_args, argv in commands:
        with pytest.raises(SystemExit) as refused:
            parse_args(argv)
        assert refused.value.code == 2 and why in capsys.readouterr().err, argv


def test_fsdp_collectives_over_as_many_groups_as_a_tp_group_has_ranks_cross_machines() -> None:
    """16 ranks, TP groups of 4 (one machine each): FSDP2 gathers over the 4 groups, one rank a machine, and TP
    gathers over the 4 ranks of a machine. The step time once took every all-reduce over 4 ranks for TP's and
    priced FSDP2's at the fast links (medium preset: 1.91 ms across machines at 16 ranks, against 4.74 at 8 and
    6.96 at 32); under sequence parallelism, which gathers and scatters, kind and size tell them apart no more."""
    fsdp_gather, tp_gather = ("all_gather", 10**9, 4), ("all_gather", 10**9, 4)  # alike but for whose they are
    fast, slow = 450e9, 12.5e9
    seconds = estimate_communication.tensor_parallel_seconds(
        [fsdp_gather, tp_gather], [tp_gather], 4, fast, slow, spans=True
    )
    share = 10**9 * 3 / 4
    assert seconds == pytest.approx(share / slow + share / fast, rel=1e-9), seconds
