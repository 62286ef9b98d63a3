"""Checkpoints that a killed job never leaves half-written, and exact resume from them.

A checkpoint is taken between two optimizer steps, where model, optimizer,
LR schedule, data position and random state describe the run completely.
Two formats, both under ``RUN_DIR/checkpoints/``:

- full, ``step-N.pt``: one file that rank 0 writes (DDP, or FSDP gathering the
  whole model and optimizer onto rank 0 first);
- sharded, ``step-N/``: a torch.distributed.checkpoint (DCP) folder in which
  every rank writes its own shard, so no rank ever holds the whole model; DCP
  reshards on load, so it resumes at another world size.

Either kind is written under a temporary name and renamed once complete, so
anything named ``step-N`` is whole: a kill mid-save leaves only a temporary
that the next save deletes.

Loading never runs code from the checkpoint: full checkpoints and ``trainer.pt``
go through ``torch.load(weights_only=True)``, and a sharded checkpoint's
``.metadata``, which DCP itself would read with a plain ``pickle.load``, goes
through an unpickler that builds DCP's own metadata records and nothing else
(``--trust-checkpoint`` lifts that for checkpoints from someone the user trusts).
"""

from __future__ import annotations

import argparse
import errno
import pickle
import random
import shutil
import warnings
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from common.compat import full_state_dict_options
from common.distributed import (
    DistContext,
    FatalError,
    all_ranks_agree,
    local_part,
    local_state_bytes,
    max_over_ranks,
    print0,
    shard_group_size,
)
from common.outputs import TEMPORARY_PREFIX, nearest_existing, rename_into_place, save_torch
from common.run_dir import CHECKPOINTS, checkpoint_step, complete_checkpoints

