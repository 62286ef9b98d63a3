"""The memory estimator's formulas, the comparison table, and the FLOP count behind MFU, in process.

The estimator is checked against real runs in test_equivalence.py, which
already launches DDP and every FSDP mode; here only what needs no launch.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from common.bookkeeping import model_flops_utilization, peak_flops
from common.distributed import local_state_bytes
from common.models import GPT, GPTConfig, transformer_flops_per_token
from tools.benchmarks import compare_strategies
from tools.benchmarks.compare_strategies import STRATEGIES, markdown_table, parse_args, planned_runs
from tools.estimates import estimate_memory
from tools.estimates.estimate_memory import (
    GIB,
    between_steps,
    count_label,
    estimate_all,
    estimate_table,
    main,
)
from tools.estimates.in_flight import GatheredUnits, gathered_units, in_flight_bytes
from tools.estimates.shard_sizes import largest_shard_numel

TINY = GPTConfig(vocab_size=16, block_size=32, n_layer=2, n_head=4, d_model=64)


def tiny_shapes() -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in GPT(TINY).parameters()]


def test_one_process_adamw_state_is_predicted_exactly() -> None:
    """A real AdamW step on the GPT: weights, gradients, two moments and a step count per tensor."""
    model = GPT(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Any gradient makes AdamW create its state; a forward pass would only cost time.
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()

    predicted = between_steps([tuple(p.shape) for p in model.parameters()], 1, "replicated")
    assert local_state_bytes(model, optimizer) == predicted.as_dict()


@pytest.mark.parametrize("group", [2, 3, 4, 5])
def test_dim0_shards_follow_torch_chunk(group: int) -> None:
    """FSDP2 cuts each parameter with torch.chunk along dim 0; rank 0 gets the largest piece."""
    shapes = tiny_shapes()
    by_chunk = sum(torch.empty(shape, device="meta").chunk(group)[0].numel() for shape in shapes)
    assert largest_shard_numel(shapes, group, "dim0") == by_chunk
    # Uneven rows make it more than an even split, never less.
    assert by_chunk >= sum(math.prod(s) for s in shapes) / group


def test_flat_shards_split_the_total_evenly() -> None:
    shapes = [(10, 3), (7,)]  # 37 elements
    assert largest_shard_numel(shapes, 1, "flat") == 37
    assert largest_shard_numel(shapes, 4, "flat") == 10
    assert largest_shard_numel(shapes, 4, "replicated") == 37
    with pytest.raises(ValueError, match="layout"):
        largest_shard_numel(shapes, 2, "rows")


def test_formulas_for_seven_billion_parameters() -> None:
    """The design's arithmetic: 16P on a DDP rank, 16P/N under full shard, 16P/M under hybrid."""
    params = 7e9
    by_strategy = {
        e.strategy: e for e in estimate_all(params, world_size=8, hybrid_group=4, layers=32, precision="fp32")
    }
    one_step_count = 4  # AdamW's step, for the single tensor the count is modelled as
    assert by_strategy["ddp"].state.total == 16 * params + one_step_count
    assert by_strategy["full_shard"].state.total == 16 * params / 8 + one_step_count
    assert by_strategy["shard_grad_op"].state == by_strategy["full_shard"].state
    assert by_strategy["hybrid_shard"].state.total == 16 * params / 4 + one_step_count
    assert by_strategy["ddp"].state.optimizer == 2 * by_strategy["ddp"].state.params + one_step_count
    assert [e.shard_group for e in by_strategy.values()] == [1, 8, 8, 4]


