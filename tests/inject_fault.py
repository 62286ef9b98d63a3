"""Run a training script with a fault injected into rank 1, the way real jobs fail.

    torchrun --standalone --nproc_per_node=2 tests/inject_fault.py FAULT SCRIPT [FLAGS...]

FAULT is one of:
  kill-mid-save  SIGKILL during the second checkpoint save, after writing its shards and
                 before the checkpoint is complete (a node failure or an OOM kill mid-save)
  raise          an exception at optimizer step 3 (a bug that only one rank hits)
  sigkill        SIGKILL at optimizer step 3 (a process the kernel kills)
  nan            a NaN loss at step 3 (a diverging run)
Ranks other than 1 run the script untouched.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

FAULTY_RANK = "1"
FAULTY_STEP = 3


def on_call(function: Callable[..., Any], call: int, fault: Callable[[Any], Any]) -> Callable[..., Any]:
    """``function``, except that its ``call``-th call passes its result through ``fault``."""
    calls = 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        result = function(*args, **kwargs)
        return fault(result) if calls == call else result

    return wrapper


def die(_: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def fail(_: object) -> None:
    raise RuntimeError(f"injected failure on rank {FAULTY_RANK} at step {FAULTY_STEP}")


def main() -> None:
    fault, script = sys.argv[1], sys.argv[2]
    if os.environ.get("RANK") == FAULTY_RANK:
        if fault == "kill-mid-save":
            dcp.save = on_call(dcp.save, 2, die)
        elif fault in ("raise", "sigkill"):
            # The optimizer's step is where every script ends a training step.
            torch.optim.AdamW.step = on_call(torch.optim.AdamW.step, FAULTY_STEP, fail if fault == "raise" else die)
        elif fault == "nan":
            F.cross_entropy = on_call(F.cross_entropy, FAULTY_STEP, lambda loss: loss * float("nan"))
        else:
            raise SystemExit(f"unknown fault {fault!r}")
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
