"""Pre-flight: run a script for a few steps on this machine and check that every rank issues the same collectives.

    python -m tools.checks.preflight --nproc 2 train/train.py --global-batch-size 24
    python -m tools.checks.preflight --nproc 4 fsdp/train_transformer_fsdp2.py --model tiny

A distributed script whose ranks disagree about which collective comes next does not fail: it
hangs, on the cluster, until the process-group timeout, with nothing in its log. A rank that
evaluates alone, gathers a state dict alone, sends an extra all-reduce or a tensor of another
length is enough. This runs the script at N ranks on the CPU (gloo), for 3 steps with an
evaluation, a checkpoint and the final save, into a temporary run directory (never --run-dir: what
is saved there is not touched), and watches every collective each rank issues: its kind, group,
dtypes, shapes and the line of the script that led to it.

Nothing can hang on the mistake it looks for: before a rank issues its n-th collective on a group,
it publishes what that collective is and waits (bounded by --wait) until every other rank of the
group has published its n-th, or has ended. If they differ, no rank issues it: the ranks stop,
and one report shows the two collectives side by side with their lines (exit 1). A clean run
prints the collectives per training step and of the whole run (exit 0). A script that fails
prints its error (exit 1). The whole run is bounded by --timeout, after which every process it
started is killed; a SIGTERM, SIGINT or SIGHUP kills them too, removes the temporary folder, and the
pre-flight exits with 128 + the signal's number.
"""

from __future__ import annotations

import argparse
import linecache
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common.flags import existing_file, float_in_range, output_dir, positive_int, timeout_seconds
from common.outputs import open_log
from common.run_dir import CHECKPOINTS, MODEL_FILE
from tools.checks.lockstep import read_reports, run_rank
from tools.processes import exit_code_of, outside_any_job, run_tree, scratch_folder, standalone_torchrun
from tools.records import UnreadableRecord, read_records

STEPS = 3  # the third step is the one StepObserver measures: collectives_per_step needs it
CHECKPOINT_INTERVAL = 2  # a checkpoint before step 3
EVAL_INTERVAL = 2  # an evaluation mid-run (the MNIST scripts evaluate at the end of each epoch instead)
DEFAULT_WAIT_S = 60.0
DEFAULT_TIMEOUT_S = 600.0
OK, FOUND, BAD_INPUT = 0, 1, 2
# The first present is the verdict: a crash before an ended peer, since the crash is why it ended.
REPORT_ORDER = ("mismatch", "raised", "exited", "peer_ended", "timeout")


def preflight_flags(script_text: str, run_dir: Path, dist_timeout: float) -> list[str]:
    """The flags appended to the user's (argparse keeps the last of each): a short CPU run into ``run_dir``.

    A flag is given only if the script reads it (``args.max_steps`` for --max-steps), so a copy that
    dropped one still starts; the MNIST scripts have no --eval-interval and evaluate after each epoch,
    and an epoch cut short by --max-steps ends with one. Reading the text costs nothing; asking the
    script's --help would cost an interpreter that imports torch.
    """
    wanted = [
        ("--device", "cpu"),
        ("--run-dir", str(run_dir)),
        ("--max-steps", str(STEPS)),
        ("--checkpoint-interval", str(CHECKPOINT_INTERVAL)),
        ("--eval-interval", str(EVAL_INTERVAL)),
        ("--log-interval", "1"),
        ("--dist-timeout", str(int(dist_timeout))),
    ]
    read = [(name, value) for name, value in wanted if f"args.{name[2:].replace('-', '_')}" in script_text]
    return [part for name, value in read for part in (name, value)]


@dataclass
class Plan:
    """Where one pre-flight writes (all of it inside ``root``, a scratch folder), and each rank's arguments."""

    run_dir: Path
    report_dir: Path
    rank_argv: list[str]  # what follows ``python -m tools.checks.preflight`` (or the test launcher's program)


