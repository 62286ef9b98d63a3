"""Draw runs from their metrics.jsonl: loss and held-out loss by step and by training time, the learning
rate, the gradient norm and the throughput, one colour per run.

    python -m tools.runs.plot runs/ddp_transformer runs/fsdp2_transformer --out curves.png
    python -m tools.runs.plot runs/a runs/b runs/c --out curves.svg --overwrite

Each run is labelled by its folder, its strategy and its world size, read from its final record. A run
still going has none yet: it is drawn as far as it got and labelled "running". A resumed run's
restarts (its "resume" records) are dotted vertical lines at the step it continued from, and where it
continued at another world size the label names each. The records hold no clock, so the time axis is
training time: each logged interval's step_ms times its steps, without evaluation and saving. A line
that is not a whole record (a run killed mid-write, or writing it now) is left out, and said so; one that
holds a number no float holds (an edit, or damage) is refused, naming its line.
A panel is drawn where any run has its values; runs with no value in common are refused.

--out's suffix picks the format, .png or .svg. matplotlib draws with its Agg backend, so no display is
needed (a cluster's login node); it is imported only when a figure is drawn, never by training.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.cli import HelpFormatter
from common.models import GPTConfig
from common.outputs import OutputExists, write_by_name
from common.run_dir import METRICS_FILE
from tools.command_flags import existing_dir, output_file
from tools.model_shapes import gpt_parameter_count
from tools.output_checks import add_overwrite_flag, check_output_path, same_file
from tools.processes import exit_code_of
from tools.records import UnreadableRecord, read_records

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FORMATS = (".png", ".svg")
DPI = 72  # with FIGURE_WIDTH inches, 720 pixels wide: the docs' figures stay under 100 KB
FIGURE_WIDTH = 10
PANEL_HEIGHT = 2.9
TRAIN, EVAL, RESTART, IDEAL = "train", "eval", "restart", "ideal"  # each drawn line's gid: what it shows


class PlotError(ValueError):
    """Input that cannot be drawn; its text is the one message the command prints."""


@dataclass
class RunHistory:
    """What one run's metrics.jsonl holds, in the order it was written."""

    run_dir: Path
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, Any] | None = None

    def values(self) -> set[str]:
        """The names of the values it can draw: ``eval_loss`` for held-out losses, the train records' fields."""
        found = {name for record in self.train for name in record if is_number(record[name])}
        found -= {"step", "epoch", "step_ms"}
        return found | ({"eval_loss"} if any(is_number(r.get("loss")) for r in self.evals) else set())


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    values: tuple[str, ...]  # train record fields, or eval_loss; the panel is drawn where any run has one
    by_time: bool = False
    log_scale: bool = False


PANELS = (
    Panel("loss by step", "loss (nats/token or /image)", ("loss", "eval_loss")),
    Panel("loss by training time", "loss", ("loss", "eval_loss"), by_time=True),
    Panel("learning rate", "learning rate", ("lr",)),
    Panel("gradient norm (before clipping)", "global gradient norm", ("grad_norm",), log_scale=True),
    Panel("throughput", "tokens/s, all ranks", ("tokens_per_s",)),
    Panel("throughput", "samples/s, all ranks", ("samples_per_s",)),
)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_history(run_dir: Path) -> RunHistory:
    """The records of ``run_dir``'s metrics.jsonl, read by tools.records' rule (a torn last line left out and said)."""
    path = run_dir / METRICS_FILE
    try:
        records = read_records(run_dir)
    except FileNotFoundError:
        raise PlotError(f"{run_dir} holds no {METRICS_FILE}: give the --run-dir of a training run") from None
    except OSError as err:
        raise PlotError(f"cannot read {path}: {err.strerror or err}") from None
    except UnreadableRecord as err:
        raise PlotError(str(err)) from None
    history = RunHistory(run_dir)
    for record in records.records:
        if record["event"] == "train" and is_number(record.get("step")):
            history.train.append(record)
        elif record["event"] == "eval" and is_number(record.get("step")):
            history.evals.append(record)
        elif record["event"] == "resume" and is_number(record.get("step")):
            history.restarts.append(record)
        elif record["event"] == "final":
            history.final = record
    return history


