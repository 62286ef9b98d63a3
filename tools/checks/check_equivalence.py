"""Does N processes train what one does? One command for any script, this repository's or your copy.

    python -m tools.checks.check_equivalence --nproc 3 ddp/train_transformer.py --global-batch-size 24
    python -m tools.checks.check_equivalence --nproc 2 train/train.py --global-batch-size 24 --max-steps 12
    python -m tools.checks.check_equivalence --nproc 2 --reference-script ddp/train_transformer.py \
        fsdp/train_transformer.py --lora-rank 4 --global-batch-size 24

It runs the script, with its flags, three ways, each into a run directory of its own under
--runs-dir:
  reference   one process (of --reference-script, where given);
  twin-K      one process in K micro-steps (--grad-accum-steps K): the same training summed in
              another order, for several K, whose drift from the reference is the noise floor;
  candidate   torchrun --standalone --nproc_per_node=N, with the flags as given.
Then it compares them with tools.runs.compare_runs --noise and prints the verdict: exit 0 for SAME,
1 for DIFFERENT, 2 when a run failed or the flags cannot give a fair comparison.

Every run gets --deterministic and, unless the flags say otherwise, --log-interval 1 and
--max-steps 20; and one thread per process unless OMP_NUM_THREADS says otherwise (torchrun's
default: a thread count is an order of summation too). --global-batch-size is required: it is what
keeps each step's examples the same at any world size and any split into micro-steps. The twins
are the K that divide it, from 2 up to half of it (six at most), and N times the flags'
--grad-accum-steps (docs/equivalence.md, "Which twins").
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.cli import HelpFormatter
from common.flags import existing_file, output_dir, positive_float, positive_int
from common.outputs import write_text
from tools.processes import exit_code_of, one_thread_per_rank, output_of, standalone_torchrun
from tools.runs.compare_runs import NOISE_FACTOR, compare_with_noise, noise_report

DEFAULT_STEPS = 20
MAX_TWINS = 6
SAME, DIFFERENT, FAILED = 0, 1, 2


@dataclass
class Planned:
    """One run of the check: its folder's name, how many processes (None: plain python), its flags."""

    name: str
    nproc: int | None
    flags: list[str]


# How a run is started: (script, flags, nproc or None, run_dir) -> (exit code, everything it printed).
Runner = Callable[[str, list[str], int | None, Path], tuple[int, str]]


