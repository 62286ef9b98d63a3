"""Compare runs step by step: did they train the same model?

    python -m tools.runs.compare_runs REFERENCE CANDIDATE --noise TWIN [TWIN ...]
    python -m tools.runs.compare_runs RUN_A RUN_B --loss-rtol 1e-5 --param-atol 1e-5

Reads each run directory's metrics.jsonl (the per-step training loss and global gradient norm, and
the final evaluation) and model.pt (the final parameters).

With --noise, the verdict is measured rather than chosen. Each TWIN is REFERENCE's training summed
in another equally valid order: one process with --grad-accum-steps K (tools.checks.check_equivalence
runs them for you). How far the twins drift from REFERENCE is the rounding noise of this model, at
this learning rate, on this machine's kernels. CANDIDATE trains the same model when its own drift
stays within --noise-factor times the twins' drift, quantity by quantity: each step's loss and
gradient norm (against the twins' largest drift up to that step), each final parameter tensor, and
the final evaluation loss. It prints SAME (exit 0), or DIFFERENT (exit 1) with the first step and
the parameter that left that band.

Without --noise it prints the largest differences, and exits 1 when a given tolerance is exceeded.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.cli import HelpFormatter
from common.flags import non_negative_float, positive_float
from common.run_dir import METRICS_FILE, MODEL_FILE
from common.safe_io import describe_failure, load_file
from tools.command_flags import existing_dir
from tools.records import read_records

# How far beyond the twins' drift a candidate may go and still be the same training. Measured on
# both torch ends and three CPU kernels: healthy runs reached 3.7x, broken copies 2,775x and more
# (docs/equivalence.md, "The factor, measured").
NOISE_FACTOR = 10.0


@dataclass
class Comparison:
    steps: int
    worst_step: int
    max_loss_abs_diff: float
    max_loss_rel_diff: float
    max_grad_norm_rel_diff: float
    max_param_abs_diff: float | None  # None when a run has no model.pt
    worst_param: str | None


def train_records(run_dir: Path) -> dict[int, dict]:
    records = read_records(run_dir).of("train")
    for record in records:
        numbers = [record.get(key) for key in ("loss", "grad_norm")]
        if not isinstance(record.get("step"), int) or not all(isinstance(n, int | float) for n in numbers):
            raise ValueError(f"{run_dir / METRICS_FILE}: a train record without step, loss and grad_norm: {record}")
    return {record["step"]: record for record in records}


def final_record(run_dir: Path) -> dict:
    return read_records(run_dir).final or {}


def final_eval_loss(run_dir: Path) -> float | None:
    return final_record(run_dir).get("eval_loss")


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12)


def load_parameters(run_dir: Path) -> dict[str, torch.Tensor]:
    """A run's model.pt; ValueError, naming it, if it cannot be read or is no state dict."""
    path = run_dir / MODEL_FILE
    try:
        state = load_file(path)
    except Exception as err:  # noqa: BLE001 - whatever is wrong with it, the comparison cannot use it
        raise ValueError(f"{path} cannot be loaded ({describe_failure(err)})") from None
    if not isinstance(state, dict) or not all(isinstance(tensor, torch.Tensor) for tensor in state.values()):
        raise ValueError(f"{path} is not a state dict (tensors by name), as the model.pt a run writes is")
    return state


def parameter_drifts(state_a: dict[str, torch.Tensor], state_b: dict[str, torch.Tensor]) -> dict[str, float]:
    """The largest absolute difference in each tensor."""
    if state_a.keys() != state_b.keys():
        raise ValueError("the runs' model.pt files hold different parameter names")
    reshaped = [
        f"{name} is {list(state_a[name].shape)} in one, {list(state_b[name].shape)} in the other"
        for name in state_a
        if state_a[name].shape != state_b[name].shape
    ]
    if reshaped:
        raise ValueError(
            f"the runs' model.pt files hold tensors of other shapes ({'; '.join(reshaped[:3])}): they are not the "
            "same model, so no drift between them means anything"
        )
    return {name: (state_a[name].double() - state_b[name].double()).abs().max().item() for name in state_a}


