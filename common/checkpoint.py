"""Checkpoints that a killed job never leaves half-written, and exact resume from them (docs/checkpoints.md).

Full, ``RUN_DIR/checkpoints/step-N.pt``: one file rank 0 writes. Sharded, ``step-N/``: a DCP folder where each
rank writes its own shard, resharded on load (another world size resumes). Each is written under a temporary name
and renamed once whole. Reading one runs none of its code (common.safe_io). Below the Checkpointer: whether a
checkpoint fits this run, and what a resume changes (the flags common.flag_checks records, the optimizer's settings).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.utils._pytree import tree_map, tree_map_only

import common.safe_io as safe_io
from common.async_checkpoint import BackgroundSave
from common.distributed import (
    DistContext,
    FatalError,
    all_ranks_agree,
    broadcast_object,
    local_part,
    local_state_bytes,
    max_over_ranks,
    print0,
    quiet_internal_warnings,
    shard_group_size,
)
from common.fine_tuning import adapter_identity, adapters_difference, trained_difference, trained_parameters
from common.flag_checks import NOT_RECORDED, fields_that_differ, plain_setting
from common.models import tied_parameters
from common.outputs import TEMPORARY_PREFIX, nearest_existing, replace_folder
from common.run_dir import (
    CHECKPOINTS,
    MODEL_FILE,
    checkpoint_step,
    checkpoint_to_resume,
    complete_checkpoints,
    prune_checkpoints,
    set_aside_newer_than,
)
from common.training import capture_rng, restore_rng

TRAINER_FILE = "trainer.pt"  # inside a sharded checkpoint: everything that is not a tensor shard
FORMAT_VERSION = 1


def full_state_dict_options(device: torch.device) -> StateDictOptions:
    """Options that gather the whole model (and optimizer) state, as plain tensors, for rank 0 to save. On a GPU only
    rank 0 keeps them, on the CPU (``cpu_offload=True``); a CPU run gathers on every rank and the others drop it."""
    # Offloading on a CPU run is not only pointless: FSDP1's offload paths take the move to the CPU for a copy.
    # - torch < 2.14: FlatParamHandle.to_cpu() frees the gathered parameters after "moving" them, so the model state
    #   dict reads freed memory and rank 0 dies with a segmentation fault (pytorch/pytorch#188989, fixed in 2.14 by
    #   #188990).
    # - every release from 2.6 to 2.14.1: the gathered optimizer state is copied out of a reused buffer only by
    #   `.cpu()`, so every exp_avg comes back as a view that the next state, exp_avg_sq, overwrites: the checkpoint
    #   holds exp_avg_sq twice and a resumed run silently trains differently.
    return StateDictOptions(full_state_dict=True, cpu_offload=device.type != "cpu")


@dataclass
class Resumed:
    step: int
    path: Path | None  # None: a fresh start
    changed: dict[str, list[Any]] = field(default_factory=dict)  # flag: [the checkpoint's value, this run's]
    world_size: int | None = None  # the processes that saved the checkpoint


@dataclass
class Checkpointer:
    """Saves and restores one run's training state; every rank calls every method together.

    ``identity``: what the checkpoint belongs to (script, model shape); one of anything else is refused, not
    half-loaded. ``settings`` (``training_settings``): recorded in each checkpoint; a resume names each that differs.
    ``extra``: the objects with a ``state_dict`` beside model and optimizer (LR scheduler, gradient scaler).
    ``trust`` (--trust-checkpoint): load a sharded checkpoint whose metadata holds more than DCP's own records.
    ``check_before_save(step)``, ``while_saving()``: Bookkeeping's check_loss (no NaN saved) and paused (no clock)."""

    ctx: DistContext
    run_dir: Path
    _: KW_ONLY
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    extra: dict[str, Any]
    identity: dict[str, Any]
    strategy: str
    settings: dict[str, Any]
    global_batch_size: int
    sharded: bool
    interval: int
    keep: int
    check_before_save: Callable[[int], None]
    trust: bool = False
    asynchronous: bool = False  # --async-checkpoint: sharded saves written while training goes on
    while_saving: Callable[[], AbstractContextManager[object]] = nullcontext
    # What DCP writes and reads in place of each tensor: the same numbers (a view), laid out as it can write.
    sharded_view: Callable[[torch.Tensor], torch.Tensor] = lambda tensor: tensor

    def __post_init__(self) -> None:
        self.folder = self.run_dir / CHECKPOINTS
        # None without adapters or tied weights, as before either was recorded.
        lora, tied, trained = adapter_identity(self.model), tied_parameters(self.model), trained_parameters(self.model)
        self.identity = {**self.identity, "lora": lora, "tied": tied or None, "trained": trained}
        self.last_saved: Path | None = None
        self.background = BackgroundSave(self.ctx.device) if self.asynchronous else None
        self._check_room()

    def _check_room(self) -> None:
        """Refuse to start, not after hours of training, when the disk cannot hold the checkpoints kept (one more
        while the newest is written) and model.pt. A checkpoint is about 3x model.pt (Adam keeps two tensors per
        parameter). Space that others fill during the run is not foreseen; that failure still gets one message."""
        (largest_shard,) = max_over_ranks([float(local_state_bytes(self.model, self.optimizer)["params"])], self.ctx)
        model_bytes = int(largest_shard) * shard_group_size(self.model)
        held = len(complete_checkpoints(self.run_dir))
        # Without an interval a stop request still writes one checkpoint.
        to_write = max(1, self.keep + 1 - held) if self.interval > 0 else 1
        needed = model_bytes + to_write * 3 * model_bytes
        free = shutil.disk_usage(nearest_existing(self.folder)).free
        if not all_ranks_agree(free >= needed or not self.ctx.is_main, self.ctx):
            mib = 2**20
            raise FatalError(
                f"--run-dir {self.run_dir} has {free / mib:.1f} MiB free; this run needs about "
                f"{needed / mib:.1f} MiB ({to_write} checkpoint(s) of {3 * model_bytes / mib:.1f} MiB and model.pt "
                f"of {model_bytes / mib:.1f} MiB). Free some space, choose another --run-dir, or keep fewer "
                "checkpoints (--keep-checkpoints)"
            )

    def save(self, step: int, force: bool = False) -> Path | None:
        """The state after ``step`` steps where --checkpoint-interval asks, or ``force`` (a stop request); else None.
        In the background (--async-checkpoint) once the one in flight is complete; a forced one is waited for."""
        if not force and not (self.interval > 0 and step > 0 and step % self.interval == 0):
            return None
        self.check_before_save(step)
        with self.while_saving():
            self.wait()
            if self.last_saved is not None and checkpoint_step(self.last_saved) == step and self.last_saved.exists():
                return self.last_saved  # saved already: a stop request right after a resume
            # A finite loss does not make the update after it finite: check the weights themselves.
            local = [local_part(p) for p in self.model.parameters()]
            finite = bool(torch.stack([torch.isfinite(p).all() for p in local]).all()) if local else True
            if not all_ranks_agree(finite, self.ctx):
                raise FatalError(
                    f"the weights after step {step} are not finite: the last update overflowed, though the loss "
                    "before it was finite. No checkpoint was written for that step. Lower --lr, or resume from an "
                    "earlier checkpoint with --resume-from",
                    exit_code=1,
                )
            trainer = {
                "format_version": FORMAT_VERSION,
                "identity": self.identity,
                "strategy": self.strategy,
                "settings": self.settings,
                "step": step,
                "world_size": self.ctx.world_size,
                "global_batch_size": self.global_batch_size,
                "extra": {name: obj.state_dict() for name, obj in self.extra.items()},
                "rng": capture_rng(),
            }
            with quiet_internal_warnings():
                path = self._save_sharded(step, trainer) if self.sharded else self._save_full(step, trainer)
            if self.background is None:
                self._saved(path)
            elif force:
                self.wait()
            return path

    def wait(self) -> None:
        """The checkpoint written in the background to its end: complete, or every rank stops with its failure."""
        if self.background is None or (path := self.background.path) is None:
            return
        failure = safe_io.write_failure(self.background.wait)
        self._written_everywhere(path, failure, self.folder / f"{TEMPORARY_PREFIX}{path.name}")
        self._saved(path)

    def _saved(self, path: Path) -> None:
        """``path`` is complete: the newest; older ones beyond --keep-checkpoints go (never one in flight)."""
        self.last_saved = path
        if self.ctx.is_main:
            prune_checkpoints(self.run_dir, newest=path, keep=self.keep)
        dist.barrier()  # nobody runs ahead and reads a folder that rank 0 is still pruning
        print0(f"checkpoint: {path}")

    def _written_everywhere(self, path: Path, failure: str | None, temporary: Path | None = None) -> None:
        """Stop every rank together if any rank could not write its part of ``path`` (in ``temporary``)."""
        if not all_ranks_agree(failure is None, self.ctx):
            if temporary is not None and self.ctx.is_main:
                shutil.rmtree(temporary, ignore_errors=True)
            raise FatalError(
                f"could not write checkpoint {path}: {failure or 'it failed on another rank'}. "
                f"{safe_io.what_is_kept(self.run_dir)}. {safe_io.then_resume(failure)}",
                exit_code=1,
            )

    def _save_full(self, step: int, trainer: dict[str, Any]) -> Path:
        # DISTRIBUTED: under FSDP every rank helps gather the full state onto rank 0 (the others get empty dicts).
        options = full_state_dict_options(self.ctx.device)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=options)
        path = self.folder / f"step-{step}.pt"
        failure = None
        if self.ctx.is_main:
            checkpoint = {"model": model_state, "optimizer": optimizer_state, "trainer": trainer}
            failure = safe_io.write_failure(lambda: safe_io.save_atomic(checkpoint, path))
        self._written_everywhere(path, failure)
        return path

    def _save_sharded(self, step: int, trainer: dict[str, Any]) -> Path:
        path = self.folder / f"step-{step}"
        temporary = self.folder / f"{TEMPORARY_PREFIX}{path.name}"
        failure = None
        if self.ctx.is_main:
            shutil.rmtree(temporary, ignore_errors=True)  # left behind by a save that was killed
            failure = safe_io.write_failure(lambda: temporary.mkdir(parents=True))
            # trainer.pt first: the shards may be written after this call returns (--async-checkpoint).
            failure = failure or safe_io.write_failure(lambda: safe_io.save_atomic(trainer, temporary / TRAINER_FILE))
        self._written_everywhere(path, failure, temporary)
        # DISTRIBUTED: each rank writes its own shards, rank 0 the metadata (who holds which slice) last;
        # a rank that fails to write makes dcp.save fail on every rank.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = tree_map_only(torch.Tensor, self.sharded_view, {"model": model_state, "optimizer": optimizer_state})
        if self.background is not None:  # rank 0 renames it once written; wait() reports how that went
            self.background.start(state, temporary, path, renames=self.ctx.is_main)
            return path
        failure = safe_io.write_failure(lambda: dcp.save(state, checkpoint_id=temporary))
        # Agreed before the rename: every shard is on disk before the folder gets its final name.
        self._written_everywhere(path, failure, temporary)
        if self.ctx.is_main:
            replace_folder(temporary, path)  # a step-N of an abandoned run that went further is replaced
        return path

    def resume(self, resume: bool, resume_from: Path | None, init_from: Path | None = None) -> Resumed:
        """Load the checkpoint asked for; without one, start fresh or from ``init_from`` (--init-from: a checkpoint
        of this run comes first). One that cannot be loaded stops the run: starting over would lose its work."""
        self.wait()  # a load never reads a checkpoint still being written (torchtitan#930)
        path = checkpoint_to_resume(self.run_dir, resume, resume_from)
        if path is None:
            if resume:
                print0(f"--resume: no checkpoint in {self.folder}, starting from step 0")
            if init_from is not None:
                safe_io.start_from_weights(self.model, init_from, self.ctx)
            return Resumed(0, None)
        settings = Settings.of(self.optimizer, self.extra)  # what this run's flags asked for
        with quiet_internal_warnings():
            trainer = self._load(path)
        for name, obj in self.extra.items():
            if name in trainer["extra"]:
                obj.load_state_dict(trainer["extra"][name])
            elif obj.state_dict():  # another strategy's script lacks it: FSDP1's fp16 scaler, resuming DDP's run
                print0(f"the checkpoint has no {name} (written under {trainer.get('strategy')}): it starts afresh")
        applied = settings.apply(self.optimizer, self.extra)
        recorded = trainer.get("settings")
        changed = changed_settings(recorded, self.settings) if isinstance(recorded, dict) else applied
        changed = with_strategy_change(trainer.get("strategy"), self.strategy, changed)
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
        # An older checkpoint of this run starts another branch: the newer ones are set aside, kept.
        ours = path.resolve().parent == self.folder.resolve()
        if ours and self.ctx.is_main and (moved := set_aside_newer_than(self.run_dir, path)):
            print0(moved)
        dist.barrier()  # no rank looks for checkpoints before they have moved
        if trainer["global_batch_size"] != self.global_batch_size:
            # The epoch's position is kept in steps: at another global batch size some examples are skipped or repeated.
            print0(
                f"warning: the global batch was {trainer['global_batch_size']} sequences or images, now "
                f"{self.global_batch_size}; keep it (--global-batch-size) to continue exactly"
            )
        return Resumed(trainer["step"], path, changed, trainer["world_size"])

    def save_model(self, state: dict[str, torch.Tensor] | None) -> None:
        """model.pt, for inference and --init-from (safe_io.save_model_file), once the last checkpoint is complete."""
        self.wait()
        safe_io.save_model_file(state, self.run_dir / MODEL_FILE, self.ctx)

    def _load(self, path: Path) -> dict[str, Any]:
        """Load ``path`` into model, optimizer and ``extra``; every rank fails together, with one message."""
        if path.is_dir():
            trainer = self._agree(path, lambda: safe_io.load_file(path / TRAINER_FILE), every_rank=True)
        else:
            # DISTRIBUTED: only rank 0 reads the file; set_*_state_dict below broadcasts what each rank keeps.
            checkpoint = self._agree(path, lambda: safe_io.load_file(path), every_rank=False)
            trainer = broadcast_object(checkpoint["trainer"] if self.ctx.is_main else None)
        # Tensors of another shape fail with an unhelpful message; say what differs first.
        mismatch = identity_mismatch(trainer.get("identity", {}), self.identity)
        if mismatch:
            raise FatalError(f"checkpoint {path} does not fit this run: {mismatch}")
        if path.is_dir():
            # DISTRIBUTED: DCP fills this rank's shards in place from the saved slices that overlap them.
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
            state = tree_map_only(torch.Tensor, self.sharded_view, {"model": model_state, "optimizer": optimizer_state})
            self._agree(path, lambda: self._load_sharded(path, state), every_rank=True)
            # DCP fills tensors in place (through the views, so model_state's own), but a value that is no
            # tensor it replaces in ``state``, the copy tree_map_only made: take those from there.
            model_state, optimizer_state = tree_map(
                lambda own, loaded: own if isinstance(own, torch.Tensor) else loaded,
                (model_state, optimizer_state),
                (state["model"], state["optimizer"]),
            )
            set_state_dict(self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
        else:
            # Two calls, not set_state_dict: given the empty model dict of ranks other than 0, it would skip
            # the model there and leave rank 0 waiting in the broadcast.
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(self.model, checkpoint["model"] if self.ctx.is_main else {}, options=options)
            set_optimizer_state_dict(
                self.model, self.optimizer, checkpoint["optimizer"] if self.ctx.is_main else {}, options=options
            )
        return trainer

    def _load_sharded(self, path: Path, state: dict[str, Any]) -> None:
        reader, planner = safe_io.sharded_reader(path, self.trust)
        dcp.load(state, storage_reader=reader, planner=planner)

    def _agree(self, path: Path, read: Callable[[], Any], every_rank: bool) -> Any:
        return safe_io.read_agreed(path, read, self.run_dir, self.ctx, every_rank)


EXPORT = "python -m tools.runs.export_checkpoint CHECKPOINT model.pt, then start a new run with --init-from model.pt"
WAYS_ON = {  # what to do where an identity differs, by (key, whether this run has None there)
    ("lora", True): "--lora-rank: the checkpoint has LoRA adapters ({theirs!r}), this run none (to go on without "
    "adapters, merge them: " + EXPORT + ")",
    ("qkv", True): "its q|k|v weights were saved split for tensor parallelism: resume it with "
    "fsdp/train_transformer_fsdp2_tp.py at a --tp-degree above 1 (2 processes or more), or export it: " + EXPORT,
    ("qkv", False): "its q|k|v weights were saved whole; a --tp-degree above 1 splits them: resume it with "
    "fsdp/train_transformer_fsdp2.py, or with fsdp/train_transformer_fsdp2_tp.py at --tp-degree 1 (any number of "
    "processes); this torch loads whole q|k|v weights into split ones from no checkpoint and no --init-from",
}


def changed_settings(recorded: dict[str, Any], current: dict[str, Any]) -> dict[str, list[Any]]:
    """``flag: [recorded, current]`` for each training setting that differs."""
    old = {flag: recorded.get(flag, NOT_RECORDED) for flag in current}
    return {flag: [old[flag], value] for flag, value in current.items() if old[flag] != value}


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
    """The hyperparameters a run was started with: each optimizer group's (its peak lr as ``initial_lr``, which the
    scheduler sets) and the schedulers' own (StepLR's ``gamma``). A resume that asks for others than its checkpoint's
    (a lower ``--lr`` after a NaN) gets them from the checkpoint's step on, and is told so."""

    groups: list[dict[str, Any]]
    schedulers: dict[str, dict[str, Any]]

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> Settings:
        groups = [{k: v for k, v in group.items() if k not in ("params", "lr")} for group in optimizer.param_groups]
        schedulers = {}
        for name, obj in extra.items():
            if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                state = obj.state_dict().items()
                schedulers[name] = {
                    k: v for k, v in state if isinstance(v, int | float) and k not in SCHEDULER_COUNTERS
                }
        return cls(groups, schedulers)

    def apply(self, optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> dict[str, list[Any]]:
        """Put these settings back after a checkpoint's were loaded; ``flag: [old, new]`` for each change."""
        changed: dict[str, list[Any]] = {}
        for wanted, group in zip(self.groups, optimizer.param_groups, strict=True):
            for key, value in wanted.items():
                if key in group and plain_setting(group[key]) == plain_setting(value):
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


def with_strategy_change(recorded: Any, current: str, changed: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """``changed``, led by the strategy where the checkpoint was written under another one; without the flags only the
    other strategy's script has, which are no change the user asked for."""
    if recorded is None or recorded == current:
        return changed  # the same strategy, or a checkpoint from before strategies were recorded
    kept = {flag: values for flag, values in changed.items() if values[0] != NOT_RECORDED}
    return {"strategy": [recorded, current], **kept}


def identity_mismatch(theirs: dict[str, Any], ours: dict[str, Any]) -> str | None:
    """What makes a checkpoint (its recorded ``identity``) unfit for this run, each difference named; None if it fits.
    A checkpoint belongs to a model, not to a script (the strategy is not in it). "trained" and "model" missing there:
    recorded later (the state dicts' keys are all there is to go by); the TP script's "qkv" missing here is None."""
    differences = []
    for key, value in ({**ours, "qkv": ours.get("qkv")} if "qkv" in theirs else ours).items():
        if theirs.get(key) == value or (key in ("trained", "model") and key not in theirs):
            continue
        if key == "lora" and value is not None:
            differences.append(
                adapters_difference(theirs.get(key), value, [theirs.get("trained"), ours.get("trained")])
            )
        elif key != "trained":
            way_on = WAYS_ON.get((key, value is None), "{key} is {theirs!r} there, {ours!r} here")
            there, here = fields_that_differ(theirs.get(key), value)
            differences.append(way_on.format(key=key, theirs=there, ours=here))
        elif theirs.get("lora") == ours.get("lora"):  # other adapters train other parameters: said already
            differences.append(trained_difference(theirs[key], value))
    return "; ".join(differences) or None