TRAINER_FILE = "trainer.pt"  # inside a sharded checkpoint: everything that is not a tensor shard
FORMAT_VERSION = 1


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` through ``common.outputs``: a temporary beside it, renamed into place.

    The rename is atomic on POSIX file systems: readers see the old file or the
    complete new one, never a truncated mix, even if the job dies mid-save. The
    files saved here are the run's own (its checkpoints, its model.pt), so an
    earlier one is replaced.
    """
    save_torch(obj, path, overwrite=True)


def load_file(path: Path) -> Any:
    """``torch.load(weights_only=True)`` onto the CPU; a file cut short (a copy or a save that did not finish)
    is an EOFError, which describe_failure calls truncated: torch itself says "[Errno 22] Invalid argument"."""
    with path.open("rb") as file:
        zipped = file.read(4) == b"PK\x03\x04"  # torch.save's format: a zip archive, its directory at the end
    if zipped and not zipfile.is_zipfile(path):
        raise EOFError(f"{path} ends before its zip archive's directory")
    return torch.load(path, map_location="cpu", weights_only=True)


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
            failure = write_failure(lambda: save_atomic(state, path))
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


def capture_rng() -> dict[str, Any]:
    """The random state that training draws from: dropout, and anything else in Python or torch.

    Every rank seeds the same way and draws the same amount, so rank 0's state
    stands for all of them. The data order needs none of this: the sampler
    derives it from the seed and the epoch.
    """
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass
class Resumed:
    step: int
    path: Path | None  # None: a fresh start
    changed: dict[str, list[Any]] = field(default_factory=dict)  # flag: [the checkpoint's value, this run's]


# Flags that only say where the run writes or computes, what it reports, how it saves, or where it starts
# from: none of them changes what is trained, so a resume may change them without a word. Every other flag
# of a script, one added later included, is a training setting: recorded in each checkpoint, compared on
# resume, and each change named.
NOT_TRAINING_SETTINGS = frozenset(
    {
        *("--run-dir", "--data-dir", "--device", "--dist-timeout"),  # where, and how long a collective waits
        *("--log-interval", "--profile"),  # what is reported; neither touches the weights or the data order
        *("--eval-interval", "--eval-batch-size", "--test-batch-size"),  # evaluation never updates a weight
        *("--checkpoint-interval", "--keep-checkpoints", "--checkpoint-format", "--trust-checkpoint"),  # saving
        *("--resume", "--resume-from", "--init-from"),  # where the run starts; a resume starts from a checkpoint
    }
)


def training_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """Every flag of ``parser`` but NOT_TRAINING_SETTINGS, by its long name, with the value ``args`` holds.

    Taken from the parser, not from a list, so that a flag a script gains later is recorded from the day
    it is added. Call it on what the user gave (right after parsing), before checks fill in derived values
    (a per-rank batch, a preset's width) that would differ at another world size without being asked for.
    """
    settings = {}
    for action in parser._actions:
        if action.option_strings and hasattr(args, action.dest):
            flag = max(action.option_strings, key=len)
            if flag not in NOT_TRAINING_SETTINGS:
                settings[flag] = plain_setting(getattr(args, action.dest))
    return settings


def plain_setting(value: Any) -> Any:
    """``value`` as data that a checkpoint (weights_only) and metrics.jsonl (JSON) both hold."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [plain_setting(item) for item in value]
    return str(value)  # a Path, or anything else a flag's type makes


NOT_RECORDED = "(not recorded)"  # a flag that the script which wrote the checkpoint did not have yet


def changed_settings(recorded: dict[str, Any], current: dict[str, Any]) -> dict[str, list[Any]]:
    """``flag: [recorded, current]`` for each training setting that differs."""
    return {
        flag: [recorded.get(flag, NOT_RECORDED), value]
        for flag, value in current.items()
        if recorded.get(flag, NOT_RECORDED) != value
    }


def describe_changes(changed: dict[str, list[Any]]) -> str:
    """``--flag old -> new``, each; a flag left to its default (--global-batch-size, --n-layer) reads "unset"."""
    return ", ".join(f"{flag} {shown(old)} -> {shown(new)}" for flag, (old, new) in changed.items())


def shown(value: Any) -> str:
    return "unset" if value is None else str(value)


# Entries of a scheduler's state that count where it is, not how it was set up.
SCHEDULER_COUNTERS = {"last_epoch", "_step_count", "_last_lr", "base_lrs", "_get_lr_called_within_step", "_is_initial"}
# The flag behind each setting, as the scripts name them.
SETTING_FLAGS = {"initial_lr": "--lr", "weight_decay": "--weight-decay", "gamma": "--gamma"}


@dataclass
class Settings:
    """The hyperparameters a run was started with: each optimizer group's (its peak lr as ``initial_lr``,
    which the scheduler sets) and the schedulers' own (StepLR's ``gamma``).

    A checkpoint holds the values it trained with. A resume that asks for others (a lower ``--lr``
    after a NaN) gets what it asks for from the checkpoint's step on, and is told so: silently
    training on with the old values would ignore the flags.
    """

    groups: list[dict[str, Any]]
    schedulers: dict[str, dict[str, Any]]

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> Settings:
        groups = [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in optimizer.param_groups]
        schedulers = {
            name: {
                k: v for k, v in obj.state_dict().items() if isinstance(v, (int, float)) and k not in SCHEDULER_COUNTERS
            }
            for name, obj in extra.items()
            if isinstance(obj, torch.optim.lr_scheduler.LRScheduler)
        }
        return cls(groups, schedulers)

    def apply(self, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> dict[str, list[Any]]:
        """Put these settings back after a checkpoint's were loaded; ``flag: [old, new]`` for each change."""
        changed: dict[str, list[Any]] = {}
        for wanted, group in zip(self.groups, optimizer.param_groups, strict=True):
            for key, value in wanted.items():
                if key in group and plain(group[key]) == plain(value):
                    group[key] = value  # Adam's betas come back from a checkpoint as a list
                elif key in group:
                    if key == "initial_lr":  # the same point of the schedule, from the new peak
                        group["lr"] *= value / group["initial_lr"]
                    changed[SETTING_FLAGS.get(key, key)] = [group[key], value]
                    group[key] = value
        for name, wanted in self.schedulers.items():
            scheduler = extra[name]
            for key, value in wanted.items():
                if getattr(scheduler, key) != value:
                    changed[SETTING_FLAGS.get(key, key)] = [getattr(scheduler, key), value]
                    setattr(scheduler, key, value)
            scheduler.base_lrs = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
            scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports
        return changed


def plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


class Checkpointer:
    """Saves and restores one run's training state; every rank calls every method together.

    ``identity`` says what the checkpoint belongs to (the script and the model's
    shape); a checkpoint written for anything else is refused, not half-loaded.
    ``settings`` are the run's training settings (``training_settings``): each
    checkpoint records them, and a resume names every one that differs.
    ``extra`` holds the objects with a ``state_dict`` beside model and optimizer
    (LR scheduler, gradient scaler). ``trust`` loads a sharded checkpoint whose
    metadata holds more than DCP's own records (--trust-checkpoint).
    ``check_before_save(step)`` runs before every save and raises if the state
    must not be saved (a non-finite loss: FiniteLossCheck.check).
    """

    def __init__(
        self,
        ctx: DistContext,
        run_dir: Path,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        extra: dict[str, Any],
        identity: dict[str, Any],
        settings: dict[str, Any],
        global_batch_size: int,
        sharded: bool,
        interval: int,
        keep: int,
        trust: bool = False,
        check_before_save: Callable[[int], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.folder = run_dir / CHECKPOINTS
        self.model = model
        self.optimizer = optimizer
        self.extra = extra
        self.identity = identity
        self.settings = settings
        self.global_batch_size = global_batch_size
        self.sharded = sharded
        self.interval = interval
        self.keep = keep
        self.trust = trust
        self.check_before_save = check_before_save
        self.last_saved: Path | None = None
        self._check_room()

    def _check_room(self) -> None:
        """Refuse to start when the disk cannot hold what the run must write: the checkpoints it keeps
        (one more while the newest is written) and model.pt. Found now, not after hours of training.

        Adam and Adadelta keep two tensors per parameter, so a checkpoint is about three times model.pt.
        Space that others fill during the run is not foreseen; that failure still gets one message.
        """
        (largest_shard,) = max_over_ranks([float(local_state_bytes(self.model, self.optimizer)["params"])], self.ctx)
        model_bytes = int(largest_shard) * shard_group_size(self.model)
        held = len(complete_checkpoints(self.folder.parent))
        # Without an interval a stop request still writes one checkpoint.
        to_write = max(1, self.keep + 1 - held) if self.interval > 0 else 1
        needed = model_bytes + to_write * 3 * model_bytes
        free = shutil.disk_usage(nearest_existing(self.folder)).free
        if not all_ranks_agree(free >= needed or not self.ctx.is_main, self.ctx):
            mib = 2**20
            raise FatalError(
                f"--run-dir {self.folder.parent} has {free / mib:.1f} MiB free; this run needs about "
                f"{needed / mib:.1f} MiB ({to_write} checkpoint(s) of {3 * model_bytes / mib:.1f} MiB and model.pt "
                f"of {model_bytes / mib:.1f} MiB). Free some space, choose another --run-dir, or keep fewer "
                "checkpoints (--keep-checkpoints)"
            )

    def due(self, step: int) -> bool:
        """Whether --checkpoint-interval asks for a checkpoint after ``step`` steps (and none exists yet)."""
        return self.interval > 0 and step > 0 and step % self.interval == 0 and not self._saved(step)

    def _saved(self, step: int) -> bool:
        return self.last_saved is not None and checkpoint_step(self.last_saved) == step and self.last_saved.exists()

    # -- saving ---------------------------------------------------------------

    def save(self, step: int) -> Path:
        """Write a checkpoint of the state after ``step`` optimizer steps, then prune old ones."""
        if self.check_before_save is not None:
            self.check_before_save(step)
        if self._saved(step):  # e.g. asked to stop right after resuming: that checkpoint is this state
            return self.last_saved  # type: ignore[return-value]
        self._check_weights_finite(step)
        with quiet_internal_warnings():
            path = self._save(step)
        self.last_saved = path
        if self.ctx.is_main:
            self._prune(keep_newest=path)
        dist.barrier()  # nobody runs ahead and reads a folder that rank 0 is still pruning
        print0(f"checkpoint: {path}")
        return path

    def _check_weights_finite(self, step: int) -> None:
        """A finite loss does not make the update after it finite: check the weights themselves."""
        local = [local_part(p) for p in self.model.parameters()]
        finite = bool(torch.stack([torch.isfinite(p).all() for p in local]).all()) if local else True
        if not all_ranks_agree(finite, self.ctx):
            raise FatalError(
                f"the weights after step {step} are not finite: the last update overflowed, though the loss "
                "before it was finite. No checkpoint was written for that step. Lower --lr, or resume from an "
                "earlier checkpoint with --resume-from",
                exit_code=1,
            )

    def _written_everywhere(self, path: Path, failure: str | None, temporary: Path | None = None) -> None:
        """Stop every rank together if any rank could not write its part of ``path`` (in ``temporary``)."""
        if not all_ranks_agree(failure is None, self.ctx):
            if temporary is not None and self.ctx.is_main:
                shutil.rmtree(temporary, ignore_errors=True)
            raise FatalError(
                f"could not write checkpoint {path}: {failure or 'it failed on another rank'}. "
                f"{what_is_kept(self.folder.parent)}. {then_resume(failure)}",
                exit_code=1,
            )

    def _save(self, step: int) -> Path:
        trainer = {
            "format_version": FORMAT_VERSION,
            "identity": self.identity,
            "settings": self.settings,
            "step": step,
            "world_size": self.ctx.world_size,
            "global_batch_size": self.global_batch_size,
            "extra": {name: obj.state_dict() for name, obj in self.extra.items()},
            "rng": capture_rng(),
        }
        return self._save_sharded(step, trainer) if self.sharded else self._save_full(step, trainer)

    def _save_full(self, step: int, trainer: dict[str, Any]) -> Path:
        # DISTRIBUTED: for FSDP every rank takes part in gathering the full state
        # onto rank 0 (the others get empty dicts); for DDP it is a local copy.
        options = full_state_dict_options(self.ctx.device)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=options)
        path = self.folder / f"step-{step}.pt"
        failure = None
        if self.ctx.is_main:
            checkpoint = {"model": model_state, "optimizer": optimizer_state, "trainer": trainer}
            failure = write_failure(lambda: save_atomic(checkpoint, path))
        self._written_everywhere(path, failure)
        return path

    def _save_sharded(self, step: int, trainer: dict[str, Any]) -> Path:
        path = self.folder / f"step-{step}"
        temporary = self.folder / f"{TEMPORARY_PREFIX}step-{step}"
        failure = None
        if self.ctx.is_main:
            shutil.rmtree(temporary, ignore_errors=True)  # left behind by a save that was killed
            failure = write_failure(lambda: temporary.mkdir(parents=True))
        self._written_everywhere(path, failure)
        # DISTRIBUTED: each rank writes only its own shards; DCP writes the
        # metadata (which rank holds which slice) last, from rank 0. A rank that
        # fails to write makes dcp.save fail on every rank.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        failure = write_failure(lambda: dcp.save(state, checkpoint_id=temporary))
        if self.ctx.is_main and failure is None:
            failure = write_failure(lambda: save_atomic(trainer, temporary / TRAINER_FILE))
        # Agreed before the rename: every shard is on disk before the folder gets its final name.
        self._written_everywhere(path, failure, temporary)
        if self.ctx.is_main:
            if path.exists():  # from an abandoned run that went further; this one replaces it
                shutil.rmtree(path)
            rename_into_place(temporary, path)
        return path

    def _prune(self, keep_newest: Path) -> None:
        """Keep the newest ``keep`` checkpoints up to this one; delete leftovers of killed saves."""
        step = checkpoint_step(keep_newest)
        older = [path for path in complete_checkpoints(self.folder.parent) if checkpoint_step(path) < step]  # type: ignore[operator]
        doomed = older[: max(0, len(older) - (self.keep - 1))]
        doomed += [path for path in self.folder.iterdir() if path.name.startswith(TEMPORARY_PREFIX)]
        for path in doomed:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()

    # -- loading --------------------------------------------------------------

    def resume(self, resume: bool, resume_from: Path | None) -> Resumed:
        """Load the checkpoint asked for; a fresh start when ``--resume`` finds none.

        A checkpoint that exists but cannot be loaded stops the run with a
        message: silently starting over would throw away the work it holds.
        """
        if resume_from is not None:
            path = resume_from
        elif resume:
            found = complete_checkpoints(self.folder.parent)
            if not found:
                print0(f"--resume: no checkpoint in {self.folder}, starting from step 0")
                return Resumed(0, None)
            path = found[-1]
        else:
            return Resumed(0, None)

        settings = Settings.of(self.optimizer, self.extra)  # what this run's flags asked for
        with quiet_internal_warnings():
            trainer = self._load(path)
        for name, obj in self.extra.items():
            obj.load_state_dict(trainer["extra"][name])
        applied = settings.apply(self.optimizer, self.extra)
        recorded = trainer.get("settings")
        changed = changed_settings(recorded, self.settings) if isinstance(recorded, dict) else applied
        restore_rng(trainer["rng"])
        if path.parent == self.folder:
            self.last_saved = path
        print0(
            f"resumed from {path} at step {trainer['step']} "
            f"(saved by {trainer['world_size']} process(es), now {self.ctx.world_size})"
        )
        if not isinstance(recorded, dict):
            print0(
                f"{path} records no flags (it was written before checkpoints did): of the settings, only the "
                "optimizer's and the LR scheduler's are compared"
            )
        if changed:
            print0(f"from step {trainer['step']} on, as the flags ask: {describe_changes(changed)}")
        self._set_aside_newer_than(path)
        if trainer["global_batch_size"] != self.global_batch_size:
            # The position in the epoch is kept in steps: at another global batch
            # size the rest of this epoch skips or repeats a few examples.
            print0(
                f"warning: the global batch was {trainer['global_batch_size']} sequences or images, now "
                f"{self.global_batch_size}; keep it (--global-batch-size) to continue exactly"
            )
        return Resumed(trainer["step"], path, changed)

    def _set_aside_newer_than(self, resumed: Path) -> None:
        """Resuming from an older checkpoint of this run starts another branch; the newer checkpoints
        belong to the one left behind. They move to RUN_DIR/abandoned/, never deleted, so that neither
        a later --resume nor pruning takes them for this branch's."""
        if resumed.resolve().parent != self.folder.resolve():
            return
        step = checkpoint_step(resumed)
        newer = [path for path in complete_checkpoints(self.folder.parent) if checkpoint_step(path) > step]  # type: ignore[operator]
        if newer and self.ctx.is_main:
            aside = self.folder.parent / "abandoned" / f"after-step-{step}"
            tries = 1
            while aside.exists():
                tries += 1
                aside = aside.with_name(f"after-step-{step}-{tries}")
            aside.mkdir(parents=True)
            for path in newer:
                rename_into_place(path, aside / path.name)
            print0(
                f"{', '.join(path.name for path in newer)} went further than {resumed.name}: moved to {aside} "
                "(kept; --resume-from there goes back to that run)"
            )
        dist.barrier()  # no rank looks for checkpoints before they have moved

    def _load(self, path: Path) -> dict[str, Any]:
        """Load ``path`` into model, optimizer and ``extra``; every rank fails together, with one message."""
        if path.is_dir():
            trainer = self._agree(path, lambda: load_file(path / TRAINER_FILE), every_rank=True)
        else:
            # DISTRIBUTED: only rank 0 reads the file; the set_*_state_dict calls below
            # broadcasts the tensors and every rank keeps what it needs.
            checkpoint = self._agree(path, lambda: load_file(path), every_rank=False)
            trainer = broadcast_object(checkpoint["trainer"] if self.ctx.is_main else None)
        # Tensors of another shape fail with an unhelpful message; say what differs first.
        mismatch = self._identity_mismatch(trainer)
        if mismatch:
            raise FatalError(f"checkpoint {path} was not written by this script and model: {mismatch}")

        if path.is_dir():
            # DISTRIBUTED: DCP fills this rank's shards in place, reading whichever
            # slices of the saved shards overlap them (so the world size may change).
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
            self._agree(path, lambda: self._load_sharded(path, state), every_rank=True)
            set_state_dict(self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
        else:
            # Two calls, not set_state_dict: given an empty model dict (as the
            # ranks other than 0 are), it would skip the model on those ranks
            # and leave rank 0 waiting in the broadcast.
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(self.model, checkpoint["model"] if self.ctx.is_main else {}, options=options)
            set_optimizer_state_dict(
                self.model, self.optimizer, checkpoint["optimizer"] if self.ctx.is_main else {}, options=options
            )
        return trainer

    def _load_sharded(self, path: Path, state: dict[str, Any]) -> None:
        reader, planner = sharded_reader(path, self.trust)
        dcp.load(state, storage_reader=reader, planner=planner)

    def _agree(self, path: Path, read: Callable[[], Any], every_rank: bool) -> Any:
        """Run ``read`` on every rank or on rank 0 only; if it fails anywhere, stop every rank.

        Any exception counts: whatever is wrong with the bytes, the checkpoint
        cannot be used, and the message says so instead of a traceback per rank.
        """
        result, error, refusal = None, None, None
        if every_rank or self.ctx.is_main:
            try:
                result = read()
            # DCP's CheckpointException is a BaseException, so it is named here.
            except (Exception, dcp.CheckpointException) as err:  # noqa: BLE001 - reported below, with its file
                cause = root_failure(err)
                if isinstance(cause, UntrustedCheckpoint):
                    refusal = cause.refusal(path)
                else:
                    error = describe_failure(err)
        if not all_ranks_agree(error is None and refusal is None, self.ctx):
            if refusal is not None:  # the bytes are fine, so an earlier checkpoint is no answer
                raise FatalError(refusal)
            raise FatalError(self._unloadable_message(path, error or "it failed to load on another rank"))
        return result

    def _identity_mismatch(self, trainer: dict[str, Any]) -> str | None:
        theirs = trainer.get("identity", {})
        differences = [
            f"{key} is {theirs.get(key)!r} there, {value!r} here"
            for key, value in self.identity.items()
            if theirs.get(key) != value
        ]
        return "; ".join(differences) or None

    def _unloadable_message(self, path: Path, error: str) -> str:
        step = checkpoint_step(path)
        earlier = [p for p in complete_checkpoints(self.folder.parent) if step is None or checkpoint_step(p) < step]  # type: ignore[operator]
        advice = (
            f"The previous complete checkpoint is {earlier[-1]}: resume from it with --resume-from {earlier[-1]}"
            if earlier
            else "There is no earlier checkpoint in this run directory"
        )
        return f"checkpoint {path} cannot be loaded ({error}). Nothing was deleted. {advice}."


# -- starting from weights: --init-from -------------------------------------------------------------


def start_from_weights(model: torch.nn.Module, path: Path, ctx: DistContext) -> None:
    """--init-from: the weights of a plain state dict (a run's model.pt, common.export_checkpoint's
    output, any state dict of this model) in the wrapped ``model``, for a new run from step 0.

    DISTRIBUTED: only rank 0 reads the file. set_model_state_dict broadcasts it one tensor at a time
    and each rank keeps its own part, so no rank holds more than one whole copy, and a GPU holds at
    most one whole tensor. Keys or shapes that differ stop every rank with one message (exit 2).
    """
    # This rank's part of each tensor, under the names a plain model has; size() is the whole tensor's.
    with quiet_internal_warnings():  # FSDP1's sharded state dict still goes through ShardedTensor
        expected = {name: tuple(tensor.size()) for name, tensor in get_model_state_dict(model).items()}
    state: dict[str, torch.Tensor] = {}
    problem = None
    if ctx.is_main:
        try:
            state = load_file(path)
        except Exception as err:  # noqa: BLE001 - any failure to read it is one message, below
            problem = f"cannot be loaded ({describe_failure(err)})"
        else:
            problem = weights_mismatch(state, expected)
    problem = broadcast_object(problem)
    if problem is not None:
        raise FatalError(f"--init-from {path} {problem}")
    with quiet_internal_warnings():
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    print0(f"weights from {path} ({len(expected)} tensors); a new run: step 0, a fresh optimizer")


def weights_mismatch(state: Any, expected: dict[str, tuple[int, ...]]) -> str | None:
    """Why ``state`` does not fit a model whose state dict has ``expected``'s names and shapes; None if it fits."""
    if not isinstance(state, dict) or not all(isinstance(value, torch.Tensor) for value in state.values()):
        return (
            "is not a state dict (tensors by name). A checkpoint of a run resumes with --resume-from; "
            "python -m common.export_checkpoint turns one into a state dict"
        )
    missing = [name for name in expected if name not in state]
    unexpected = [name for name in state if name not in expected]
    reshaped = [
        f"{name} is {list(state[name].shape)} there, {list(shape)} here"
        for name, shape in expected.items()
        if name in state and tuple(state[name].shape) != shape
    ]
    parts = [
        f"{what}: {first_few(names)}"
        for what, names in (("missing", missing), ("not in this model", unexpected), ("other shapes", reshaped))
        if names
    ]
    return f"does not fit this model ({'; '.join(parts)})" if parts else None


def first_few(items: list[str], shown: int = 3) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


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


# -- sharded checkpoints that someone else wrote -------------------------------------------------

# DCP writes `.metadata` with pickle, and its FileSystemReader reads it back with
# a plain pickle.load (checked in torch 2.6.0 and 2.14.1), so a crafted file runs any
# code it names. torch's own restricted unpickler (weights_only) cannot parse it
# either: it rejects pickle protocol 4's FRAME opcode, which pickle.dump writes.
# These are all the globals DCP's metadata refers to; each only stores or looks
# up data when called, so an unpickler that allows nothing else runs no code.
_DCP_METADATA_GLOBALS = frozenset(
    {
        *(
            ("torch.distributed.checkpoint.metadata", name)
            for name in (
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # how torch pickles a torch.layout
        # StorageMeta.checkpoint_id: the path the saver was given. Python 3.13 pickles it from pathlib._local.
        ("pathlib", "PosixPath"),
        ("pathlib._local", "PosixPath"),
        *(
            ("torch", name)
            for name, value in vars(torch).items()
            if isinstance(value, torch.dtype | torch.layout | torch.memory_format)
        ),
    }
)


class UntrustedCheckpoint(Exception):
    """A sharded checkpoint that holds more than DCP writes, refused before any of it was unpickled."""

    def refusal(self, path: Path) -> str:
        """The whole message for the user: what was refused, why it matters, what to do."""
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


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but a non-tensor entry must pass ``torch.load(weights_only=True)`` first.

    DCP reads such entries (the optimizer's learning rate, betas, ...) with
    ``weights_only=False``; what the restricted unpickler accepts is plain data,
    so reading the same bytes again without it builds only that data.
    """

    def load_bytes(self, read_item: Any, value: Any) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise UntrustedCheckpoint(f"its entry {read_item.dest_index.fqn} refers to more than plain data") from None
        value.seek(0)
        super().load_bytes(read_item, value)


def sharded_reader(folder: Path, trust: bool) -> tuple[FileSystemReader, DefaultLoadPlanner]:
    """The storage reader and load planner for ``dcp.load`` of ``folder``.

    Untrusted (the default), its metadata has been read through the allow-list
    (UntrustedCheckpoint if it holds anything else) and the planner reads
    non-tensor entries with weights_only. Trusted, both are DCP's own, which
    unpickle whatever the checkpoint holds.
    """
    if trust:
        return FileSystemReader(folder), DefaultLoadPlanner()
    return _MetadataReader(folder, read_dcp_metadata(folder)), _WeightsOnlyLoadPlanner()


def root_failure(err: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException wrapper, else ``err`` itself."""
    if isinstance(err, dcp.CheckpointException) and err.failures:
        return next(iter(err.failures.values()))[0]
    return err


@contextmanager
def quiet_internal_warnings() -> Iterator[None]:
    """Silence warnings about torch's own internals that a user cannot act on.

    FSDP1's sharded state dict still goes through ShardedTensor, which warns
    about its deprecated helpers on every save and load (torch 2.14).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*_get_pg_default_device.*will be deprecated")
        warnings.filterwarnings("ignore", message="Multiple backends are registered with this ProcessGroup")
        yield


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
