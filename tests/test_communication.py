"""The communication formulas and the step observer, in process.

What real runs send is checked against these formulas in test_equivalence.py, which already
launches DDP and every FSDP mode; here only what needs no launch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from common.collectives import CollectiveRecorder, StepObserver, measured_step, ring_link_bytes
from common.distributed import DistContext, teardown_distributed, torch_at_least
from common.mnist import MnistNet
from common.models import GPT, GPTConfig
from tools.benchmarks.compare_strategies import markdown_table, micro_steps
from tools.checks.comm_check import all_gather_single, reduce_scatter_single
from tools.estimates.estimate_communication import main, parse_args
from tools.estimates.modelled_collectives import (
    FsdpBehaviour,
    Unit,
    current_behaviour,
    ddp_bucket_sizes,
    ddp_step,
    fsdp_step,
    run_estimate,
)
from tools.estimates.shard_sizes import fsdp1_flat_elements, fsdp2_padded_elements, fsdp_units

TINY = GPTConfig(vocab_size=16, block_size=32, n_layer=2, n_head=4, d_model=64)
MIB = 2**20


def named_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def test_ring_algorithm_bytes_per_link() -> None:
    """What each rank sends on a ring of n: (n-1)/n of a gather or scatter, twice that for an all-reduce."""
    assert ring_link_bytes("all_gather", 800, 4) == 600
    assert ring_link_bytes("reduce_scatter", 800, 4) == 600
    assert ring_link_bytes("all_reduce", 800, 4) == 1200
    assert ring_link_bytes("broadcast", 800, 4) == 800
    assert ring_link_bytes("all_reduce", 800, 1) == 0  # alone, nothing leaves the rank


def test_ddp_buckets_close_at_one_then_twenty_five_mebibytes() -> None:
    # Filled from the last parameter backwards; a parameter never splits, so buckets overshoot.
    assert ddp_bucket_sizes([10 * MIB, MIB // 2, MIB // 2]) == [MIB, 10 * MIB]
    assert ddp_bucket_sizes([20 * MIB, 20 * MIB, 2 * MIB]) == [2 * MIB, 40 * MIB]
    tiny = [4 * math.prod(s) for s in named_shapes(GPT(TINY)).values()]
    assert ddp_bucket_sizes(tiny) == [sum(tiny)]  # 415 KB: one bucket
    # The CNN: fc1's 4.7 MB weight closes the first bucket, the convolutions make the second.
    assert len(ddp_bucket_sizes([4 * math.prod(s) for s in named_shapes(MnistNet()).values()])) == 2


def equal_units(params: int, layers: int, reshard: bool = True) -> list[Unit]:
    return [Unit(f"u{i}", params // layers, reshard) for i in range(layers)]


def test_the_textbook_volumes() -> None:
    """DDP all-reduces 4P; full shard gathers twice and reduce-scatters once; bf16 halves the gathers."""
    params, layers, n = 8_000, 8, 4
    ddp = ddp_step([params], n)
    assert ddp.bytes == {"all_reduce": 4 * params}
    full = fsdp_step(equal_units(params, layers), n)
    assert full.bytes == {"all_gather": 2 * 4 * params, "reduce_scatter": 4 * params}
    assert full.counts == {"all_gather": 2 * layers, "reduce_scatter": layers}
    # On a ring: 3 x (n-1)/n x 4P against DDP's 2 x (n-1)/n x 4P. In bf16 the gathers halve: even.
    assert full.total_ring_bytes == pytest.approx(1.5 * ddp.total_ring_bytes)
    bf16 = fsdp_step(equal_units(params, layers), n, gather_bytes=2)
    assert bf16.bytes["all_gather"] == 2 * 2 * params
    assert bf16.total_ring_bytes == pytest.approx(ddp.total_ring_bytes)
    # shard_grad_op: the units stay gathered from forward to backward, one all-gather each.
    assert fsdp_step(equal_units(params, layers, reshard=False), n).bytes["all_gather"] == 4 * params
    # Hybrid, 2 groups of 2: the same traffic inside a group, plus an all-reduce of each reduced shard.
    hybrid = fsdp_step(equal_units(params, layers), shard_group=2, replicas=2)
    assert hybrid.bytes == {"all_gather": 2 * 4 * params, "reduce_scatter": 4 * params, "all_reduce": 4 * params // 2}
    assert hybrid.ring_bytes["all_reduce"] == 4 * params // 2  # 2 (n-1)/n = 1 across 2 groups


def test_accumulation() -> None:
    params, layers, n = 8_000, 4, 2
    # DDP under no_sync: one all-reduce per optimizer step, whatever K is.
    assert ddp_step([params], n, micro_steps=4) == ddp_step([params], n)
    assert ddp_step([params], n, micro_steps=4, sync_every_micro_step=True).bytes == {"all_reduce": 4 * 4 * params}
    # FSDP1 full_shard and FSDP2: gathered again in every micro-step, reduced once.
    regather = fsdp_step(equal_units(params, layers), n, micro_steps=2)
    assert regather.bytes == {"all_gather": 2 * 2 * 4 * params, "reduce_scatter": 4 * params}
    # FSDP1 shard_grad_op keeps its units gathered between micro-steps: the all-gathers of K = 1.
    kept = fsdp_step(equal_units(params, layers, reshard=False), n, micro_steps=2, regather_each_micro_step=False)
    assert kept.bytes == fsdp_step(equal_units(params, layers, reshard=False), n).bytes
    # Without no_sync every micro-step reduce-scatters, and frees what it gathered (FSDP1 rule,
    # measured for shard_grad_op and full_shard at K = 2).
    every = fsdp_step(equal_units(params, layers), n, micro_steps=2, sync_every_micro_step=True)
    assert every.bytes == {"all_gather": 2 * 2 * 4 * params, "reduce_scatter": 2 * 4 * params}
    synced = fsdp_step(
        equal_units(params, layers, reshard=False),
        n,
        micro_steps=2,
        regather_each_micro_step=False,
        sync_every_micro_step=True,
    )
    assert synced.bytes == {"all_gather": 2 * 4 * params, "reduce_scatter": 2 * 4 * params}


def test_padding() -> None:
    # FSDP1 (use_orig_params): each parameter starts at 16 bytes, then the unit pads to the group.
    assert fsdp1_flat_elements([10, 3, 5], shard_group=4, compute_bytes=4) == 24  # 10+2, 3+1, 5 = 21 -> 24
    assert fsdp1_flat_elements([10, 3, 5], shard_group=4, compute_bytes=2) == 32  # 10+6, 3+5, 5 = 29 -> 32
    assert fsdp1_flat_elements([12, 4], shard_group=2, compute_bytes=4) == 16  # nothing to pad
    # FSDP2: every parameter's first dimension padded to the group: 64 rows in 3 become 66.
    assert fsdp2_padded_elements([(64, 64), (64,)], 3) == 66 * 64 + 66
    assert fsdp2_padded_elements([(64, 64), (64,)], 2) == 64 * 64 + 64


def test_units_as_the_scripts_wrap_them() -> None:
    units = fsdp_units(named_shapes(GPT(TINY)))
    assert list(units) == ["root", "blocks.0", "blocks.1"]
    assert sum(map(math.prod, units["root"])) == 16 * 64 + 32 * 64 + 2 * 64 + 64 * 16  # embeddings, ln_f, head
    mnist = fsdp_units(named_shapes(MnistNet()), ["fc1."])
    assert [len(shapes) for shapes in mnist.values()] == [6, 2]


def test_behaviour_of_the_scripts() -> None:
    """What each script's FSDP calls decide; a change to a script changes these."""
    # Both transformer scripts keep the root and the last Block gathered after forward; FSDP1 makes
    # the last Block SHARD_GRAD_OP, which also keeps it between no_sync micro-steps.
    kept = FsdpBehaviour(root_reshards=False, last_block_reshards=False, last_block_regathers=False)
    assert current_behaviour("fsdp1_full_shard") == kept
    assert current_behaviour("fsdp1_hybrid_shard") == kept
    assert current_behaviour("fsdp2") == FsdpBehaviour(root_reshards=False, last_block_reshards=False)
    # The MNIST script's size-based units: only FSDP1's root stays gathered.
    assert current_behaviour("fsdp1_full_shard", transformer=False) == FsdpBehaviour(root_reshards=False)
    # FSDP1 in low precision reduces every micro-step rather than accumulate in bf16 under no_sync.
    assert current_behaviour("fsdp1_full_shard", precision="bf16").sync_every_micro_step
    assert not current_behaviour("fsdp2", precision="bf16").sync_every_micro_step
    sgo = current_behaviour("fsdp1_shard_grad_op")
    assert not (sgo.blocks_reshard or sgo.root_reshards or sgo.regather_each_micro_step)
    assert not current_behaviour("fsdp2", reshard_after_forward=False).blocks_reshard
    with pytest.raises(ValueError, match="strategy"):
        current_behaviour("ddp")