def training_seconds(train: Sequence[dict[str, Any]]) -> list[float]:
    """Training time at each train record: the sum of each interval's step_ms times the steps it covers.

    After a restart the first interval counts from the previous record's step, so the steps trained
    before the stop and again after it are counted once, at the rate measured after the restart.
    """
    seconds, total, previous_step = [], 0.0, 0
    for record in train:
        step_ms = record.get("step_ms")
        total += (step_ms if is_number(step_ms) else 0.0) * max(record["step"] - previous_step, 0) / 1000
        seconds.append(total)
        previous_step = record["step"]
    return seconds


def seconds_at(step: float, train: Sequence[dict[str, Any]], seconds: Sequence[float]) -> float:
    """Training time at ``step``: that of the last train record at or before it (0 before the first)."""
    before = [time for record, time in zip(train, seconds, strict=True) if record["step"] <= step]
    return before[-1] if before else 0.0


def run_label(history: RunHistory, name: str) -> str:
    """``NAME: STRATEGY, N ranks``; a restart at another world size lists each size in turn (``4→2 ranks``): a
    resume record holds the world size that saved its checkpoint and the one that continued from it."""
    if history.final is None:
        last = max((r["step"] for r in [*history.train, *history.evals]), default=0)
        return f"{name}: running, at step {last}"
    sizes: list[object] = []
    segments = [size for r in history.restarts for size in (r.get("checkpoint_world_size"), r.get("world_size"))]
    for size in [*segments, history.final.get("world_size")]:
        if size is not None and (not sizes or sizes[-1] != size):
            sizes.append(size)
    ranks = "→".join(map(str, sizes)) or "?"
    return f"{name}: {history.final.get('strategy', '?')}, {ranks} rank{'' if sizes == [1] else 's'}"


def run_names(run_dirs: Sequence[Path]) -> list[str]:
    """Each run's folder name, or its path where two runs share a folder name."""
    names = [run_dir.name or str(run_dir) for run_dir in run_dirs]
    return [name if names.count(name) == 1 else str(run_dir) for name, run_dir in zip(names, run_dirs, strict=True)]


def panels_for(histories: Sequence[RunHistory], names: Sequence[str]) -> list[Panel]:
    """The panels some run has values for; ``PlotError`` if a run has none, or the runs have none in common."""
    held = [history.values() for history in histories]
    for name, values in zip(names, held, strict=True):
        if not values:
            raise PlotError(f"nothing to draw for {name}: its {METRICS_FILE} holds no train or eval record yet")
    if not set.intersection(*held):
        each = "; ".join(f"{name}: {', '.join(sorted(values))}" for name, values in zip(names, held, strict=True))
        raise PlotError(f"the runs have no value in common to draw ({each}); draw them apart")
    return [panel for panel in PANELS if any(set(panel.values) & values for values in held)]


MAX_RUNS = 60  # a colour each: tab20's (its first 10 are matplotlib's default cycle), tab20b's and tab20c's


