"""The ranks' agreements (common.distributed's ``AgreementInFlight``) on a real backend, one rank entering late.

Every rank must read the same answer: a stop request one rank received stops them all at the same step, and a
checkpoint one rank could not write is refused by all of them, never published as complete. On torch's fake
process group (tests/test_stop_signals.py) a collective returns at once and leaves each rank's tensor as it was,
so an agreement read before its all-reduce completes cannot be told from one read after it. Here two gloo ranks
run tests/harness/late_agreement.py, whose rank 1 brings the bad news only once rank 0 can no longer go on
without it: an answer read without waiting is then rank 0's own, every time.

The other collectives whose result the project reads are synchronous (DTensor's ``full_tensor``, the plain
``all_reduce`` of ``max_over_ranks``): ``AgreementInFlight`` is the one place that starts one and reads it later.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.run_dir import complete_checkpoints
from tests.harness.runs import Run, run_warm, script_invocation
from tests.harness.wrappers import LATE_AGREEMENT

# Both cases end in seconds; a rank left waiting for the other would hang until the program's own timeouts (30 s).
TIMEOUT_S = 90


def answers_of(case: str, run_dir: Path) -> tuple[Run, list[dict]]:
    invocation = script_invocation(LATE_AGREEMENT, ["--case", case], run_dir, wrapper=[])
    run = run_warm(invocation, run_dir, nproc=2, timeout=TIMEOUT_S)
    files = [run_dir / f"answers-rank{rank}.json" for rank in range(2)]
    return run, [json.loads(path.read_text()) if path.exists() else {"answer": "none written"} for path in files]


def test_a_stop_request_of_a_late_rank_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    run, answers = answers_of("stop", tmp_path)
    # Rank 1 received SIGUSR1 before step 1; each step reads the answers the step before sent.
    expected = [False, True, True]
    assert answers[1].get("answers") == expected, f"{answers}\n{run.describe()}"
    assert answers[0].get("answers") == expected, (
        f"the stop agreement: rank 0 read {answers[0].get('answers')} where rank 1, whose request it was, read "
        f"{answers[1].get('answers')} (each step's answer, step 1 to 3): rank 0 read its own answer before the "
        f"all-reduce of the ranks' answers completed\n{run.describe()}"
    )
    run.check()


def test_a_checkpoint_a_late_rank_could_not_write_is_refused_by_every_rank(tmp_path: Path) -> None:
    run, answers = answers_of("checkpoint", tmp_path)
    assert answers[1]["answer"] == "refused", f"{answers}\n{run.describe()}"
    published = complete_checkpoints(tmp_path)
    assert not published and answers[0]["answer"] == "refused", (
        f"the checkpoint agreement: rank 0 answered {answers[0]['answer']!r} and published {published} as complete, "
        f"though rank 1 could not write its shards and answered {answers[1]['answer']!r}: rank 0 read its own "
        f"answer before the all-reduce of the ranks' answers completed\n{run.describe()}"
    )
    assert "could not write checkpoint" in answers[0]["message"], answers
    run.check()