def check_same_model(runs: list[Path]) -> None:
    """Runs of other models (another vocabulary, another width) are no comparison: refused, naming what differs.

    The final record's ``model_config`` says it where a run has one (the transformer scripts).
    """
    configs = {run: config for run in runs if isinstance(config := final_record(run).get("model_config"), dict)}
    if len(configs) < 2:
        return
    (first, expected), *others = configs.items()
    for run, config in others:
        differs = [
            f"{key} {expected.get(key)} in {first}, {config.get(key)} in {run}"
            for key in sorted(expected.keys() | config.keys())
            if expected.get(key) != config.get(key)
        ]
        if differs:
            raise ValueError(f"the runs trained different models ({'; '.join(differs)}): compare runs of one model")


def shared_steps(runs: dict[Path, dict[int, dict]]) -> list[int]:
    """The steps every run logged: the same ones, or the runs did not train the same steps."""
    logged = {run: sorted(records) for run, records in runs.items()}
    first, steps = next(iter(logged.items()))
    if not steps:
        raise ValueError("the runs have no logged training step in common")
    for run, other in logged.items():
        if other != steps:
            raise ValueError(
                f"{first} logged {describe_steps(steps)} but {run} logged {describe_steps(other)}: "
                "compare runs of the same steps, with the same --max-steps and --log-interval"
            )
    return steps


def describe_steps(steps: list[int]) -> str:
    return f"{len(steps)} steps ({steps[0]} to {steps[-1]})" if steps else "no step"


def compare(run_a: Path, run_b: Path) -> Comparison:
    check_same_model([run_a, run_b])
    records_a, records_b = train_records(run_a), train_records(run_b)
    shared = shared_steps({run_a: records_a, run_b: records_b})
    abs_diff = {step: abs(records_a[step]["loss"] - records_b[step]["loss"]) for step in shared}
    worst_step = max(shared, key=abs_diff.__getitem__)
    rel_diff = max(relative(records_a[step]["loss"], records_b[step]["loss"]) for step in shared)
    # A gradient summed instead of averaged over ranks hides from the loss
    # under Adam, which is blind to the gradient's scale; the norm shows it.
    norm_diff = max(relative(records_a[step]["grad_norm"], records_b[step]["grad_norm"]) for step in shared)
    param_diff, worst_param = None, None
    if (run_a / MODEL_FILE).exists() and (run_b / MODEL_FILE).exists():
        drifts = parameter_drifts(load_parameters(run_a), load_parameters(run_b))
        worst_param = max(drifts, key=drifts.__getitem__)
        param_diff = drifts[worst_param]
    return Comparison(len(shared), worst_step, abs_diff[worst_step], rel_diff, norm_diff, param_diff, worst_param)


# --- against the noise floor -------------------------------------------------------------------


def float32_resolution(magnitude: float) -> float:
    """The gap between a float32 of this size and the next: the floor of a band whose twins agreed exactly."""
    return float(np.spacing(np.float32(abs(magnitude))))


@dataclass
class Drift:
    """The candidate's drift from the reference at one place, against the twins' band there."""

    quantity: str  # "loss", "gradient norm", "parameters", "eval loss"
    where: str  # "step 7", a parameter's name, or "final"
    drift: float
    noise: float  # the twins' drift, or float32's resolution where they agreed exactly

    @property
    def ratio(self) -> float:
        return self.drift / self.noise


@dataclass
class NoiseVerdict:
    steps: int
    twins: int
    factor: float
    drifts: list[Drift]

    def worst(self, quantity: str) -> Drift | None:
        of_quantity = [drift for drift in self.drifts if drift.quantity == quantity]
        return max(of_quantity, key=lambda drift: drift.ratio) if of_quantity else None

    def beyond(self) -> list[Drift]:
        """Every place the candidate left the band: the steps in order, then the parameters."""
        return [drift for drift in self.drifts if drift.ratio > self.factor]

    @property
    def same(self) -> bool:
        return not self.beyond()

    @property
    def largest_ratio(self) -> float:
        return max(drift.ratio for drift in self.drifts)


