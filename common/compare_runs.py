"""Compare two runs step by step: did they train the same model?

    python -m common.compare_runs RUN_A RUN_B
    python -m common.compare_runs RUN_A RUN_B --loss-rtol 1e-5 --param-atol 1e-5

Reads each run directory's metrics.jsonl (the per-step training loss and
global gradient norm) and, when both have one, model.pt (the final
parameters). Prints the largest differences and exits 1 when a tolerance is
given and exceeded, so it can gate a change.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from common.cli import HelpFormatter


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
    records = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    return {record["step"]: record for record in records if record["event"] == "train"}


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12)


def compare_parameters(model_a: Path, model_b: Path) -> tuple[float, str]:
    state_a = torch.load(model_a, weights_only=True)
    state_b = torch.load(model_b, weights_only=True)
    if state_a.keys() != state_b.keys():
        raise ValueError(f"{model_a} and {model_b} hold different parameter names")
    differences = {name: (state_a[name].double() - state_b[name].double()).abs().max().item() for name in state_a}
    worst = max(differences, key=differences.__getitem__)
    return differences[worst], worst


def compare(run_a: Path, run_b: Path) -> Comparison:
    records_a, records_b = train_records(run_a), train_records(run_b)
    shared = sorted(records_a.keys() & records_b.keys())
    if not shared:
        raise ValueError(f"{run_a} and {run_b} have no logged step in common")
    abs_diff = {step: abs(records_a[step]["loss"] - records_b[step]["loss"]) for step in shared}
    worst_step = max(shared, key=abs_diff.__getitem__)
    rel_diff = max(relative(records_a[step]["loss"], records_b[step]["loss"]) for step in shared)
    # A gradient summed instead of averaged over ranks hides from the loss
    # under Adam, which is blind to the gradient's scale; the norm shows it.
    norm_diff = max(relative(records_a[step]["grad_norm"], records_b[step]["grad_norm"]) for step in shared)
    param_diff, worst_param = None, None
    if (run_a / "model.pt").exists() and (run_b / "model.pt").exists():
        param_diff, worst_param = compare_parameters(run_a / "model.pt", run_b / "model.pt")
    return Comparison(len(shared), worst_step, abs_diff[worst_step], rel_diff, norm_diff, param_diff, worst_param)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--loss-rtol", type=float, help="fail if a step's loss differs by more than this, relatively")
    parser.add_argument("--grad-norm-rtol", type=float, help="fail if a step's gradient norm differs by more than this")
    parser.add_argument("--param-atol", type=float, help="fail if a final parameter differs by more than this")
    args = parser.parse_args(argv)
    try:
        result = compare(args.run_a, args.run_b)
    except (OSError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    print(f"{result.steps} steps compared")
    print(f"largest loss difference: {result.max_loss_abs_diff:.3e} at step {result.worst_step} "
          f"(relative {result.max_loss_rel_diff:.3e})")  # fmt: skip
    print(f"largest gradient norm difference: relative {result.max_grad_norm_rel_diff:.3e}")
    if result.max_param_abs_diff is None:
        print("parameters: not compared (a run has no model.pt)")
    else:
        print(f"largest parameter difference: {result.max_param_abs_diff:.3e} in {result.worst_param}")

    if args.loss_rtol is None and args.grad_norm_rtol is None and args.param_atol is None:
        print("no verdict: give --loss-rtol, --grad-norm-rtol or --param-atol to have one")
        return 0
    failed = args.loss_rtol is not None and result.max_loss_rel_diff > args.loss_rtol
    failed |= args.grad_norm_rtol is not None and result.max_grad_norm_rel_diff > args.grad_norm_rtol
    if args.param_atol is not None:
        failed |= result.max_param_abs_diff is None or result.max_param_abs_diff > args.param_atol
    print("DIFFERENT: beyond the given tolerance" if failed else "SAME: within the given tolerances")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
