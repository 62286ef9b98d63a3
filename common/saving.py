"""Writes that every rank answers together: one rank's failure to write stops all of them with one message.

A write goes through ``common.outputs`` (a temporary beside the target, renamed into place), so a failed
or killed write leaves what was saved before untouched; the messages here say what is still there and
what to do next.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from common.distributed import DistContext, FatalError, all_ranks_agree
from common.outputs import save_torch
from common.run_dir import complete_checkpoints
from common.safe_loading import describe_failure, root_failure
from common.safetensors_weights import write_pretrained


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` through ``common.outputs``: a temporary beside it, renamed into place.

    The rename is atomic on POSIX file systems: readers see the old file or the
    complete new one, never a truncated mix, even if the job dies mid-save. The
    files saved here are the run's own (its checkpoints, its model.pt), so an
    earlier one is replaced.
    """
    save_torch(obj, path, overwrite=True)


def write_failure(write: Callable[[], None]) -> str | None:
    """Run ``write``; None if it worked, else one line on why it did not (a full disk, a lost mount)."""
    try:
        write()
    # DCP's CheckpointException is a BaseException, so it is named here.
    except (Exception, dcp.CheckpointException) as err:  # noqa: BLE001 - the caller reports it, once
        return describe_write_failure(err)
    return None


def describe_write_failure(err: BaseException) -> str:
    """The operating system's reason where there is one: torch wraps it in a RuntimeError of its own."""
    seen: BaseException | None = root_failure(err)
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return f"{seen.strerror} (errno {seen.errno})"
        seen = seen.__cause__ or seen.__context__
    return describe_failure(err)


def non_finite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names of the tensors that hold a NaN or an infinity."""
    return [name for name, tensor in tensors.items() if tensor.is_floating_point() and not torch.isfinite(tensor).all()]


def save_model_file(state: dict[str, torch.Tensor] | None, path: Path, ctx: DistContext) -> None:
    """Rank 0 writes the full state dict ``state`` to ``path``, atomically; other ranks' ``state`` is not read.

    Weights that are not finite are not written. Every rank stops together, with one
    message, if rank 0 cannot write: the job does not hang on the ranks that could.
    """
    save_on_rank_0(state, path, lambda: save_atomic(state, path), ctx)


def save_model_folder(
    state: dict[str, torch.Tensor] | None, folder: Path, config_text: str, tied: dict[str, str], ctx: DistContext
) -> None:
    """``save_model_file`` as a Hugging Face ``save_pretrained`` folder: ``config.json`` (``config_text``) and
    ``model.safetensors``, each name of ``tied`` (alias -> first name) left out, as the Hub's files leave it."""
    save_on_rank_0(state, folder, lambda: write_pretrained(state, folder, config_text, tied, overwrite=True), ctx)


def save_on_rank_0(
    state: dict[str, torch.Tensor] | None, path: Path, write: Callable[[], None], ctx: DistContext
) -> None:
    """Rank 0 checks that ``state`` is finite and runs ``write`` (of ``path``); every rank stops together if not."""
    problem = None
    if ctx.is_main:
        assert state is not None, "rank 0 writes the model; give it the full state dict"
        broken = non_finite_tensors(state)
        if broken:
            problem = (
                f"the final weights are not finite ({', '.join(broken[:3])}{', ...' if len(broken) > 3 else ''}): "
                f"the last update overflowed. {path} was not written. Lower --lr, or resume from an earlier checkpoint"
            )
        else:
            failure = write_failure(write)
            problem = failure and f"could not write {path}: {failure}. {what_is_kept(path.parent)}"
    if not all_ranks_agree(problem is None, ctx):
        raise FatalError(problem or "rank 0 could not write the model", exit_code=1)


# How describe_write_failure names a full disk and a full quota: only then is freeing space the advice.
OUT_OF_SPACE = (f"(errno {errno.ENOSPC})", f"(errno {errno.EDQUOT})")


def then_resume(failure: str | None) -> str:
    """What to do after a failed write: free space where the disk was full, else put right what the reason names."""
    if failure is not None and failure.endswith(OUT_OF_SPACE):
        return "Free some space, then continue with --resume"
    return "Put right what the reason names (a folder moved, deleted or replaced), then continue with --resume"


def what_is_kept(run_dir: Path) -> str:
    """What a user can still resume from after a failed write, for its message."""
    kept = complete_checkpoints(run_dir)
    newest = f"the newest complete checkpoint, {kept[-1]}, is intact" if kept else "this run has saved no checkpoint"
    return f"Nothing saved before was touched: {newest}"
