"""What a resume compares with the checkpoint it loads, and which of those values it may change.

A checkpoint records the flags that decide what is trained (``training_settings``). On resume the flags
given now are compared with those (``changed_settings``), and the optimizer's and LR scheduler's values
asked for now replace the recorded ones (``Settings``), each change named in one line.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

from common.fine_tuning import trained_difference

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


def with_strategy_change(recorded: Any, current: str, changed: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """``changed``, led by the strategy where the checkpoint was written under another one. The flags only
    the other strategy's script has are no change the user asked for, so they are left out."""
    if recorded is None or recorded == current:
        return changed  # the same strategy, or a checkpoint from before strategies were recorded
    kept = {flag: values for flag, values in changed.items() if values[0] != NOT_RECORDED}
    return {"strategy": [recorded, current], **kept}


def identity_mismatch(theirs: dict[str, Any], ours: dict[str, Any]) -> str | None:
    """What makes a checkpoint (its recorded ``identity``) unfit for this run, each difference named; None if
    it fits. The strategy is not part of it: a checkpoint belongs to a model, not to a script."""
    differences = []
    for key, value in ours.items():
        if key in ("trained", "model") and key not in theirs:
            # Written before it was recorded (the MNIST scripts recorded only themselves): the state dicts'
            # own keys are all there is to go by.
            continue
        if theirs.get(key) == value:
            continue
        if key == "trained":
            if theirs.get("lora") == ours.get("lora"):  # other adapters train other parameters: said already
                differences.append(trained_difference(theirs[key], value))
        elif key == "lora" and value is None:
            differences.append(
                f"lora is {theirs[key]!r} there, None here (to go on without adapters, merge them: python -m "
                "tools.runs.export_checkpoint CHECKPOINT model.pt, then start a new run with --init-from model.pt)"
            )
        else:
            differences.append(f"{key} is {theirs.get(key)!r} there, {value!r} here")
    return "; ".join(differences) or None