def norm_rounding(largest_tensor_numel: int) -> float:
    """How far this machine's float32 norm of a tensor this size strays from the exact one, relatively.

    The logged gradient norm is a measurement with rounding of its own. On the CPU torch's norm
    kernel adds a tensor's squares in long float32 runs: over a million elements it strays about
    1e-5, a hundred times the training's own drift. The twins and the reference compute the norm
    over the same whole tensors and share that error, but FSDP1 adds each shard's squares apart,
    so its norm differs by up to this much even where its training is the same. Measured here, on
    seeded random numbers, so that it is this machine's kernel's error and not a guess.
    """
    values = torch.randn(largest_tensor_numel, generator=torch.Generator().manual_seed(0))
    exact = values.double().norm().item()
    return abs(torch.linalg.vector_norm(values).item() - exact) / exact


def step_drifts(
    quantity: str,
    key: str,
    steps: list[int],
    reference: dict[int, dict],
    candidate: dict[int, dict],
    twins: list[dict[int, dict]],
    measurement_rounding: float = 0.0,
) -> list[Drift]:
    """Per step: the candidate's drift, against the largest drift of any twin at this step or before.

    Rounding drift grows as training goes on, but not step by step: a twin can agree closely at
    one step and not at the next. Its largest drift so far is the band the noise has reached. A
    quantity whose measurement rounds by itself (``measurement_rounding``, relative) has at least
    that band.
    """
    drifts, band = [], 0.0
    for step in steps:
        expected = reference[step][key]
        band = max(band, *(abs(twin[step][key] - expected) for twin in twins))
        noise = max(band or float32_resolution(expected), measurement_rounding * abs(expected))
        drifts.append(Drift(quantity, f"step {step}", abs(candidate[step][key] - expected), noise))
    return drifts


def tensor_drifts(expected: dict[str, torch.Tensor], candidate: Path, twins: list[Path]) -> list[Drift]:
    found = parameter_drifts(expected, load_parameters(candidate))
    twin_drifts = [parameter_drifts(expected, load_parameters(twin)) for twin in twins]
    drifts = []
    for name, drift in found.items():
        band = max(twin[name] for twin in twin_drifts)
        noise = band or float32_resolution(expected[name].abs().max().item())
        drifts.append(Drift("parameters", name, drift, noise))
    return drifts


def eval_drift(reference: Path, candidate: Path, twins: list[Path]) -> list[Drift]:
    losses = [final_eval_loss(run) for run in (reference, candidate, *twins)]
    if any(loss is None for loss in losses):
        return []
    expected, found, *twin_losses = losses
    band = max(abs(loss - expected) for loss in twin_losses)
    return [Drift("eval loss", "final", abs(found - expected), band or float32_resolution(expected))]


def compare_with_noise(
    reference: Path, candidate: Path, twins: Iterable[Path], factor: float = NOISE_FACTOR
) -> NoiseVerdict:
    """Is ``candidate`` the training ``reference`` is, within ``factor`` times the twins' drift?"""
    twins = list(twins)
    if not twins:
        raise ValueError("the noise floor needs at least one twin run")
    runs = [reference, candidate, *twins]
    check_same_model(runs)
    records = [train_records(run) for run in runs]
    steps = shared_steps(dict(zip(runs, records, strict=True)))
    missing = [str(run) for run in runs if not (run / MODEL_FILE).exists()]
    if missing:
        raise ValueError(f"no model.pt in {', '.join(missing)}: the final parameters cannot be compared")
    expected = load_parameters(reference)
    largest = max(tensor.numel() for tensor in expected.values())
    drifts = step_drifts("loss", "loss", steps, records[0], records[1], records[2:])
    drifts += step_drifts("gradient norm", "grad_norm", steps, *records[:2], records[2:], norm_rounding(largest))
    drifts += tensor_drifts(expected, candidate, twins)
    drifts += eval_drift(reference, candidate, twins)
    return NoiseVerdict(len(steps), len(twins), factor, drifts)


QUANTITIES = ("loss", "gradient norm", "parameters", "eval loss")


