"""Run a transformer script and time, on rank 0, what its checkpoints cost the training (checkpoint_stall.py).

    torchrun ... tools/benchmarks/timed_saves.py TIMES.json SCRIPT [FLAGS...]

Each ``Checkpointer.save`` call that saved: how long the step waited for it (with --async-checkpoint, the copy of
the state and any wait for the save before). And the loop's wall: from the first ``save`` call, before step 1, to
the moment the last checkpoint is complete (the run's ``save_model`` waits for it first). Nothing of the script
changes: the timing wraps two methods of common.checkpoint.Checkpointer.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

# Started by torchrun as a file: the repository is not on the path by itself.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.checkpoint import Checkpointer  # noqa: E402 - after the path it comes from


def main(times_file: Path, script: str, flags: list[str]) -> None:
    blocked_s: list[float] = []
    began: list[float] = []  # the first save call's clock, once there is one
    save, save_model = Checkpointer.save, Checkpointer.save_model

    def timed_save(self: Checkpointer, step: int, force: bool = False) -> Path | None:
        start = time.perf_counter()
        began[:] = began or [start]
        saved = save(self, step, force)
        if saved is not None:
            blocked_s.append(time.perf_counter() - start)
        return saved

    def timed_save_model(self: Checkpointer, state: Any) -> None:
        self.wait()  # the last checkpoint complete: the end of what the loop costs
        ended = time.perf_counter()
        if os.environ.get("RANK", "0") == "0":
            times = {"blocked_s": blocked_s, "loop_wall_s": ended - began[0]}
            times_file.write_text(json.dumps(times) + "\n")
        save_model(self, state)

    Checkpointer.save = timed_save  # type: ignore[method-assign]
    Checkpointer.save_model = timed_save_model  # type: ignore[method-assign]
    sys.argv = [script, *flags]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
