"""The run's tensors in and out, safely: loads that run no code, and saves that every rank answers together.

Weights and checkpoints load with ``torch.load(weights_only=True)``, a sharded checkpoint's ``.metadata`` through
an allow-list unpickler; a file that cannot be used is one line that says why. Saves go through ``common.outputs``,
and one rank's failure to write stops every rank with one message: what is still there, what to do next.
"""

from __future__ import annotations

import errno
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from common.distributed import (
    DistContext,
    FatalError,
    all_ranks_agree,
    broadcast_object,
    print0,
    quiet_internal_warnings,
)
from common.fine_tuning import is_adapter
from common.models import tied_parameters
from common.outputs import save_torch
from common.run_dir import checkpoint_step, complete_checkpoints
from common.safetensors_weights import (
    Header,
    holds_safetensors,
    start_from_safetensors,
    untied_problem,
    weights_problem,
    write_pretrained,
)


def load_file(path: Path) -> Any:
    """``torch.load(weights_only=True)`` onto the CPU; a file cut short (a copy or a save that did not finish)
    is an EOFError, which describe_failure calls truncated: torch itself says "[Errno 22] Invalid argument"."""
    with path.open("rb") as file:
        zipped = file.read(4) == b"PK\x03\x04"  # torch.save's format: a zip archive, its directory at the end
    if zipped and not zipfile.is_zipfile(path):
        raise EOFError(f"{path} ends before its zip archive's directory")
    return torch.load(path, map_location="cpu", weights_only=True)


def start_from_weights(model: torch.nn.Module, path: Path, ctx: DistContext) -> None:
    """--init-from: a plain state dict (a run's model.pt, export_checkpoint's output) into the wrapped ``model``,
    for a new run from step 0; a Hugging Face folder or ``.safetensors`` file goes to start_from_safetensors.

    DISTRIBUTED: only rank 0 reads the file; set_model_state_dict broadcasts it a tensor at a time, so no rank
    holds more than one whole copy. Keys, shapes or dtypes that differ stop every rank with one message (exit 2).
    """
    if holds_safetensors(path):
        start_from_safetensors(model, path, ctx)
        return
    # This rank's part of each tensor, under the names a plain model has; size() is the whole tensor's.
    # LoRA adapters are not in the weights a user starts from: they start as no change (B = 0).
    with quiet_internal_warnings():  # FSDP1's sharded state dict still goes through ShardedTensor
        whole = {name: (tuple(tensor.size()), tensor.dtype) for name, tensor in get_model_state_dict(model).items()}
    expected = {name: shape for name, shape in whole.items() if not is_adapter(name)}
    tied = tied_parameters(model)
    state: dict[str, torch.Tensor] = {}
    problem = None
    if ctx.is_main:
        try:
            state = load_file(path)
        except Exception as err:  # noqa: BLE001 - any failure to read it is one message, below
            problem = f"cannot be loaded ({describe_failure(err)})"
        else:
            problem = weights_mismatch(state, expected, tied)
    problem = broadcast_object(problem)
    if problem is not None:
        raise FatalError(f"--init-from {path} {problem}")
    for alias, source in tied.items() if ctx.is_main else ():
        state[alias] = state[source]  # a file may hold a tied tensor once, under its first name
    with quiet_internal_warnings():
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=len(expected) == len(whole))
        set_model_state_dict(model, state, options=options)
    print0(f"weights from {path} ({len(expected)} tensors); a new run: step 0, a fresh optimizer")


def weights_mismatch(state: Any, expected: Header, tied: dict[str, str]) -> str | None:
    """Why ``state`` does not fit a model of ``expected``'s names, shapes and dtypes; None if it fits."""
    if not isinstance(state, dict) or not all(isinstance(value, torch.Tensor) for value in state.values()):
        return (
            "is not a state dict (tensors by name). A checkpoint of a run resumes with --resume-from; "
            "python -m tools.runs.export_checkpoint turns one into a state dict"
        )
    found = {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in state.items()}
    return weights_problem(found, expected, tied) or untied_problem(state, tied)