def plan(script: str, flags: list[str], root: Path, wait_s: float) -> Plan:
    run_dir, report_dir = root / "run", root / "reports"
    report_dir.mkdir(parents=True)
    # The process-group timeout stays above the lockstep's own bound: it is the lockstep that reports.
    text = Path(script).read_text(errors="replace")
    all_flags = [*flags, *preflight_flags(text, run_dir, max(10.0, 2 * wait_s))]
    rank_argv = ["--rank", "--report-dir", str(report_dir), "--wait", str(wait_s), script, *all_flags]
    return Plan(run_dir, report_dir, rank_argv)


@dataclass
class Verdict:
    code: int  # OK, FOUND
    text: str
    reports: dict[int, dict] = field(default_factory=dict)

    def side(self, rank: int) -> dict | None:
        """The fingerprint of ``rank``'s side of a mismatch, as the report shows it."""
        for report in self.reports.values():
            if report["rank"] == rank and "mine" in report:
                return report["mine"]
            peer = report.get("peer", {})
            if peer.get("rank") == rank and peer.get("fingerprint"):
                return peer["fingerprint"]
        return None


def judge(report_dir: Path, run_dir: Path, nproc: int, returncode: int, output: str, script: str) -> Verdict:
    """The one report of a pre-flight, from what its ranks wrote."""
    reports = read_reports(report_dir)
    for kind in REPORT_ORDER:
        found = [report for _, report in sorted(reports.items()) if report["verdict"] == kind]
        if found:
            text = describe_problem(found[0], output, reports)
            return Verdict(FOUND, text, reports)
    if returncode != 0 or len(reports) < nproc:
        missing = sorted(set(range(nproc)) - set(reports))
        why = f"exit code {returncode}" + (f"; rank(s) {missing} wrote no report (killed?)" if missing else "")
        return Verdict(FOUND, f"pre-flight: the run failed ({why}). Its last lines:\n{tail(output)}", reports)
    return Verdict(OK, describe_clean_run(reports, run_dir, nproc, script), reports)


def tail(output: str, lines: int = 30) -> str:
    return "\n".join(output.splitlines()[-lines:])


def describe_problem(report: dict, output: str, reports: dict[int, dict]) -> str:
    verdict = report["verdict"]
    if verdict in ("raised", "exited"):
        detail = report["detail"] if verdict == "raised" else f"{report['detail']}; its last lines:\n{tail(output)}"
        return f"pre-flight: the script failed on rank {report['rank']} (not a collective it found):\n{detail}"
    mine, peer = report["mine"], report["peer"]
    rank, other = report["rank"], peer["rank"]
    group = f"collective #{report['n']} on group {mine['group']}"
    if verdict == "mismatch":
        first, second = sorted([(rank, mine), (other, peer["fingerprint"])], key=lambda side: side[0])
        title = f"pre-flight: MISMATCH at {group}: ranks {first[0]} and {second[0]} would issue different collectives"
        table = side_by_side(first, second)
        end = "On the cluster this hangs until --dist-timeout, or pairs the wrong data. No rank issued it."
        return f"{title}\n{table}\n{end}"
    ended = peer.get("ended") or {}
    if verdict == "peer_ended":
        title = (
            f"pre-flight: rank {rank} would issue {group}, but rank {other} had ended "
            f"({ended.get('how')}{': ' + ended['detail'] if ended.get('detail') else ''}) after "
            f"{ended.get('issued')} collectives"
        )
        return f"{title}\n{side_by_side((rank, mine), (other, None))}\nOn the cluster rank {rank} hangs here."
    last = peer.get("last")
    title = f"pre-flight: rank {rank} waited for rank {other} at {group}; rank {other} did not get there within --wait"
    where = f"rank {other}'s last collective: #{last['n']} at {last['script_line']}" if last else "none yet"
    return f"{title} ({where})\n{side_by_side((rank, mine), (other, last))}"


ROWS = (("script line", "script_line"), ("collective", "kind"), ("tensors", "tensors"), ("arguments", "scalars"),
        ("group", "group"), ("called from", "innermost"))  # fmt: skip