def flag_value(flags: list[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in ``flags``; the last one wins, as in argparse."""
    value = None
    for index, flag in enumerate(flags):
        if flag == name and index + 1 < len(flags):
            value = flags[index + 1]
        elif flag.startswith(f"{name}="):
            value = flag.split("=", 1)[1]
    return value


def without_flag(flags: list[str], name: str) -> list[str]:
    kept, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag == name:
            skip = True
        elif not flag.startswith(f"{name}="):
            kept.append(flag)
    return kept


def twin_splits(global_batch: int, candidate_split: int) -> list[int]:
    """Micro-step counts K for the twins: the divisors of the global batch from 2 to half of it,
    the smallest six, and the candidate's own split (its ranks times its micro-steps).

    One twin is not enough: measured on the transformer at 20 steps, the twins' parameter drift
    spread over 300x from one K to another (3e-7 at K=2 and 4, 7e-5 at K=12), and a 2-process run
    drifted 80x more than the K=2 twin. Several K sample how far rounding alone can take this model.
    """
    divisors = [k for k in range(2, global_batch // 2 + 1) if global_batch % k == 0][:MAX_TWINS]
    if candidate_split > 1:
        divisors.append(candidate_split)
    return sorted(set(divisors))


class BadFlags(ValueError):
    """The flags cannot give a fair comparison."""


def script_count(text: str, flag: str) -> int:
    """A positive count among the script's flags, read here first: the plan divides by it."""
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError as err:
        raise BadFlags(f"the script's {flag}: {err}") from None


def plan(flags: list[str], nproc: int) -> list[Planned]:
    """The reference, the twins and the candidate, with the flags each runs with."""
    if flag_value(flags, "--run-dir") is not None:
        raise BadFlags("leave out --run-dir: each run gets a folder of its own under --runs-dir")
    global_batch_text = flag_value(flags, "--global-batch-size")
    if global_batch_text is None:
        raise BadFlags(
            "give the script --global-batch-size G (G divisible by --nproc times --grad-accum-steps): "
            "without it, each process count trains on another batch"
        )
    global_batch = script_count(global_batch_text, "--global-batch-size")
    micro_steps = script_count(flag_value(flags, "--grad-accum-steps") or "1", "--grad-accum-steps")
    if global_batch % (nproc * micro_steps):
        raise BadFlags(
            f"--global-batch-size {global_batch} does not split into {nproc} processes x {micro_steps} micro-steps"
        )
    splits = twin_splits(global_batch, nproc * micro_steps)
    if not splits:
        raise BadFlags(f"--global-batch-size {global_batch} has no divisor to split it by: use one like 24")
    common = without_flag(flags, "--grad-accum-steps")
    common += [] if "--deterministic" in common else ["--deterministic"]
    common += [] if flag_value(common, "--log-interval") else ["--log-interval", "1"]
    common += [] if flag_value(common, "--max-steps") else ["--max-steps", str(DEFAULT_STEPS)]
    return [
        Planned("reference", None, common),
        *(Planned(f"twin-{k}", None, [*common, "--grad-accum-steps", str(k)]) for k in splits),
        Planned("candidate", nproc, [*common, "--grad-accum-steps", str(micro_steps)]),
    ]


def run_in_subprocess(script: str, flags: list[str], nproc: int | None, run_dir: Path) -> tuple[int, str]:
    """``python SCRIPT`` or ``torchrun --standalone``, in a clean launcher environment."""
    launcher = [sys.executable] if nproc is None else standalone_torchrun(nproc)
    # Outside any job (a check started inside one must not join it), and one thread per process in every
    # run: on the CPU two threads add a layer's partial sums in another order than one, which the twins
    # would not share.
    env = one_thread_per_rank()
    # In a process tree that ends with this command, stopped or not (tools.processes).
    return output_of([*launcher, script, *flags, "--run-dir", str(run_dir)], env=env)


def check(
    script: str,
    flags: list[str],
    nproc: int,
    runs_dir: Path,
    runner: Runner = run_in_subprocess,
    factor: float = NOISE_FACTOR,
    reference_script: str | None = None,
) -> int:
    """Run the plan and print the verdict; SAME, DIFFERENT or FAILED. The one-process runs (reference and
    twins) run ``reference_script`` where it is given, the candidate ``script``."""
    try:
        planned = plan(flags, nproc)
    except BadFlags as err:
        print(f"error: {err}", file=sys.stderr)
        return FAILED
    taken = [run.name for run in planned if (runs_dir / run.name).exists()]
    if taken:
        print(f"error: {runs_dir} holds an earlier check's runs ({', '.join(taken)}): "
              "give another --runs-dir or remove it", file=sys.stderr)  # fmt: skip
        return FAILED
    runs_dir.mkdir(parents=True, exist_ok=True)
    for run in planned:
        how = "1 process" if run.nproc is None else f"{run.nproc} processes"
        started = time.perf_counter()
        run_script = reference_script if reference_script and run.nproc is None else script
        code, output = runner(run_script, run.flags, run.nproc, runs_dir / run.name)
        write_text(runs_dir / f"{run.name}.log", output, overwrite=True)  # beside this check's own run
        if code != 0:
            tail = "\n".join(output.splitlines()[-20:])
            print(f"{run.name} ({how}) failed with exit code {code}; its last lines:\n{tail}\n"
                  f"(all of it: {runs_dir / run.name}.log)", file=sys.stderr)  # fmt: skip
            return FAILED
        print(f"{run.name:<10} {how:<12} {time.perf_counter() - started:6.1f} s  {run_script}")
    twins = [runs_dir / run.name for run in planned if run.name.startswith("twin-")]
    try:
        verdict = compare_with_noise(runs_dir / "reference", runs_dir / "candidate", twins, factor)
    except (OSError, ValueError, KeyError) as err:  # e.g. --max-steps 0: no step to compare
        print(f"error: the runs cannot be compared: {err}", file=sys.stderr)
        return FAILED
    print(noise_report(verdict))
    return SAME if verdict.same else DIFFERENT


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.checks.check_equivalence", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--nproc", type=positive_int, required=True, help="processes of the candidate run")
    parser.add_argument(
        "--runs-dir",
        type=output_dir,
        help="where the runs go, one folder each (default: runs/equivalence/SCRIPT-NAME-NPROC)",
    )
    parser.add_argument(
        "--noise-factor",
        type=positive_float,
        default=NOISE_FACTOR,
        help="how many times the twins' drift is still SAME",
    )
    parser.add_argument(
        "--reference-script",
        type=existing_file,
        help="run the one-process reference and twins with this script (default: SCRIPT): for a candidate that "
        "cannot train in one process, as FSDP1 with --freeze or --lora-rank, one that trains the same model, "
        "e.g. ddp/train_transformer.py",
    )
    parser.add_argument("script", type=existing_file, help="the training script: this repository's or your copy")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="the script's flags, as you would give them")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command's own flags, checked; check() refuses the script's flags that the plan cannot use."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.nproc < 2:
        parser.error("--nproc must be 2 or more: the reference already runs one process")
    args.script = str(args.script)
    args.reference_script = None if args.reference_script is None else str(args.reference_script)
    args.runs_dir = args.runs_dir or Path("runs") / "equivalence" / f"{Path(args.script).stem}-{args.nproc}"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return check(
        args.script,
        args.flags,
        args.nproc,
        args.runs_dir,
        factor=args.noise_factor,
        reference_script=args.reference_script,
    )


if __name__ == "__main__":
    sys.exit(exit_code_of(main, "python -m tools.checks.check_equivalence"))