def noise_report(verdict: NoiseVerdict) -> str:
    """The table of drifts and the verdict, SAME or DIFFERENT, as its last line."""
    lines = [
        f"{verdict.steps} steps compared; noise floor from {verdict.twins} twin run(s)",
        f"{'quantity':<14} {'candidate':>10} {'twins':>10} {'ratio':>9}  where (the largest ratio)",
    ]
    for quantity in QUANTITIES:
        worst = verdict.worst(quantity)
        if worst is not None:
            lines.append(f"{quantity:<14} {worst.drift:10.3e} {worst.noise:10.3e} {worst.ratio:9.2f}  {worst.where}")
    beyond = verdict.beyond()
    if not beyond:
        lines.append(
            f"SAME: every drift within {verdict.factor:g}x the twins' (largest ratio {verdict.largest_ratio:.2f})"
        )
        return "\n".join(lines)
    first_step = next((drift for drift in beyond if drift.where.startswith("step ")), None)
    parameters = [drift for drift in beyond if drift.quantity == "parameters"]
    places = []
    if first_step is not None:
        places.append(f"{first_step.quantity} left the band first at {first_step.where} ({first_step.ratio:.3g}x)")
    if parameters:
        worst = max(parameters, key=lambda drift: drift.ratio)
        places.append(f"{len(parameters)} parameter tensor(s), most {worst.where} ({worst.ratio:.3g}x)")
    places += [f"eval loss ({drift.ratio:.3g}x)" for drift in beyond if drift.quantity == "eval loss"]
    lines.append(f"DIFFERENT: beyond {verdict.factor:g}x the twins' drift: {'; '.join(places)}")
    return "\n".join(lines)


def print_comparison(result: Comparison) -> None:
    print(f"{result.steps} steps compared")
    print(f"largest loss difference: {result.max_loss_abs_diff:.3e} at step {result.worst_step} "
          f"(relative {result.max_loss_rel_diff:.3e})")  # fmt: skip
    print(f"largest gradient norm difference: relative {result.max_grad_norm_rel_diff:.3e}")
    if result.max_param_abs_diff is None:
        print("parameters: not compared (a run has no model.pt)")
    else:
        print(f"largest parameter difference: {result.max_param_abs_diff:.3e} in {result.worst_param}")


def tolerance_verdict(result: Comparison, args: argparse.Namespace) -> int:
    if args.loss_rtol is None and args.grad_norm_rtol is None and args.param_atol is None:
        print("no verdict: give --noise, or --loss-rtol, --grad-norm-rtol or --param-atol, to have one")
        return 0
    failed = args.loss_rtol is not None and result.max_loss_rel_diff > args.loss_rtol
    failed |= args.grad_norm_rtol is not None and result.max_grad_norm_rel_diff > args.grad_norm_rtol
    if args.param_atol is not None:
        failed |= result.max_param_abs_diff is None or result.max_param_abs_diff > args.param_atol
    print("DIFFERENT: beyond the given tolerance" if failed else "SAME: within the given tolerances")
    return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.runs.compare_runs", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("run_a", type=existing_dir, metavar="REFERENCE")
    parser.add_argument("run_b", type=existing_dir, metavar="CANDIDATE")
    parser.add_argument(
        "--noise",
        type=existing_dir,
        nargs="+",
        metavar="TWIN",
        help="runs of REFERENCE's training in another summation order (one process, --grad-accum-steps K): "
        "the verdict is then measured against their drift",
    )
    parser.add_argument(
        "--noise-factor",
        type=positive_float,
        default=NOISE_FACTOR,
        help="with --noise: how many times the twins' drift a candidate may reach",
    )
    parser.add_argument(
        "--loss-rtol", type=non_negative_float, help="fail if a step's loss differs by more than this, relatively"
    )
    parser.add_argument(
        "--grad-norm-rtol", type=non_negative_float, help="fail if a step's gradient norm differs by more than this"
    )
    parser.add_argument(
        "--param-atol", type=non_negative_float, help="fail if a final parameter differs by more than this"
    )
    args = parser.parse_args(argv)
    tolerances = (args.loss_rtol, args.grad_norm_rtol, args.param_atol)
    if args.noise and any(tolerance is not None for tolerance in tolerances):
        parser.error("give --noise or tolerances, not both: with --noise the twins set the band")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.noise:
            verdict = compare_with_noise(args.run_a, args.run_b, args.noise, args.noise_factor)
        else:
            result = compare(args.run_a, args.run_b)
    except (OSError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.noise:
        print(noise_report(verdict))
        return 0 if verdict.same else 1
    print_comparison(result)
    return tolerance_verdict(result, args)


if __name__ == "__main__":
    sys.exit(main())
