"""The pictures: ``tools.runs.plot`` and ``compare_strategies --png`` drawn with Agg from real short runs, checked
through matplotlib's own objects (lines, labels, data points against the records); their refusals; and
that neither training nor the library imports matplotlib.

The runs are made once for the file, laid out as a comparison's --out-dir (STRATEGY-WORLDSIZE), so that
tools.runs.plot and compare_strategies --from-runs draw the same runs: DDP stopped at step 4 at 2 ranks and
resumed to step 8 at 1 (its folder named by where it finished), DDP at 2 ranks and FSDP1 at 2 ranks (6 steps each).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.run_dir import METRICS_FILE
from tests.harness.runs import REPO, Run, clean_env, run_script
from tools.benchmarks import compare_strategies
from tools.benchmarks.compare_strategies import MIB, comparison_figure, saved_runs
from tools.estimates import simulate
from tools.runs import plot

TINY = [
    *("--n-layer", "2", "--d-model", "32", "--n-head", "2", "--block-size", "16", "--global-batch-size", "8"),
    *("--train-sequences", "64", "--heldout-sequences", "16", "--log-interval", "2", "--eval-interval", "3"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """The comparison folder's runs by folder name; ``ddp-1`` was stopped at step 4 at 2 ranks and resumed to step 8
    at 1."""
    out = tmp_path_factory.mktemp("comparison")
    stopped = [*TINY, "--checkpoint-interval", "4", "--max-steps", "4"]
    run_script("ddp/train_transformer.py", stopped, out / "ddp-1", nproc=2).check()
    resumed = [*TINY, "--checkpoint-interval", "4", "--max-steps", "8", "--resume"]
    made = {"ddp-1": run_script("ddp/train_transformer.py", resumed, out / "ddp-1").check()}
    for name, script in [("ddp-2", "ddp/train_transformer.py"), ("fsdp1_full_shard-2", "fsdp/train_transformer.py")]:
        made[name] = run_script(script, [*TINY, "--max-steps", "6"], out / name, nproc=2).check()
    return made


def figure_of(*run_dirs: Path) -> tuple[object, dict[str, object]]:
    """The figure tools.runs.plot draws for ``run_dirs`` and its panels by title (time's own title kept apart)."""
    figure = plot.draw_runs([plot.read_history(run_dir) for run_dir in run_dirs])
    panels = {}
    for axes in figure.axes:
        title = axes.get_title()
        panels[f"{title} ({axes.get_ylabel()})" if title == "throughput" else title] = axes
    return figure, panels


def lines(axes: object, gid: str) -> list:
    return [line for line in axes.get_lines() if line.get_gid() == gid]


def test_each_run_is_drawn_from_its_records_with_its_restart(runs: dict[str, Run]) -> None:
    names = ["ddp-1", "ddp-2", "fsdp1_full_shard-2"]
    figure, panels = figure_of(*(runs[name].run_dir for name in names))
    assert sorted(panels) == sorted(
        [
            "loss by step",
            "loss by training time",
            "learning rate",
            "gradient norm (before clipping)",
            "throughput (tokens/s, all ranks)",
        ]
    )
    labels = [line.get_label() for line in lines(panels["loss by step"], plot.TRAIN)]
    # A resumed run's label names each world size it ran at: the resume record holds the checkpoint's.
    assert labels == ["ddp-1: ddp, 2→1 ranks", "ddp-2: ddp, 2 ranks", "fsdp1_full_shard-2: fsdp1_full_shard, 2 ranks"]
    for field, title in [
        ("loss", "loss by step"),
        ("lr", "learning rate"),
        ("grad_norm", "gradient norm (before clipping)"),
    ]:
        drawn = lines(panels[title], plot.TRAIN)
        assert len(drawn) == len(names), title
        for line, name in zip(drawn, names, strict=True):
            train = runs[name].events("train")
            assert list(line.get_xdata()) == [r["step"] for r in train], (title, name)
            assert list(line.get_ydata()) == [r[field] for r in train], (title, name)
    for line, name in zip(lines(panels["loss by step"], plot.EVAL), names, strict=True):
        assert list(line.get_ydata()) == [r["loss"] for r in runs[name].events("eval")], name
    (restart,) = lines(panels["loss by step"], plot.RESTART)
    (resume,) = runs["ddp-1"].events("resume")
    assert resume["step"] == 4 and list(restart.get_xdata()) == [4, 4]
    assert "ddp-1" in restart.get_label()
    assert len(lines(panels["learning rate"], plot.RESTART)) == 1  # on every panel the resumed run has
    plot.pyplot().close(figure)


def test_time_is_the_sum_of_each_interval_s_step_time(runs: dict[str, Run]) -> None:
    """After the restart at step 4 the next interval counts from the last record, step 4, at its own rate."""
    figure, panels = figure_of(runs["ddp-1"].run_dir)
    (line,) = lines(panels["loss by training time"], plot.TRAIN)
    train = runs["ddp-1"].events("train")
    assert [r["step"] for r in train] == [2, 4, 6, 8]
    by_hand = [sum(r["step_ms"] * 2 / 1000 for r in train[: i + 1]) for i in range(len(train))]
    assert list(line.get_xdata()) == pytest.approx(by_hand)
    (restart,) = lines(panels["loss by training time"], plot.RESTART)
    assert restart.get_xdata()[0] == pytest.approx(by_hand[1])
    plot.pyplot().close(figure)


def test_a_run_still_going_is_drawn_up_to_its_torn_last_line(
    runs: dict[str, Run], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = runs["ddp-2"].run_dir / METRICS_FILE
    kept = [line for line in source.read_text().splitlines() if json.loads(line)["event"] != "final"][:3]
    going = tmp_path / "going"
    going.mkdir()
    (going / METRICS_FILE).write_text("\n".join(kept) + '\n{"event": "train", "step": 6, "lo')
    out = tmp_path / "going.png"
    plot.main([str(going), "--out", str(out)])
    said = capsys.readouterr()
    assert "left out line 4, not a whole record" in said.err and f"figure: {out}" in said.out
    figure, panels = figure_of(going)
    (line,) = lines(panels["loss by step"], plot.TRAIN)
    whole = [json.loads(text) for text in kept]
    assert list(line.get_xdata()) == [r["step"] for r in whole if r["event"] == "train"]
    assert line.get_label() == "going: running, at step 4"
    plot.pyplot().close(figure)
    assert out.read_bytes().startswith(b"\x89PNG")


def test_the_command_writes_png_and_svg_of_the_same_runs(runs: dict[str, Run], tmp_path: Path) -> None:
    from matplotlib.image import imread

    run_dirs = [str(runs[name].run_dir) for name in ("ddp-1", "fsdp1_full_shard-2")]
    plot.main([*run_dirs, "--out", str(tmp_path / "runs.png")])
    plot.main([*run_dirs, "--out", str(tmp_path / "runs.svg")])
    height, width, _ = imread(tmp_path / "runs.png").shape
    assert width == plot.FIGURE_WIDTH * plot.DPI and height > 3 * plot.PANEL_HEIGHT * plot.DPI  # 3 rows of panels
    svg = (tmp_path / "runs.svg").read_text()
    assert svg.count("<svg") == 1 and "fsdp1_full_shard-2: fsdp1_full_shard, 2 ranks" in svg
    assert sorted(path.name for path in tmp_path.iterdir()) == ["runs.png", "runs.svg"]  # no temporary left


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, str]:
    with pytest.raises(SystemExit) as stop:
        plot.main(argv)
    said = capsys.readouterr()
    return stop.value.code, said.err or ""


def test_bad_input_is_one_message(runs: dict[str, Run], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = str(runs["ddp-2"].run_dir)
    comparison = runs["ddp-2"].run_dir.parent
    code, err = refusal([str(tmp_path), "--out", str(tmp_path / "a.png")], capsys)
    assert code == 2 and f"{tmp_path} holds no metrics.jsonl" in err and err.count("error:") == 1
    code, err = refusal([str(comparison), "--out", str(tmp_path / "a.png")], capsys)
    assert code == 2 and str(runs["ddp-1"].run_dir) in err, "the runs inside a comparison are named"
    code, err = refusal([run, "--out", "/proc/a.png"], capsys)
    assert code == 2 and "cannot create anything in /proc" in err and err.count("error:") == 1
    code, err = refusal([run, "--out", str(tmp_path / "a.pdf")], capsys)
    assert code == 2 and "must end in .png or .svg" in err

    only_eval, only_train = tmp_path / "evaluated-only", tmp_path / "just-started"
    records = [json.loads(line) for line in (runs["ddp-2"].run_dir / METRICS_FILE).read_text().splitlines()]
    for folder, events in [(only_eval, {"eval", "final"}), (only_train, {"train"})]:
        folder.mkdir()
        kept = [json.dumps(r) for r in records if r["event"] in events]
        (folder / METRICS_FILE).write_text("\n".join(kept) + "\n")
    code, err = refusal([str(only_eval), str(only_train), "--out", str(tmp_path / "a.png")], capsys)
    assert "no value in common" in str(code) and "evaluated-only: eval_loss" in str(code)
    final_only = tmp_path / "final-only"
    final_only.mkdir()
    (final_only / METRICS_FILE).write_text(json.dumps(records[-1]) + "\n")
    code, _ = refusal([str(final_only), "--out", str(tmp_path / "a.png")], capsys)
    assert str(code).startswith("error: nothing to draw for final-only")
    assert not list(tmp_path.glob("*.png")), "a refusal writes nothing"


@pytest.mark.parametrize("digits", [401, 5000], ids=["past a float", "past what Python reads"])
def test_a_number_no_float_holds_is_named_with_its_file_and_line(
    digits: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A metrics.jsonl edited or damaged by hand: one message naming the file, the line and the field, not an
    OverflowError (401 digits) or Python's integer-reading limit (more than 4,300) as a traceback."""
    run = tmp_path / "edited"
    run.mkdir()
    records = [{"event": "train", "step": 2, "loss": 2.0, "lr": 0.01}, {"event": "train", "step": 4, "loss": 1.0}]
    lines = [json.dumps(record) for record in records]
    lines[1] = lines[1].replace("1.0", "9" * digits)
    (run / METRICS_FILE).write_text("\n".join(lines) + "\n")
    code, err = refusal([str(run), "--out", str(tmp_path / "a.png")], capsys)
    assert str(code).startswith(f"error: {run / METRICS_FILE}, line 2: loss is a number of {digits} digits"), code
    assert not (tmp_path / "a.png").exists()


def write_finished_run(run_dir: Path, loss: float) -> Path:
    """A finished run's metrics.jsonl, as a run writes it, with two train records."""
    run_dir.mkdir(parents=True)
    records = [
        {"event": "train", "step": 2, "loss": loss, "lr": 0.01, "step_ms": 5.0},
        {"event": "train", "step": 4, "loss": loss / 2, "lr": 0.01, "step_ms": 5.0},
        {"event": "final", "strategy": "ddp", "world_size": 2},
    ]
    (run_dir / METRICS_FILE).write_text("".join(json.dumps(record) + "\n" for record in records))
    return run_dir


def test_two_dozen_runs_get_a_colour_and_a_label_each(tmp_path: Path) -> None:
    """Matplotlib's default cycle has 10 colours: the 11th run took the first's. Runs of one folder name in two
    places are told apart by their paths."""
    run_dirs = [
        write_finished_run(tmp_path / f"sweep-{index // 12}" / f"lr-{index % 12}", 1.0 + index) for index in range(24)
    ]
    figure, panels = figure_of(*run_dirs)
    drawn = lines(panels["loss by step"], plot.TRAIN)
    assert len(drawn) == 24
    assert len({line.get_color() for line in drawn}) == 24, [line.get_color() for line in drawn]
    labels = [line.get_label() for line in drawn]
    assert len(set(labels)) == 24 and labels[0] == f"{run_dirs[0]}: ddp, 2 ranks", labels[:2]
    plot.pyplot().close(figure)


def test_one_run_given_twice_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same folder twice, under two spellings, drew two lines of one label: one message instead."""
    run = write_finished_run(tmp_path / "run", 1.0)
    code, err = refusal([str(run), f"{tmp_path}/./run/", "--out", str(tmp_path / "a.png")], capsys)
    assert code == 2 and err.count("error:") == 1 and "the same run twice" in err, err
    assert not (tmp_path / "a.png").exists()


def test_compare_strategies_draws_a_saved_comparison_without_training(
    runs: dict[str, Run], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    comparison = runs["ddp-1"].run_dir.parent
    out = tmp_path / "memory.png"
    compare_strategies.main(["--from-runs", str(comparison), "--png", str(out)])
    assert f"chart: {out}" in capsys.readouterr().out and out.read_bytes().startswith(b"\x89PNG")
    figure = comparison_figure(saved_runs(comparison))
    state_axes, peak_axes, time_axes = figure.axes
    by_strategy = {"ddp": [runs["ddp-1"], runs["ddp-2"]], "fsdp1_full_shard": [runs["fsdp1_full_shard-2"]]}
    assert [line.get_label() for line in time_axes.get_lines()] == list(by_strategy)
    for strategy, made in by_strategy.items():
        finals = [run.final() for run in made]
        measured, estimated = [line for line in state_axes.get_lines() if line.get_gid() == strategy]
        assert list(measured.get_xdata()) == [final["world_size"] for final in finals]
        held = [sum(final["local_state_bytes"].values()) / MIB for final in finals]
        assert list(measured.get_ydata()) == held
        assert list(estimated.get_ydata()) == pytest.approx(held, rel=0.01), "the estimate is exact for AdamW"
        peak, peak_floor = [line for line in peak_axes.get_lines() if line.get_gid() == strategy]
        assert list(peak.get_ydata()) == [final["peak_memory_bytes"] / MIB for final in finals]
        assert all(low >= state for low, state in zip(peak_floor.get_ydata(), held, strict=True))
        (timed,) = [line for line in time_axes.get_lines() if line.get_gid() == strategy]
        assert list(timed.get_ydata()) == [final["step_ms"] for final in finals]
    plot.pyplot().close(figure)


def test_compare_strategies_from_runs_refuses_a_folder_of_no_comparison(
    runs: dict[str, Run], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "never-written.png"
    with pytest.raises(SystemExit) as stop:
        compare_strategies.main(["--from-runs", str(runs["ddp-1"].run_dir), "--png", str(out)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "holds no finished run of a comparison" in err and err.count("error:") == 1
    assert not out.exists()


def test_compare_strategies_from_runs_leaves_out_an_unfinished_run_and_names_a_damaged_one(
    runs: dict[str, Run], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run stopped before its end has no final record: it was a traceback; now it is left out, and said once.
    A damaged metrics.jsonl is one message naming its line, and exit code 1."""
    comparison = tmp_path / "comparison"
    shutil.copytree(runs["ddp-1"].run_dir.parent, comparison)
    stopped = comparison / "fsdp2-2"
    shutil.copytree(comparison / "ddp-2", stopped)
    lines = (stopped / "metrics.jsonl").read_text().splitlines()
    (stopped / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if '"final"' not in line))
    compare_strategies.main(["--from-runs", str(comparison)])
    captured = capsys.readouterr()
    assert captured.err.count("left out, no final record") == 1 and str(stopped) in captured.err, captured.err
    assert "fsdp2" not in captured.out.split("\nmeasured")[0], captured.out
    (stopped / "metrics.jsonl").write_text('{"event": "train", "step": 1}\nnot json\n{"event": "eval"}\n')
    with pytest.raises(SystemExit) as stop:
        compare_strategies.main(["--from-runs", str(comparison)])
    message = str(stop.value.code)
    assert "line 2: not a whole record" in message and str(stopped) in message, message


# Run in a fresh interpreter: each training script's imports and definitions (not its main), then every
# common/ module; it prints those after whose import matplotlib was loaded.
IMPORT_EVERYTHING = """
import json, runpy, sys
from pathlib import Path
loaded_by = []
scripts = sorted([*Path("ddp").glob("train_*.py"), *Path("fsdp").glob("train_*.py")])
for script in scripts:
    runpy.run_path(str(script), run_name="imported")
    if "matplotlib" in sys.modules and not loaded_by:
        loaded_by.append(str(script))
modules = sorted(Path("common").glob("*.py"))
for module in modules:
    __import__(f"common.{module.stem}")
    if "matplotlib" in sys.modules and not loaded_by:
        loaded_by.append(str(module))
print(json.dumps({"scripts": len(scripts), "modules": len(modules), "matplotlib loaded by": loaded_by}))
"""


def test_neither_training_nor_any_module_imports_matplotlib() -> None:
    """A fresh interpreter imports every training script and every common/ module: matplotlib stays out."""
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERYTHING], cwd=REPO, env=clean_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["scripts"] == 6 and seen["modules"] > 15, seen  # the rule must see the library
    assert seen["matplotlib loaded by"] == [], "the first import that loads matplotlib"


def test_the_estimated_peak_is_the_state_plus_what_a_step_gathers() -> None:
    """compare_strategies' dashed peak line: the state held in a step plus the in-flight units (no activations)."""
    shapes = {"emb.weight": (8, 4), "blocks.0.w": (4, 4), "blocks.1.w": (4, 4)}  # a root of 32, Blocks of 16
    record = {"strategy": "ddp", "shard_group_size": 1, "model_config": {"n_layer": 2}, "mixed_precision": "fp32"}
    state = compare_strategies.estimated_state(record, shapes).total
    assert compare_strategies.estimated_peak_state(record, shapes) == state  # fp32 DDP gathers nothing
    sharded = {**record, "strategy": "fsdp2", "shard_group_size": 2, "mixed_precision": "bf16"}
    # The root and two Blocks in bf16, one Block's fp32 gradient; the sharded gradients are None in a step.
    gathered = 2 * (32 + 2 * 16) + 4 * 16
    held = compare_strategies.estimated_state(sharded, shapes)
    assert compare_strategies.estimated_peak_state(sharded, shapes) == held.params + held.optimizer + gathered


def test_simulate_draws_state_per_rank_by_world_size_beside_the_1_over_n_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tools.estimates.simulate --png: one line per model and strategy through the simulated jobs' state per rank,
    and the
    16P/N line of what one rank would hold alone, divided; an existing --out or --png is kept without --overwrite."""
    out, png = tmp_path / "jobs.json", tmp_path / "scale.png"
    flags = ["--model", "tiny", "--world-size", "2", "8", "--strategy", "ddp", "fsdp2", "--out", str(out)]
    simulate.main([*flags, "--png", str(png)])
    results = json.loads(out.read_text())
    figure = plot.draw_scale(results)
    (axes,) = figure.axes
    lines = {line.get_label(): line for line in axes.get_lines()}
    assert sorted(lines) == ["tiny 16P/N", "tiny ddp", "tiny fsdp2"]
    for strategy in ("ddp", "fsdp2"):
        jobs = sorted((r["world_size"], r) for r in results if r["strategy"] == strategy)
        states = [sum(r[f"{kind}_bytes"] for kind in ("params", "grads", "optimizer")) / MIB for _, r in jobs]
        assert list(lines[f"tiny {strategy}"].get_xdata()) == [2, 8]
        assert list(lines[f"tiny {strategy}"].get_ydata()) == pytest.approx(states, rel=1e-12)
    alone = 16 * plot.parameter_count(results[0]["model_config"]) / MIB
    assert list(lines["tiny 16P/N"].get_ydata()) == pytest.approx([alone / 2, alone / 8], rel=1e-12)
    assert axes.get_xscale() == "log" and axes.get_yscale() == "log"
    assert png.read_bytes().startswith(b"\x89PNG")
    before = png.read_bytes()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        simulate.main([*flags[:-2], "--png", str(png)])
    assert exit_info.value.code == 2 and "--overwrite" in capsys.readouterr().err
    assert png.read_bytes() == before
    written = out.read_text()
    with pytest.raises(SystemExit) as exit_info:
        simulate.main(flags)
    assert exit_info.value.code == 2 and "--overwrite" in capsys.readouterr().err
    assert out.read_text() == written
