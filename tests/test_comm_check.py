"""tools.checks.comm_check at 2 ranks on the CPU, and tools.estimates.estimate_communication reading what it measured.

The check runs through the warm launcher (tests/harness/launcher.py), as torchrun would start it, on a few
small messages: its figures are noise on this shared machine, but the relations between them, and
the estimator's use of them, hold exactly.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.harness.runs import run_warm
from tools.checks.comm_check import parse_args
from tools.estimates.estimate_communication import main
from tools.estimates.measured_links import CommCheck

MIB = 2**20
SIZES = [MIB, 2 * MIB, 4 * MIB]
OPS = ["all_reduce", "all_gather", "reduce_scatter"]
# At 2 ranks: an all-reduce's link carries 2(n-1)/n = 1 byte per byte of the message, the others 1/2.
BUS_FACTOR = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5}
TABLE_HEADER = "| collective | size (B) | count (elements) | time (us) | algbw (GB/s) | busbw (GB/s) |"


def comm_check(out: Path, *flags: str) -> list[str]:
    return ["tools/checks/comm_check.py", "--device", "cpu", "--dist-timeout", "60", "--out", str(out), *flags]


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """One check at 2 ranks, 1 to 4 MiB, few iterations: its JSON and its console output."""
    folder = tmp_path_factory.mktemp("comm_check")
    out = folder / "comm_check.json"
    flags = ("--min-bytes", "1M", "--max-bytes", "4M", "--warmup", "1", "--iters", "3")
    run = run_warm(comm_check(out, *flags), folder, nproc=2, timeout=120).check()
    return json.loads(out.read_text()), run.output


def test_the_json_says_what_ran_where(measured: tuple[dict, str]) -> None:
    summary, output = measured
    assert (summary["world_size"], summary["local_world_size"], summary["nodes"]) == (2, 2, 1)
    assert (summary["backend"], summary["device"], summary["torch"]) == ("gloo", "cpu", torch.__version__)
    assert summary["device_name"] and summary["dtype"] == "float32"
    assert (summary["warmup"], summary["iters"]) == (1, 3)
    assert [(row["op"], row["bytes"]) for row in summary["results"]] == [(op, size) for op in OPS for size in SIZES]
    # gloo runs the reduce-scatter as an all-reduce of the whole input: the table says so.
    assert any("gloo has no reduce-scatter" in note for note in summary["notes"])
    assert output.count(TABLE_HEADER) == 1, output  # rank 0 prints it; the other rank prints nothing
    assert "note: gloo has no reduce-scatter" in output


def test_bandwidths_are_nccl_tests_definitions(measured: tuple[dict, str]) -> None:
    summary, output = measured
    assert summary["bus_factor"] == BUS_FACTOR
    for row in summary["results"]:
        assert row["elements"] == row["bytes"] // 4 and row["time_s"] > 0
        assert row["algbw_gbps"] == row["bytes"] / row["time_s"] / 1e9  # S / t, in GB/s of 10^9 bytes
        assert row["busbw_gbps"] == row["algbw_gbps"] * BUS_FACTOR[row["op"]]
        printed = (
            f"| {row['op']} | {row['bytes']} | {row['elements']} | {row['time_s'] * 1e6:.1f} | "
            f"{row['algbw_gbps']:.3f} | {row['busbw_gbps']:.3f} |"
        )
        assert printed in output.splitlines(), output


def measured_cells(output: str) -> dict[str, float]:
    """The estimator's last column, in seconds, by strategy."""
    cells = {}
    for line in output.splitlines():
        parts = [part.strip() for part in line.split("|")[1:-1]]
        if len(parts) == 12 and parts[1] in ("ddp", "full_shard", "shard_grad_op", "hybrid_shard"):
            value, unit = parts[-1].split()
            cells[parts[1]] = float(value) * {"ms": 1e-3, "s": 1.0}[unit]
    return cells


def test_the_estimator_times_a_step_with_the_measured_figures(
    measured: tuple[dict, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model of 2^20 parameters in 4 units at 2 ranks: every FSDP message is 1 MiB, a measured size; DDP's
    buckets are 1 MiB and 3 MiB, halfway between two measured sizes."""
    summary, _ = measured
    path = tmp_path / "check.json"
    path.write_text(json.dumps(summary))
    t = {(row["op"], row["bytes"]): row["time_s"] for row in summary["results"]}
    # full_shard: each unit gathered before forward and, but the last, again before backward; 4 reduce-scatters.
    full = 7 * t["all_gather", MIB] + 4 * t["reduce_scatter", MIB]
    expected = {
        "ddp": t["all_reduce", MIB] + (t["all_reduce", 2 * MIB] + t["all_reduce", 4 * MIB]) / 2,
        "full_shard": full,
        "shard_grad_op": 4 * t["all_gather", MIB] + 4 * t["reduce_scatter", MIB],
        "hybrid_shard": full,  # groups of 2 on 2 ranks: one replica
    }
    main(["--params", str(2**20), "--layers", "4", "--world-size", "2", "--comm-check", str(path)])
    output = capsys.readouterr().out
    assert "measured: 2 ranks on 1 node(s), gloo" in output
    cells = measured_cells(output)
    assert cells.keys() == expected.keys(), output
    for strategy, seconds in expected.items():
        assert math.isclose(cells[strategy], seconds, rel_tol=5e-3), (strategy, output)  # printed to 3 digits


def test_sizes_outside_the_measured_range_and_other_group_sizes() -> None:
    check = CommCheck(2, 1, "gloo", "cpu", {"all_gather": [(MIB, 1e-3), (4 * MIB, 2e-3)]})
    assert check.seconds("all_gather", MIB // 8, 2) == 1e-3  # smaller: latency-bound, no faster than the smallest
    assert check.seconds("all_gather", 8 * MIB, 2) == pytest.approx(4e-3)  # larger: the largest's bandwidth
    assert check.seconds("all_gather", 2 * MIB, 2) == pytest.approx(1e-3 + 1e-3 / 3)  # a third of the way
    # On 8 ranks a link carries 7/8 of the message, not 1/2: the same bus bandwidth, 7/4 of the time.
    assert check.seconds("all_gather", 4 * MIB, 8) == pytest.approx(2e-3 * 7 / 4)
    assert check.seconds("all_gather", 4 * MIB, 1) == 0  # alone, nothing crosses a link
    assert check.step_seconds([("all_reduce", MIB, 2)]) is None  # not measured: no guess


def test_bad_input_is_one_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = run_warm(comm_check(tmp_path / "x.json", "--min-bytes", "4M", "--max-bytes", "1M"), tmp_path, 2, 60)
    assert run.returncode == 2, run.describe()
    assert run.output.count("error:") == 1 and "--min-bytes 4194304 is larger than --max-bytes" in run.output
    assert not (tmp_path / "x.json").exists()
    (tmp_path / "bad.json").write_text('{"world_size": 2}')
    for path, said in (
        (tmp_path / "missing.json", "missing.json: no such file"),
        (tmp_path / "bad.json", "not a comm"),
    ):
        with pytest.raises(SystemExit) as exited:
            main(["--params", "1e6", "--world-size", "2", "--comm-check", str(path)])
        assert exited.value.code == 2
        assert said in capsys.readouterr().err


def test_an_out_that_cannot_be_written_is_refused_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a-file").touch()
    for out, said in ((tmp_path, "is a folder"), (tmp_path / "a-file" / "x.json", "is a file, not a folder")):
        with pytest.raises(SystemExit) as exited:
            parse_args(["--device", "cpu", "--out", str(out)])
        assert exited.value.code == 2
        assert said in capsys.readouterr().err