def test_in_flight_terms() -> None:
    params, layers = 7e9, 32
    unit = params / layers
    units = GatheredUnits(root=0, block=unit, blocks=layers, reduced=unit, trained=unit)  # --params alone: no root
    assert in_flight_bytes("ddp", units, "fp32") == 0
    assert in_flight_bytes("ddp", units, "bf16") == 2 * params  # autocast's bf16 copy of every weight
    assert in_flight_bytes("ddp", units, "bf16", weight_copies=123) == 123  # or as tools.estimates.activations measured
    # Two Blocks gathered (computing + prefetched) in the compute dtype, and one unit's fp32 gradient where no
    # backward was measured.
    assert in_flight_bytes("full_shard", units, "bf16") == pytest.approx(2 * 2 * unit)
    assert in_flight_bytes("full_shard", units, "bf16", gradients=True) == pytest.approx(2 * 2 * unit + 4 * unit)
    assert in_flight_bytes("hybrid_shard", units, "fp32", gradients=True) == pytest.approx(2 * 4 * unit + 4 * unit)
    # Every unit stays gathered from forward to backward: the whole model in the compute dtype.
    assert in_flight_bytes("shard_grad_op", units, "bf16", gradients=True) == pytest.approx(2 * params + 4 * unit)
    # The root unit stays gathered too.
    rooted = GatheredUnits(root=1000, block=unit, blocks=layers, reduced=unit, trained=unit)
    assert in_flight_bytes("full_shard", rooted, "fp32") == pytest.approx(4 * (1000 + 2 * unit))
    with pytest.raises(ValueError, match="strategy"):
        in_flight_bytes("zero-4", units, "fp32")


def test_gathered_units_are_padded_as_each_fsdp_pads_them() -> None:
    """FSDP2 pads every parameter's rows to a multiple of the group; FSDP1 pads each unit's flat parameter."""
    shapes = {
        "emb.weight": (16, 8),
        "blocks.0.w": (24, 8),
        "blocks.0.b": (24,),
        "blocks.1.w": (24, 8),
        "blocks.1.b": (24,),
    }
    padded = gathered_units(shapes, "dim0", 64, "fp32")
    assert (padded.root, padded.block, padded.blocks) == (64 * 8, 64 * 8 + 64, 2)
    assert (padded.reduced, padded.trained) == (64 * 8 + 64, 24 * 8 + 24)
    # A frozen weight is gathered but not reduced: FSDP2 reduce-scatters the trainable parameters alone,
    # FSDP1 the whole flat gradient of a unit in which anything trains.
    biases = ["blocks.0.b", "blocks.1.b"]
    frozen = gathered_units(shapes, "dim0", 64, "fp32", trainable=biases)
    assert (frozen.block, frozen.reduced, frozen.trained) == (64 * 8 + 64, 64, 24)
    assert gathered_units(shapes, "flat", 64, "fp32", trainable=biases).reduced == 256
    flat = gathered_units(shapes, "flat", 64, "fp32")
    assert (flat.root, flat.block, flat.blocks) == (128, 256, 2)  # a Block's 216 values padded to 4 x 64
    assert gathered_units(shapes, "dim0", 2, "fp32").block == 24 * 8 + 24  # nothing to pad


def test_count_labels() -> None:
    assert [count_label(n) for n in (7e9, 1.3e8, 70e9, 2.5e12, 103808, 12)] == [
        "7B",
        "130M",
        "70B",
        "2.5T",
        "104K",
        "12",
    ]