def test_run_estimate_of_the_tiny_gpt() -> None:
    shapes = named_shapes(GPT(TINY))
    params = sum(map(math.prod, shapes.values()))
    root = 16 * 64 + 32 * 64 + 2 * 64 + 64 * 16
    block = sum(map(math.prod, fsdp_units(shapes)["blocks.1"]))
    ddp = run_estimate("ddp", shapes, 2, 1)
    assert ddp.bytes == {"all_reduce": 4 * params + 8}  # the gradients and the loss agreement's int64
    # Both FSDP scripts gather every unit before forward, and again before backward all but the root
    # and the last Block: the same bytes under FSDP1 and FSDP2.
    fsdp1 = run_estimate("fsdp1_full_shard", shapes, 2, 2)
    assert fsdp1.bytes == {
        "all_gather": 4 * (2 * params - root - block),
        "reduce_scatter": 4 * params,
        "all_reduce": 12,
    }
    fsdp2 = run_estimate("fsdp2", shapes, 2, 2)
    assert fsdp2.bytes["all_gather"] == fsdp1.bytes["all_gather"]
    assert fsdp2.counts["all_gather"] == fsdp1.counts["all_gather"] == 4  # 3 units forward, blocks.0 again
    assert fsdp2.bytes["all_reduce"] == 8 + 4 * len(shapes)  # DTensor's norm: one fp32 per parameter tensor
    every_unit_again = FsdpBehaviour()
    assert run_estimate("fsdp2", shapes, 2, 2, behaviour=every_unit_again).bytes["all_gather"] == 2 * 4 * params
    bf16 = run_estimate("fsdp2", shapes, 2, 2, precision="bf16")
    assert bf16.bytes["all_gather"] == fsdp2.bytes["all_gather"] // 2
    assert bf16.bytes["reduce_scatter"] == fsdp2.bytes["reduce_scatter"]  # reduced in fp32
    assert run_estimate("ddp", shapes, 2, 1, loss_check=False).bytes == {"all_reduce": 4 * params}