def side_by_side(left: tuple[int, dict | None], right: tuple[int, dict | None]) -> str:
    rows = [(label, cell(left[1], key), cell(right[1], key)) for label, key in ROWS]
    rows = [row for row in rows if row[1] or row[2]]
    width = max(len(row[1]) for row in rows) + 2
    lines = [f"  {'':<12} {f'rank {left[0]}':<{width}} rank {right[0]}"]
    for label, mine, theirs in rows:
        marker = "" if mine == theirs else "  <-- differs"
        lines.append(f"  {label:<12} {mine:<{width}} {theirs}{marker}".rstrip())
    for rank, fp in (left, right):
        if fp is not None:
            lines.append(f"  rank {rank}, {fp['script_line']}:  {source_line(fp['script_line'])}")
    return "\n".join(lines)


def source_line(place: str) -> str:
    """The text of "file:line", without its comment: read here, a rank's report holds only where it is."""
    file, _, line = place.rpartition(":")
    text = linecache.getline(file, int(line)).strip() if line.isdigit() else ""
    return text.split("  #", 1)[0]


def cell(fp: dict | None, key: str) -> str:
    if fp is None:
        return "(ended)" if key == "kind" else ""
    if key == "kind":
        return f"{fp['kind']} ({fp['op']})"
    value = fp[key]
    return ", ".join(value) if isinstance(value, list) and key != "group" else str(value)


def run_records(run_dir: Path) -> tuple[list[dict] | None, str | None]:
    """The run's metrics.jsonl records, read by tools.records' rule, or None and why: a script of the user's own
    need not write one, nor one that ends early on purpose, and one it writes in its own format is no error here."""
    try:
        return read_records(run_dir).records, None
    except FileNotFoundError:
        return None, "the script wrote no metrics.jsonl"
    except (OSError, UnreadableRecord) as err:
        return None, str(err)


def describe_clean_run(reports: dict[int, dict], run_dir: Path, nproc: int, script: str) -> str:
    records, unread = run_records(run_dir)
    final = next((r for r in reversed(records or []) if r.get("event") == "final"), {})
    evaluations = sum(1 for r in records or [] if r.get("event") == "eval")
    checkpoints = len(list((run_dir / CHECKPOINTS).glob("step-*")))
    saved = (run_dir / MODEL_FILE).exists()
    totals = reports[0]["totals"]
    count = sum(v for k, v in totals.items() if k.endswith(" count"))
    lines = [
        f"pre-flight: OK. {script} at {nproc} rank(s): {final.get('steps', '?')} steps, {evaluations} evaluation(s), "
        f"{checkpoints} checkpoint(s), {'the final save' if saved else 'no final save'}; "
        f"all {count} collectives matched on every rank, in order, from the same lines.",
    ]
    per_step, step_bytes = final.get("collectives_per_step", {}), final.get("comm_bytes_per_step", {})
    if per_step:
        lines.append("  per training step:  " + kinds_line({k: (per_step[k], step_bytes.get(k, 0)) for k in per_step}))
    kinds = sorted({key.rsplit(" ", 1)[0] for key in totals})
    lines.append(
        "  whole run, rank 0:  " + kinds_line({k: (totals[f"{k} count"], totals[f"{k} bytes"]) for k in kinds})
    )
    if records is None:
        lines.append(f"  note: {unread}: its steps, evaluations and checkpoints are not known")
    if nproc == 1:
        lines.append("  note: one rank has no other to be compared with; run --nproc 2 or more")
    if not evaluations or not checkpoints or not saved:
        lines.append("  note: the parts it did not reach were not checked (flags the script lacks?)")
    return "\n".join(lines)


def kinds_line(by_kind: dict[str, tuple[int, int]]) -> str:
    return ", ".join(f"{kind} {n} ({human_bytes(size)})" for kind, (n, size) in sorted(by_kind.items()))


def human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def rank_env(project: Path) -> dict[str, str]:
    env = outside_any_job()  # a pre-flight started inside a job must not join it
    env.setdefault("OMP_NUM_THREADS", "1")
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU and gloo, whatever this machine has
    # tools/ comes after what the user put first: a copy's own common/ is the one its ranks run.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH", ""), str(project)]))
    return env


@dataclass
class Launched:
    returncode: int
    output: str
    timed_out: bool
    left_running: list[int]