def test_estimate_table_says_what_fits() -> None:
    estimates = estimate_all(7e9, world_size=8, hybrid_group=8, layers=32, precision="bf16")
    lines = estimate_table(estimates, 80 * GIB).splitlines()
    rows = {line.split("|")[2].strip(): line for line in lines[2:]}
    assert set(rows) == {"ddp", "full_shard", "shard_grad_op", "hybrid_shard"}
    # DDP: 16 x 7e9 bytes = 104.3 GiB before anything is gathered: it cannot fit in 80.
    assert "| 104.3 |" in rows["ddp"] and rows["ddp"].endswith("| no |")
    assert rows["full_shard"].endswith("| yes |")
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_estimator_command(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--params", "1e9", "--world-size", "8", "--gpu-memory", "80"])
    out = capsys.readouterr().out
    assert "hybrid groups of 8" in out and "Activations are NOT included" in out
    main(["--params", "1e9", "7e9", "--world-size", "16", "--gpu-memory", "80", "--shard-group-size", "4"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 2 * 4  # a header, then four strategies per size
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["1B"] * 4 + ["7B"] * 4
    assert [row.split("|")[3].strip() for row in rows[1:5]] == ["1", "16", "16", "4"]
    with pytest.raises(SystemExit):
        main(["--params", "1e9", "--world-size", "8", "--gpu-memory", "80", "--shard-group-size", "3"])


def test_tp_degree_with_a_bare_parameter_count_is_refused_as_needing_a_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--params with --tp-degree was refused as "activations need a model", which --tp-degree is not about."""
    with pytest.raises(SystemExit) as exited:
        main(["--params", "1e9", "--world-size", "8", "--gpu-memory", "80", "--tp-degree", "2"])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert exited.value.code == 2 and len(errors) == 1, errors
    assert "--tp-degree needs --model: tensor parallelism splits the GPT's Blocks" in errors[0], errors


def test_a_world_of_one_takes_any_tp_degree_and_trains_unsplit_as_the_script_does() -> None:
    """--world-size 1 --tp-degree 2 was refused ("does not divide the world size 1"), where the TP script in one
    process trains the whole model unsplit: its row is FSDP2's at one rank."""
    argv = ["--model", "tiny", "--world-size", "1", "--gpu-memory", "80", "--tp-degree", "2", "--batch-size", "1"]
    args = estimate_memory.parse_args([*argv, "--n-layer", "1"])  # one Block: quick to measure
    assert args.tp_degree == 1
    rows = {row.strategy: row for row in estimate_memory.measure_model(args).estimates}
    # What the whole model computes: no split Blocks, nor the copies that stand for their collectives.
    assert rows["fsdp2_tp"].activations == rows["full_shard"].activations


def record(strategy: str, world_size: int, group: int, held: dict[str, int]) -> dict:
    return {
        "strategy": strategy,
        "world_size": world_size,
        "shard_group_size": group,
        "local_state_bytes": held,
        "peak_memory_bytes": 300 * 2**20,
        "step_ms": 12.5,
        "tokens_per_s": 61440.0,
    }


def test_comparison_table_from_records() -> None:
    shapes = {"weight": (1024, 256), "bias": (256,)}  # 262400 elements
    numel = 262400
    ddp = between_steps(shapes.values(), 1, "replicated").as_dict()
    # A full shard that holds 1% more than the estimate, as padding would make it.
    sharded = {kind: int(1.01 * value) for kind, value in between_steps(shapes.values(), 2, "flat").as_dict().items()}
    no_step = record("fsdp2", 2, 2, sharded)
    del no_step["step_ms"], no_step["tokens_per_s"]  # a run that trained no steps has no throughput
    lines = markdown_table([(record("ddp", 2, 1, ddp), shapes), (no_step, shapes)]).splitlines()

    assert len(lines) == 4
    cells = [cell.strip() for cell in lines[2].split("|")[1:-1]]
    assert cells[:3] == ["ddp", "2", "1"]
    params_mib = 4 * numel / 2**20
    assert cells[3] == f"{params_mib:.3f} ({params_mib:.3f})"
    assert cells[7:11] == ["1.00", "300", "12.5", "61440"]
    sharded_cells = [cell.strip() for cell in lines[3].split("|")[1:-1]]
    assert sharded_cells[3] == f"{1.01 * params_mib / 2:.3f} ({params_mib / 2:.3f})"
    assert sharded_cells[7] == "0.51"
    assert sharded_cells[9:11] == ["n/a", "n/a"]


def test_comparison_runs_hybrid_only_where_it_can_shard_and_replicate() -> None:
    hybrid = [s for s in STRATEGIES if s.hybrid]
    assert {s.name for s in hybrid} == {"fsdp1_hybrid_shard", "fsdp2_hsdp"}
    assert [n for n in range(1, 9) if hybrid[0].runs_at(n)] == [4, 6, 8]
    assert all(s.runs_at(1) for s in STRATEGIES if not s.hybrid)


def test_comparison_skips_fsdp2_tp_where_its_script_would_refuse_the_world_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 6 ranks and --tp-degree 2 the tiny model's width (64) does not split over 3 data-parallel groups: the
    script refused it after the runs before it had trained, with torchrun's traceback. Now skipped up front, said in
    one line, by the estimators' rule; and where nothing is left to run, refused."""
    argv = ["--world-sizes", "1", "4", "6", "--strategies", "ddp", "fsdp2_tp", "--out-dir", str(tmp_path / "cmp")]
    args, _ = parse_args(argv)
    planned = [(strategy.name, world_size) for strategy, world_size, _ in planned_runs(args)]
    assert planned == [("ddp", 1), ("fsdp2_tp", 1), ("ddp", 4), ("fsdp2_tp", 4), ("ddp", 6)]

    def finished_run(strategy, world_size: int, run_dir: Path, flags: list[str]) -> dict:
        (run_dir / "metrics.jsonl").write_text("{}\n")
        return {"strategy": strategy.name, "world_size": world_size}

    monkeypatch.setattr(compare_strategies, "launch", finished_run)
    monkeypatch.setattr(compare_strategies, "parameter_shapes", lambda run_dir: {})
    capsys.readouterr()
    assert len(compare_strategies.train_runs(args, [])) == 5
    said = [line for line in capsys.readouterr().out.splitlines() if "fsdp2_tp" in line]
    assert said == [
        "fsdp2_tp at 6 rank(s) skipped: its script would refuse it (the 3 data-parallel groups must divide the "
        "width (64): FSDP2 cuts the q|k|v weight by its columns, evenly only)"
    ]
    with pytest.raises(SystemExit) as exited:
        parse_args(["--world-sizes", "6", "--strategies", "fsdp2_tp", "--out-dir", str(tmp_path / "none")])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert exited.value.code == 2 and len(errors) == 1 and "fsdp2_tp at 6: the 3 data-parallel groups" in errors[0]


def test_transformer_flops_per_token() -> None:
    d, layers, seq, vocab = TINY.d_model, TINY.n_layer, TINY.block_size, TINY.vocab_size
    # Weights that multiply, counted by hand: per block qkv 3d^2, attention out d^2 + d, MLP 8d^2 + 5d,
    # two LayerNorms 4d; then the final LayerNorm and the head. Embedding lookups are not matmuls.
    per_block = 12 * d * d + 10 * d
    weights = layers * per_block + 2 * d + d * vocab
    expected = 6 * weights + 12 * layers * d * seq
    assert transformer_flops_per_token(GPT(TINY)) == expected
    assert transformer_flops_per_token(torch.nn.Linear(3, 3)) is None


# Names as torch.cuda.get_device_name gives them (a GH200's GPU is an H200), and the dense bf16 peak each gets.
GPU_PEAKS = {
    "NVIDIA H100 80GB HBM3": 989,
    "NVIDIA H100 PCIe": 756,
    "NVIDIA H100 NVL": 835,
    "NVIDIA H200": 989,
    "NVIDIA H200 NVL": 835,
    "NVIDIA GH200 480GB": 989,
    "NVIDIA A100-SXM4-80GB": 312,
    "NVIDIA A100 80GB PCIe": 312,
    "NVIDIA L4": 121,
    "NVIDIA L40S": None,  # not in the table: no MFU rather than the L4's
}


def test_each_gpu_gets_its_own_boards_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MFU_PEAK_TFLOPS", raising=False)
    for name, tflops in GPU_PEAKS.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device, name=name: name)
        assert peak_flops(torch.device("cuda", 0)) == (tflops and tflops * 1e12), name


def test_mfu_is_omitted_on_cpu_and_divides_by_every_gpu() -> None:
    assert peak_flops(torch.device("cpu")) is None
    # 1e6 FLOPs per token at 1e8 tokens/s on 2 GPUs of 1e14 FLOP/s each: half of the peak.
    assert model_flops_utilization(1e6, 1e8, 1e14, 2) == pytest.approx(0.5)


def test_compare_strategies_uses_the_device_the_scripts_would() -> None:
    """On a GPU machine the comparison must measure the GPUs, as the scripts do by default."""
    args, passed_on = parse_args(["--world-sizes", "2", "--", "--mixed-precision", "bf16"])
    assert args.device == "auto"
    assert passed_on == ["--mixed-precision", "bf16"]