def describe_failure(err: BaseException) -> str:
    """One line about what went wrong; for DCP, the first rank's own exception, not the wrapper."""
    err = root_failure(err)
    if isinstance(err, EOFError):
        return "EOFError: a file in it ends too early, as a truncated file does"
    if isinstance(err, pickle.UnpicklingError) and str(err).startswith("Weights only load failed"):
        # torch's own text goes on to explain how to load it unsafely; that is not advice to pass on.
        return "UnpicklingError: it holds more than tensors and plain data, which torch.load(weights_only=True) refuses"
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


# DCP's FileSystemReader reads the pickled `.metadata` with a plain pickle.load (checked in torch 2.6.0 and
# 2.14.1), so a crafted file runs any code it names; torch's weights_only unpickler rejects the FRAME opcode of
# pickle protocol 4. These are all the globals DCP's metadata names; each only stores or looks up data when called.
_METADATA_CLASSES = ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "_MEM_FORMAT_ENCODING")
_STORAGE_CLASSES = ("TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata")
_TORCH_VALUES = torch.dtype | torch.layout | torch.memory_format
_DCP_METADATA_GLOBALS = frozenset(
    {
        *(("torch.distributed.checkpoint.metadata", name) for name in _METADATA_CLASSES + _STORAGE_CLASSES),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # how torch pickles a torch.layout
        # StorageMeta.checkpoint_id: the path the saver was given. Python 3.13 pickles it from pathlib._local.
        ("pathlib", "PosixPath"),
        ("pathlib._local", "PosixPath"),
        *(("torch", name) for name, value in vars(torch).items() if isinstance(value, _TORCH_VALUES)),
    }
)


class UntrustedCheckpoint(Exception):
    """A sharded checkpoint that holds more than DCP writes, refused before any of it was unpickled."""

    def refusal(self, path: Path) -> str:
        return (
            f"checkpoint {path} was refused: {self}. The metadata of a sharded checkpoint is a pickle, and "
            "unpickling it could run any code, so nothing in it was loaded. If you trust whoever wrote it, "
            "pass --trust-checkpoint to load it anyway."
        )


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Checked before the module is even imported: importing can run code too.
        if (module, name) not in _DCP_METADATA_GLOBALS:
            raise UntrustedCheckpoint(f"its .metadata refers to {module}.{name}, which DCP metadata never does")
        return super().find_class(module, name)