def launch_ranks(
    command: list[str], env: dict[str, str], timeout: float, report_dir: Path, nproc: int, log: Path
) -> Launched:
    """Run torchrun to its end, or until a rank reports a problem (its peers then need no more time), or the
    timeout; then kill whatever it started that is still there."""
    with open_log(log, append=False) as out:
        ended = run_tree(command, out, env=env, timeout=timeout, done=results_in(report_dir, nproc))
    return Launched(ended.returncode, log.read_text(errors="replace"), ended.timed_out, ended.left_running)


def results_in(report_dir: Path, nproc: int) -> Callable[[], bool]:
    """Whether the run's result is in: every rank has reported, or one reported a problem 3 s ago (a moment
    for its peers' own reports, then no more waiting)."""
    settle_until: float | None = None

    def done() -> bool:
        nonlocal settle_until
        reports = read_reports(report_dir)
        if settle_until is None and any(r["verdict"] in REPORT_ORDER for r in reports.values()):
            settle_until = time.monotonic() + 3.0
        return settle_until is not None and (time.monotonic() >= settle_until or len(reports) == nproc)

    return done


def preflight(script: str, flags: list[str], nproc: int, wait_s: float, timeout: float) -> Verdict:
    project = Path(__file__).resolve().parents[2]
    env = rank_env(project)
    with scratch_folder("preflight-") as root:
        planned = plan(script, flags, root, wait_s)
        command = [*standalone_torchrun(nproc), "--max-restarts=0", "-m", "tools.checks.preflight", *planned.rank_argv]
        launched = launch_ranks(command, env, timeout, planned.report_dir, nproc, root / "ranks.log")
        if launched.timed_out:
            reports = read_reports(planned.report_dir)
            return Verdict(FOUND, f"pre-flight: no result within --timeout {timeout:g} s; every process it started "
                                  f"was killed. The last lines:\n{tail(launched.output)}", reports)  # fmt: skip
        verdict = judge(planned.report_dir, planned.run_dir, nproc, launched.returncode, launched.output, script)
        if launched.left_running:
            verdict.text += f"\n(processes {launched.left_running} outlived the kill)"
        return verdict


# A run's limit: above a week, time arithmetic with it overflows (OverflowError at --wait inf, before).
run_limit = float_in_range(1, 7 * 24 * 3600, unit=" seconds", name="run_limit")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    # common.flags' types, not common.cli: that imports torch, which this process never needs (its ranks do).
    parser = argparse.ArgumentParser(prog="python -m tools.checks.preflight", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--nproc", type=positive_int, help="ranks to run, as torchrun's --nproc_per_node")
    # The script's --dist-timeout takes it, so it has that flag's range.
    parser.add_argument("--wait", type=timeout_seconds, default=DEFAULT_WAIT_S, metavar="S",
                        help="how long a rank waits for the others at one collective (rank 0 saving a "
                             "checkpoint while the others wait must fit)")  # fmt: skip
    parser.add_argument("--timeout", type=run_limit, default=DEFAULT_TIMEOUT_S, metavar="S",
                        help="the whole run's limit; then every process it started is killed")  # fmt: skip
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # one rank, as torchrun starts it
    parser.add_argument("--report-dir", type=output_dir, help=argparse.SUPPRESS)
    parser.add_argument("script", type=existing_file, help="the training script: this repository's or your copy")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="the script's flags, as you would give them")
    args = parser.parse_args(argv)
    if not args.rank and args.nproc is None:
        parser.error("--nproc N: the number of ranks, 1 or more")
    args.script = str(args.script)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank:
        run_rank(args.script, args.flags, args.report_dir, args.wait)
        return OK
    # Not on the ranks: torchrun stops them with SIGTERM, and that must stay the script's own business.
    return exit_code_of(lambda: report(args), "python -m tools.checks.preflight")


def report(args: argparse.Namespace) -> int:
    verdict = preflight(args.script, args.flags, args.nproc, args.wait, args.timeout)
    print(verdict.text)
    return verdict.code


if __name__ == "__main__":
    sys.exit(main())