def run_colours(count: int) -> list[Any]:
    """``count`` colours, no two alike: matplotlib's 10, then tab20's lighter shades of them, then tab20b's and
    tab20c's; the default cycle repeats after 10, and gave an 11th run the first one's colour."""
    colormaps = pyplot().colormaps
    tab20 = colormaps["tab20"].colors
    palette = [*tab20[0::2], *tab20[1::2], *colormaps["tab20b"].colors, *colormaps["tab20c"].colors]
    if count > len(palette):
        raise PlotError(f"{count} runs in one figure: at most {len(palette)}, a colour each; draw them in groups")
    return palette[:count]


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend: no display needed, and imported only here, where a figure is drawn."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("matplotlib is not installed: pip install -r requirements.txt") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_runs(histories: Sequence[RunHistory], names: Sequence[str] | None = None) -> Figure:
    """One figure of every panel some run has values for, one colour per run."""
    names = list(names) if names is not None else run_names([h.run_dir for h in histories])
    panels = panels_for(histories, names)
    plt = pyplot()
    rows = math.ceil(len(panels) / 2)
    figure, grid = plt.subplots(rows, 2, figsize=(FIGURE_WIDTH, PANEL_HEIGHT * rows + 0.8), squeeze=False)
    axes_list = list(grid.flat)
    colours = run_colours(len(histories))
    for history, name, colour in zip(histories, names, colours, strict=True):
        for panel, axes in zip(panels, axes_list, strict=False):
            draw_panel(axes, panel, history, run_label(history, name), colour)
    for panel, axes in zip(panels, axes_list, strict=False):
        axes.set_title(panel.title, fontsize=10)
        axes.set_xlabel("training time (s)" if panel.by_time else "step")
        axes.set_ylabel(panel.ylabel, fontsize=8)
        if panel.log_scale and any(line.get_xdata().size for line in axes.get_lines()):
            axes.set_yscale("log")
        axes.grid(alpha=0.3)
    for unused in axes_list[len(panels) :]:
        unused.remove()
    handles = [line for line in axes_list[0].get_lines() if line.get_gid() == TRAIN]
    figure.legend(handles=handles, loc="upper center", ncol=min(len(handles), 3), fontsize=8, frameon=False)
    figure.text(0.5, 0.005, "solid: training, circles: held-out, dotted: a restart", ha="center", fontsize=8)
    figure.tight_layout(rect=(0, 0.02, 1, 1 - 0.25 / figure.get_figheight()))
    return figure


def draw_panel(axes: Axes, panel: Panel, history: RunHistory, label: str, colour: str) -> None:
    """One run's lines in one panel: its train values, its held-out losses, its restarts."""
    seconds = training_seconds(history.train)

    def position(step: float) -> float:
        return seconds_at(step, history.train, seconds) if panel.by_time else step

    (value_name,) = [name for name in panel.values if name != "eval_loss"]
    drawn = [record for record in history.train if is_number(record.get(value_name))]
    if drawn:
        xs = [position(record["step"]) for record in drawn]
        ys = [record[value_name] for record in drawn]
        axes.plot(xs, ys, color=colour, linewidth=1.2, label=label, gid=TRAIN)
    if "eval_loss" in panel.values:
        held_out = [r for r in history.evals if is_number(r.get("loss"))]
        if held_out:
            xs = [position(r["step"]) for r in held_out]
            ys = [r["loss"] for r in held_out]
            axes.plot(xs, ys, "o--", color=colour, markersize=4, linewidth=0.8, label=f"{label} held-out", gid=EVAL)
    if drawn or "eval_loss" in panel.values:
        for restart in history.restarts:
            line = axes.axvline(position(restart["step"]), color=colour, linestyle=":", linewidth=1, gid=RESTART)
            line.set_label(f"{label} restarted at step {restart['step']}")


STATE_KINDS = ("params_bytes", "grads_bytes", "optimizer_bytes")
PARAMETER_COUNTS = ("parameter_count", "trained_parameter_count")  # a simulated job's P and T (adapters included)
MIB = 2**20


def draw_scale(results: Sequence[dict[str, Any]]) -> Figure:
    """tools.estimates.simulate's jobs: per-rank model state by world size on log axes, one line per model and strategy,
    and per model a dotted line falling as 1/N from the state one rank would hold alone: 16 bytes a parameter, or
    fine-tuned, 4 a parameter and 12 more one that trains (4P + 12T)."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(FIGURE_WIDTH, 4.5))
    lines: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for result in results:
        state = sum(result[kind] for kind in STATE_KINDS) / MIB
        lines.setdefault((result["model"], result["strategy"]), []).append((result["world_size"], state))
    for ((model, strategy), points), colour in zip(sorted(lines.items()), run_colours(len(lines)), strict=True):
        sizes, states = zip(*sorted(points), strict=True)
        axes.plot(sizes, states, "o-", color=colour, label=f"{model} {strategy}", gid=TRAIN)
    for model in sorted({result["model"] for result in results}):
        sizes = sorted({result["world_size"] for result in results if result["model"] == model})
        held, trained = (next(r for r in results if r["model"] == model)[key] for key in PARAMETER_COUNTS)
        alone = (4 * held + 12 * trained) / MIB  # fp32 weights; gradients and Adam's two moments where they train
        label = f"{model} 16P/N" if held == trained else f"{model} (4P+12T)/N"
        axes.plot(sizes, [alone / n for n in sizes], ":", color="grey", label=label, gid=IDEAL)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("ranks")
    axes.set_ylabel("model state per rank (MiB)")
    axes.set_title("one rank of each job, simulated (tools.estimates.simulate)", fontsize=10)
    axes.grid(alpha=0.3, which="both")
    axes.legend(fontsize=8, ncol=2, frameon=False)
    figure.tight_layout()
    return figure


def parameter_count(model_config: dict[str, Any]) -> int:
    """Parameters of the GPT of a record's model_config (a run's final record or a simulated job's)."""
    return gpt_parameter_count(GPTConfig(**model_config))