def read_dcp_metadata(folder: Path) -> Metadata:
    """The ``.metadata`` of a DCP checkpoint, read without running code; anything else raises UntrustedCheckpoint."""
    with (folder / ".metadata").open("rb") as file:
        metadata = _MetadataUnpickler(file).load()
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise UntrustedCheckpoint(f"its .metadata holds a {type(metadata).__name__}, not DCP metadata")
    for entry in metadata.storage_data.values():
        # DCP names the shard files it writes; a path elsewhere would read files outside the folder.
        name = getattr(entry, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
            raise UntrustedCheckpoint(f"its .metadata points at {name!r}, not at a file in the checkpoint")
    return metadata


class _MetadataReader(FileSystemReader):
    """DCP's file reader, but it hands DCP the metadata that the allow-list has already read."""

    def __init__(self, folder: Path, metadata: Metadata) -> None:
        super().__init__(folder)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _CurrentFormatLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, without its guess that a checkpoint is in torch 2.3's format.

    When the checkpoint holds a key this rank's state dict lacks, DCP re-keys the rank's state in torch 2.3's
    format, which the checkpoint does not hold either. FSDP1 leaves out each parameter a rank holds no element
    of (a small LoRA unit at 3 ranks), so a run could not resume its own checkpoint: "Missing key in checkpoint
    state_dict: optimizer.param_groups". Checkpoints read here are this torch's, so the keys still must match.
    """

    def create_local_plan(self) -> LoadPlan:
        return create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)


class _WeightsOnlyLoadPlanner(_CurrentFormatLoadPlanner):
    """DCP's planner, but a non-tensor entry (a learning rate, betas), which DCP reads with ``weights_only=False``,
    must pass ``torch.load(weights_only=True)`` first: what that accepts is plain data, so DCP then builds only that."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise UntrustedCheckpoint(f"its entry {read_item.dest_index.fqn} refers to more than plain data") from None
        value.seek(0)
        super().load_bytes(read_item, value)


def sharded_reader(folder: Path, trust: bool) -> tuple[FileSystemReader, DefaultLoadPlanner]:
    """The storage reader and load planner for ``dcp.load`` of ``folder``: through the allow-list
    (UntrustedCheckpoint) unless ``trust``, when both are DCP's own, which unpickle whatever it holds."""
    if trust:
        return FileSystemReader(folder), _CurrentFormatLoadPlanner()
    return _MetadataReader(folder, read_dcp_metadata(folder)), _WeightsOnlyLoadPlanner()


def root_failure(err: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException wrapper, else ``err`` itself."""
    if isinstance(err, dcp.CheckpointException) and err.failures:
        return next(iter(err.failures.values()))[0]
    return err


def read_agreed(path: Path, read: Callable[[], Any], run_dir: Path, ctx: DistContext, every_rank: bool) -> Any:
    """Run ``read`` of checkpoint ``path`` on every rank or on rank 0 only; if it fails anywhere (any exception: the
    checkpoint cannot be used), stop every rank with one message, not a traceback per rank, that names the previous
    complete checkpoint in ``run_dir``."""
    result, error, refusal = None, None, None
    if every_rank or ctx.is_main:
        try:
            result = read()
        # DCP's CheckpointException is a BaseException, so it is named here.
        except (Exception, dcp.CheckpointException) as err:  # noqa: BLE001 - reported below, with its file
            cause = root_failure(err)
            if isinstance(cause, UntrustedCheckpoint):
                refusal = cause.refusal(path)
            else:
                error = describe_failure(err)
    if not all_ranks_agree(error is None and refusal is None, ctx):
        if refusal is not None:  # the bytes are fine, so an earlier checkpoint is no answer
            raise FatalError(refusal)
        step = checkpoint_step(path)
        earlier = [p for p in complete_checkpoints(run_dir) if step is None or checkpoint_step(p) < step]  # type: ignore[operator]
        advice = (
            f"The previous complete checkpoint is {earlier[-1]}: resume from it with --resume-from {earlier[-1]}"
            if earlier
            else "There is no earlier checkpoint in this run directory"
        )
        error = error or "it failed to load on another rank"
        raise FatalError(f"checkpoint {path} cannot be loaded ({error}). Nothing was deleted. {advice}.")
    return result


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` of one of the run's own files (a checkpoint, model.pt), whole or not at all (common.outputs)."""
    save_torch(obj, path, overwrite=True)


def write_failure(write: Callable[[], None]) -> str | None:
    """Run ``write``; None if it worked, else one line on why it did not (a full disk, a lost mount): the operating
    system's reason where there is one, which torch wraps in a RuntimeError of its own."""
    try:
        write()
    # DCP's CheckpointException is a BaseException, so it is named here.
    except (Exception, dcp.CheckpointException) as err:  # noqa: BLE001 - the caller reports it, once
        seen: BaseException | None = root_failure(err)
        while seen is not None:
            if isinstance(seen, OSError) and seen.strerror:
                return f"{seen.strerror} (errno {seen.errno})"
            seen = seen.__cause__ or seen.__context__
        return describe_failure(err)
    return None


def save_model_file(state: dict[str, torch.Tensor] | None, path: Path, ctx: DistContext) -> None:
    """Rank 0 writes the full state dict ``state`` to ``path``, atomically; other ranks' ``state`` is not read."""
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
    """Rank 0 runs ``write`` (of ``path``) if ``state`` is finite; else, or if it fails, every rank stops together
    with one message: the job does not hang on the ranks that could go on."""
    problem = None
    if ctx.is_main:
        assert state is not None, "rank 0 writes the model; give it the full state dict"
        broken = [name for name, tensor in state.items() if tensor.is_floating_point() and not tensor.isfinite().all()]
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


def then_resume(failure: str | None) -> str:
    """What to do after a failed write: free space where the disk or quota was full (as write_failure names them),
    else put right what the reason names."""
    if failure is not None and failure.endswith((f"(errno {errno.ENOSPC})", f"(errno {errno.EDQUOT})")):
        return "Free some space, then continue with --resume"
    return "Put right what the reason names (a folder moved, deleted or replaced), then continue with --resume"


def what_is_kept(run_dir: Path) -> str:
    """What a user can still resume from after a failed write, for its message."""
    kept = complete_checkpoints(run_dir)
    newest = f"the newest complete checkpoint, {kept[-1]}, is intact" if kept else "this run has saved no checkpoint"
    return f"Nothing saved before was touched: {newest}"
