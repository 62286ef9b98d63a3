"""Run a training script and write down what it does inside its steps, for tests to check.

    tests/harness/observe.py WHAT SCRIPT [FLAGS...]     (under the test launcher, or torchrun)

WHAT is one of:
  host-reads  every read of a tensor's value on the host (.item(), bool(), float(), .tolist(),
              .cpu(), .numpy(), printing), with the optimizer step it happened in and the code
              that asked for it
  grad-dtype  at each training loss: the dtypes of the gradients the model holds so far, so the
              second micro-step of an accumulating run shows what the first one left behind
  build-memory  the peak of this process's resident memory from the moment the model's class
              is called until the first training step begins (building, wrapping, sharding,
              initialising), above what it held when building began; Linux only. The ranks
              end there, together, with exit code 0: the run trains no step
  private-memory  the largest private resident memory (RssAnon: not the pages of a mapped file,
              which the kernel can drop and read again) at the start of any training step; Linux only
  resumed-optimizer  right after a resume, the optimizer's state as the run holds it (gathered whole)
              and as the checkpoint it resumed from holds it, per parameter; rank 0 writes both to
              RUN_DIR/observed-resumed-optimizer-step{STEP}.pt ({"loaded": ..., "saved": ...})
  imports     the top-level packages loaded when the script ends (a package a flag imports only when
              given: tensorboard)

Each rank writes RUN_DIR/observed-WHAT-rank{RANK}.json when the script ends, however it ends.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from common.mnist import MnistNet
from common.models import GPT

REPO = Path(__file__).resolve().parents[2]
# The ways Python code turns a tensor's value into a host value. On a GPU each one waits until
# all the work queued before it has run.
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy", "__format__", "__repr__")


class Steps:
    """Counts optimizer steps: each begins with ``zero_grad``; what runs before the first is step 0."""

    def __init__(self) -> None:
        self.current = 0
        self.on_first_step: list[Any] = []
        self.on_every_step: list[Any] = []
        original = torch.optim.Optimizer.zero_grad

        def zero_grad(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            self.current += 1
            if self.current == 1:
                for callback in self.on_first_step:
                    callback()
            for callback in self.on_every_step:
                callback()
            return original(optimizer, *args, **kwargs)

        torch.optim.Optimizer.zero_grad = zero_grad  # type: ignore[method-assign]


def where(frames: list[traceback.FrameSummary]) -> dict[str, str]:
    """Where a read came from: the innermost frame of the project's own code (the line that asked
    for it), and the innermost frame of all (torch's own code, when torch made the read)."""

    def name(frame: traceback.FrameSummary) -> str:
        path = frame.filename.split("site-packages/")[-1].removeprefix(f"{REPO}/")
        return f"{path}:{frame.name}"

    own = [frame for frame in frames if frame.filename.startswith(f"{REPO}/") and "site-packages" not in frame.filename]
    own = [frame for frame in own if not frame.filename.startswith(f"{REPO}/tests/")]
    return {"project": name(own[-1]) if own else "?", "innermost": name(frames[-1])}


def watch_host_reads(steps: Steps, record: dict[str, Any]) -> None:
    reads: list[dict[str, Any]] = record.setdefault("reads", [])
    depth = threading.local()

    def wrap(method: str) -> None:
        original = getattr(torch.Tensor, method)

        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            outermost = getattr(depth, "value", 0) == 0  # a DTensor's read reads its local tensor too
            depth.value = getattr(depth, "value", 0) + 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                depth.value -= 1
                if outermost:
                    reads.append({"step": steps.current, "method": method, **where(traceback.extract_stack()[:-1])})

        setattr(torch.Tensor, method, read)

    for method in READS:
        wrap(method)


def watch_models(before_first: list[Any]) -> list[torch.nn.Module]:
    """Every model the script builds, as it builds it: the first is the one it trains.
    ``before_first`` callbacks run just before the first one is built."""
    built: list[torch.nn.Module] = []
    for cls in (GPT, MnistNet):
        original = cls.__init__

        def init(model: torch.nn.Module, *args: Any, wrapped: Any = original, **kwargs: Any) -> None:
            if not built:
                for callback in before_first:
                    callback()
            wrapped(model, *args, **kwargs)
            built.append(model)

        cls.__init__ = init  # type: ignore[method-assign]
    return built


def watch_grad_dtypes(built: list[torch.nn.Module], record: dict[str, Any]) -> None:
    """At each training loss, right after the model's forward: the dtypes of the gradients it holds."""
    original = F.cross_entropy
    seen: list[list[str]] = record.setdefault("at_loss", [])

    def cross_entropy(*args: Any, **kwargs: Any) -> torch.Tensor:
        if built and torch.is_grad_enabled():  # training, not evaluation
            seen.append(sorted({str(p.grad.dtype) for p in built[0].parameters() if p.grad is not None}))
        return original(*args, **kwargs)

    F.cross_entropy = cross_entropy


def resident_kib(field: str) -> int:
    """VmRSS (now), VmHWM (the peak since the last reset) or RssAnon (private, now) of this process, in KiB."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(f"{field}:")))


def watch_build_memory(steps: Steps, before_build: list[Any], record: dict[str, Any], run_dir: Path) -> None:
    def start() -> None:
        # glibc keeps freed blocks for reuse, so resident memory would show what the allocator kept,
        # not what was alive: serve every block of 64 KiB or more from its own mapping, returned at once.
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)
        Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from what is resident now
        record["resident_before_kib"] = resident_kib("VmRSS")

    def stop() -> None:
        record["peak_growth_bytes"] = 1024 * (resident_kib("VmHWM") - record["resident_before_kib"])
        # The observation is complete. A training step, an evaluation and the gathered save of a model
        # built to be large would cost the suite seconds and show nothing more. Every rank gets here
        # before ending, so none is left waiting in a collective of a rank that has gone.
        torch.distributed.barrier()
        write_record(run_dir, record | {"steps": steps.current})
        os._exit(0)

    before_build.append(start)
    steps.on_first_step.append(stop)


def watch_private_memory(steps: Steps, record: dict[str, Any]) -> None:
    record["largest_private_bytes"] = 0

    def note() -> None:
        private = 1024 * resident_kib("RssAnon")
        record["largest_private_bytes"] = max(record["largest_private_bytes"], private)

    steps.on_every_step.append(note)


def watch_resumes(run_dir: Path) -> None:
    """After each ``Checkpointer.resume`` that loaded a checkpoint: the optimizer state it left, and the saved one."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from common.checkpoint import Checkpointer, full_state_dict_options

    original = Checkpointer.resume

    def saved_state(path: Path) -> dict[str, Any]:
        if not path.is_dir():
            return torch.load(path, weights_only=True)["optimizer"]["state"]
        whole = run_dir / f"observed-{path.name}.pt"
        dcp_to_torch_save(path, whole)  # a sharded checkpoint's slices, put together as one file
        return torch.load(whole, weights_only=True)["optimizer"]["state"]

    def resume(checkpointer: Checkpointer, *args: Any, **kwargs: Any) -> Any:
        resumed = original(checkpointer, *args, **kwargs)
        if resumed.path is not None:
            # DISTRIBUTED: every rank helps gather the state, as for a full checkpoint; rank 0 keeps it.
            options = full_state_dict_options(checkpointer.ctx.device)
            _, loaded = get_state_dict(checkpointer.model, checkpointer.optimizer, options=options)
            if checkpointer.ctx.is_main:
                observed = {"loaded": loaded["state"], "saved": saved_state(resumed.path)}
                torch.save(observed, run_dir / f"observed-resumed-optimizer-step{resumed.step}.pt")
        return resumed

    Checkpointer.resume = resume  # type: ignore[method-assign]


def main() -> None:
    what, script, *flags = sys.argv[1:]
    run_dir = Path(flags[flags.index("--run-dir") + 1])
    record: dict[str, Any] = {"what": what}
    steps = Steps()
    before_build: list[Any] = []
    built = watch_models(before_build)
    if what == "host-reads":
        watch_host_reads(steps, record)
    elif what == "grad-dtype":
        watch_grad_dtypes(built, record)
    elif what == "build-memory":
        watch_build_memory(steps, before_build, record, run_dir)
    elif what == "private-memory":
        watch_private_memory(steps, record)
    elif what == "resumed-optimizer":
        watch_resumes(run_dir)
    elif what != "imports":
        raise SystemExit(f"unknown observation {what!r}")
    sys.argv = [script, *flags]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        if what == "imports":
            record["imports"] = sorted({name.split(".")[0] for name in sys.modules})
        write_record(run_dir, record | {"steps": steps.current})


def write_record(run_dir: Path, record: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / f"observed-{record['what']}-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
