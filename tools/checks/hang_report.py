"""Read the hang report of a run that ended on a hang, from its run directory, after the fact.

    python -m tools.checks.hang_report runs/ddp_transformer

A run whose ranks stopped on a hang (no step for --hang-timeout seconds, a collective that failed, a stop signal
that no step boundary answered) left RUN_DIR/hang/: each live rank's Flight Recorder trace (fr_trace_rank_N, the
pickle torch dumps, named as torch's analyzer ``torch.distributed.flight_recorder.fr_trace`` expects) and its Python
stacks. This prints the report the job printed: which rank stopped at which collective, which never entered it, and
the line of the script where each was. The reading is common.hangs' own, not fr_trace's: on torch 2.14.1 fr_trace
stops with KeyError ('0', 1) on gloo's dumps (their pg_config names the default group '', their entries
'default_pg'); it wants every rank's dump, where a dead rank leaves none; and it judges by completion states, which
gloo does not record ("scheduled" only).
"""

from __future__ import annotations

import argparse
import sys

from common.hangs import HANG_DIR, HangFilesError, hang_report
from tools.command_flags import existing_dir
from tools.processes import exit_code_of


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.checks.hang_report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", type=existing_dir, help="the run directory of the job that hung")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        print(hang_report(args.run_dir / HANG_DIR))
    except HangFilesError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(exit_code_of(main, "python -m tools.checks.hang_report"))