def test_estimator_command(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--params", "1e9", "7e9", "--world-size", "8", "--shard-group-size", "4", "--precision", "bf16"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert "2 machine(s), 12.5 GB/s between" in rows[0]
    cells = {(r.split("|")[1].strip(), r.split("|")[2].strip()): r.split("|") for r in rows[1:]}
    assert len(cells) == 2 * 4
    # Hybrid keeps its gathers on the fast links inside a machine: far less time than full shard across two.
    assert "s" in cells[("7B", "full_shard")][10] and "ms" in cells[("7B", "hybrid_shard")][10]
    with pytest.raises(SystemExit):
        main(["--params", "1e9", "--world-size", "8", "--shard-group-size", "3"])


def test_a_world_of_one_takes_any_tp_degree_and_trains_unsplit_as_the_script_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--world-size 1 --tp-degree 2 was refused ("does not divide the world size 1"), where the TP script in one
    process trains the whole model unsplit: no tensor-parallel all-reduce, FSDP2's row at one rank."""
    assert parse_args(["--model", "tiny", "--world-size", "1", "--tp-degree", "2"]).tp_degree == 1
    main(["--model", "tiny", "--world-size", "1", "--tp-degree", "2"])
    rows = {r.split("|")[1].strip(): r.split("|")[2:] for r in capsys.readouterr().out.splitlines() if r[:2] == "| "}
    assert rows["fsdp2_tp"] == rows["fsdp2"]


@pytest.fixture
def world_of_one() -> Iterator[DistContext]:
    """A one-rank gloo group in this process, as a plain `python script.py` makes."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DistContext(0, 0, 1, 1, torch.device("cpu"), "gloo")
    finally:
        teardown_distributed()  # as the scripts end: a plain destroy can deadlock on torch < 2.8


def test_recorder_counts_whole_messages_and_nothing_else(world_of_one: DistContext) -> None:
    shard, full = torch.ones(6), torch.zeros(6)
    with CollectiveRecorder() as recorder:
        torch.ones(3).add_(1)  # not a collective
        dist.all_reduce(torch.ones(5))
        all_gather_single(full, shard)
        dist.all_gather([torch.zeros(2, dtype=torch.bfloat16)], torch.ones(2, dtype=torch.bfloat16))
        reduce_scatter_single(torch.zeros(6), torch.ones(6))
        dist.broadcast(torch.ones(4, dtype=torch.int64), src=0)
        # What DTensor calls: a functional collective, named by its group.
        funcol.all_reduce(torch.ones(7), "sum", dist.group.WORLD).wait()
    seen = [(c.kind, c.message_bytes, c.group_size) for c in recorder.collectives]
    assert seen == [
        ("all_reduce", 20, 1),
        ("all_gather", 24, 1),
        ("all_gather", 4, 1),
        ("reduce_scatter", 24, 1),
        ("broadcast", 32, 1),
        ("all_reduce", 28, 1),
    ]


def test_observer_measures_one_step_and_traces_a_window(world_of_one: DistContext, tmp_path: Path) -> None:
    assert measured_step(0) == 3 and measured_step(1) == 3 and measured_step(2) == 4
    observer = StepObserver(tmp_path, world_of_one, profile_steps=2)
    for step in range(5):
        observer.begin_step(step)
        dist.all_reduce(torch.ones(step + 1))  # a different size every step
        observer.end_step()
    # Measured: the 4th step (after the trace of steps 2 and 3); it all-reduced 4 floats.
    assert observer.record() == {
        "comm_bytes_per_step": {"all_reduce": 16},
        "collectives_per_step": {"all_reduce": 1},
        "comm_ring_bytes_per_step": {"all_reduce": 0.0},
    }
    trace = json.loads((tmp_path / "profile" / "rank-0.json").read_text())
    names = [event.get("name", "") for event in trace["traceEvents"]]
    assert [n for n in names if n.startswith("optimizer step")] == ["optimizer step 2", "optimizer step 3"]
    assert names.count("c10d::allreduce_") == 2


def test_a_short_run_has_no_measurement(world_of_one: DistContext, tmp_path: Path) -> None:
    observer = StepObserver(tmp_path, world_of_one)
    for step in range(2):
        observer.begin_step(step)
        observer.end_step()
    assert observer.record() == {}
    assert not (tmp_path / "profile").exists()


def test_comparison_table_shows_measured_and_estimated_communication() -> None:
    shapes = named_shapes(GPT(TINY))
    params = sum(map(math.prod, shapes.values()))
    held = {"params": 4 * params, "grads": 4 * params, "optimizer": 8 * params + 4 * len(shapes)}
    base = {"world_size": 2, "local_state_bytes": held, "peak_memory_bytes": 2**28, "step_ms": 10.0}
    measured = run_estimate("fsdp2", shapes, 2, 2, micro_steps=2).as_record()
    measured["comm_bytes_per_step"]["all_gather"] += 2**20  # 1 MiB more than the formula, to tell them apart
    fsdp2 = {**base, "strategy": "fsdp2", "shard_group_size": 2, **measured}
    short = {**base, "strategy": "ddp", "shard_group_size": 1}  # too few steps to measure one
    lines = markdown_table([(fsdp2, shapes), (short, shapes)], micro_steps=2).splitlines()
    header = [cell.strip() for cell in lines[0].split("|")[-5:-1]]
    assert header == ["all-gather MiB", "reduce-scatter MiB", "all-reduce MiB", "sent per link MiB"]
    cells = [cell.strip() for cell in lines[2].split("|")[1:-1]][-4:]
    first_block = sum(map(math.prod, fsdp_units(shapes)["blocks.0"]))
    # Per micro-step every unit before forward and blocks.0 again before backward; two micro-steps.
    gathered = 2 * 4 * (params + first_block) / MIB
    assert cells[0] == f"{gathered + 1:.3f} ({gathered:.3f})"
    assert cells[1] == f"{4 * params / MIB:.3f} ({4 * params / MIB:.3f})"
    assert [cell.strip() for cell in lines[3].split("|")[1:-1]][-4:] == ["n/a"] * 4
    assert micro_steps(["--lr", "1", "--grad-accum-steps", "2", "--grad-accum-steps", "4"]) == 4
    assert micro_steps(["--batch-size", "3"]) == 1


# The communication recorder (common.collectives) is a TorchDispatchMode; torch.compile runs
# compiled code under such a mode only from torch 2.9 (TorchDispatchMode.ignore_compile_internals).
# Older torch runs the measured step of a --compile run eagerly: same traffic, eager speed.
COMPILED_UNDER_DISPATCH_MODE = (2, 9)


@pytest.mark.skipif(
    not torch_at_least(COMPILED_UNDER_DISPATCH_MODE),
    reason="compiled code runs eagerly under the recorder before torch 2.9",
)
def test_compiled_code_runs_compiled_while_measured() -> None:
    """torch.compile would fall back to eager under an ordinary dispatch mode; the recorder lets it
    run what it compiled, so the measured step computes what the others do."""
    runs = []

    def counting_backend(graph: torch.fx.GraphModule, example_inputs: list) -> object:
        def run(*args: torch.Tensor) -> object:
            runs.append(len(args))
            return graph.forward(*args)

        return run

    compiled = torch.compile(torch.nn.Linear(4, 4), backend=counting_backend)
    compiled(torch.ones(2, 4))
    with CollectiveRecorder():
        compiled(torch.ones(2, 4))
    assert len(runs) == 2


def test_on_one_rank_fsdp1_all_reduces_and_fsdp2_sends_nothing() -> None:
    """Measured by compare_strategies at world size 1: FSDP1 turns into NO_SHARD there."""
    shapes = named_shapes(GPT(TINY))
    params = sum(map(math.prod, shapes.values()))
    fsdp1 = run_estimate("fsdp1_full_shard", shapes, 1, 1, loss_check=False)
    assert fsdp1.bytes == {"all_reduce": 4 * params + 4}  # the gradients, and the norm's one fp32
    assert "all_gather" not in run_estimate("fsdp2", shapes, 1, 1).bytes