def save_figure(figure: Figure, path: Path, overwrite: bool) -> None:
    """Write ``figure`` through common.outputs (whole or not at all); matplotlib picks the format by the suffix."""
    try:
        smaller = {"pil_kwargs": {"optimize": True}} if path.suffix.lower() == ".png" else {}
        write_by_name(path, functools.partial(figure.savefig, dpi=DPI, **smaller), overwrite)
    finally:
        pyplot().close(figure)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.runs.plot", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "run_dirs", type=existing_dir, nargs="+", metavar="RUN_DIR", help="run folders (a script's --run-dir)"
    )
    parser.add_argument("--out", type=output_file, required=True, help="the figure to write: FILE.png or FILE.svg")
    add_overwrite_flag(parser)
    args = parser.parse_args(argv)
    for index, run_dir in enumerate(args.run_dirs):
        check_run_dir(parser, run_dir)
        again = next((earlier for earlier in args.run_dirs[:index] if same_file(earlier, run_dir)), None)
        if again is not None:
            parser.error(
                f"{run_dir} is {again} again: the same run twice would be two lines of one label; give it once"
            )
    if len(args.run_dirs) > MAX_RUNS:
        parser.error(f"{len(args.run_dirs)} runs: at most {MAX_RUNS} in one figure, a colour each; draw them in groups")
    inputs = [run_dir / METRICS_FILE for run_dir in args.run_dirs]
    check_figure_path(parser, args.out, "--out", args.overwrite, inputs)
    return args


def check_figure_path(
    parser: argparse.ArgumentParser, path: Path, flag: str, overwrite: bool, inputs: Sequence[Path] = ()
) -> None:
    """A figure's output, refused before any work: a name whose suffix is not a format drawn here, or a path
    common.outputs refuses."""
    if path.suffix.lower() not in FORMATS:
        parser.error(f"{flag} {path}: the name must end in {' or '.join(FORMATS)}, which picks the format")
    check_output_path(parser, path, flag, inputs=inputs, overwrite=overwrite)


def check_run_dir(parser: argparse.ArgumentParser, run_dir: Path) -> None:
    """Refuse a folder without metrics.jsonl, naming the runs inside it where it holds some (a comparison's)."""
    if (run_dir / METRICS_FILE).is_file():
        return
    inside = sorted(str(folder) for folder in run_dir.glob(f"*/{METRICS_FILE}"))
    hint = f"; the runs in it: {' '.join(str(Path(p).parent) for p in inside)}" if inside else ""
    parser.error(f"{run_dir} holds no {METRICS_FILE}: give the --run-dir of a training run{hint}")


def save_figure_or_exit(figure: Figure, path: Path, overwrite: bool, flag: str, kept_anyway: str = "") -> None:
    """``save_figure``, or one line and exit 1 where the file cannot be written (``kept_anyway``: what the
    command has already given the user, said after the reason)."""
    try:
        save_figure(figure, path, overwrite)
    except OutputExists as err:
        sys.exit(f"error: {err}")
    except OSError as err:
        sys.exit(f"error: could not write {flag} {path}: {err.strerror or err}{kept_anyway}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        histories = [read_history(run_dir) for run_dir in args.run_dirs]
        figure = draw_runs(histories)
    except PlotError as err:
        sys.exit(f"error: {err}")
    save_figure_or_exit(figure, args.out, args.overwrite, "--out")
    print(f"figure: {args.out}")


if __name__ == "__main__":
    sys.exit(exit_code_of(main, "python -m tools.runs.plot"))
