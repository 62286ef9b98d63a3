"""What only a combination of the scripts' flags or the launch rules out (--resume with --resume-from, a global batch
the world size does not divide), and what the flags leave to fill in (the per-rank batch, the preset's dimensions):
decided after parsing, before any process group, so a mistake costs a second and is one message with exit code 2."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from common.cli import Parser
from common.distributed import (
    FSDP2_CPU_OFFLOAD,
    FSDP2_ON_CPU,
    LAUNCH_VARIABLES,
    env_num_nodes,
    env_world_size,
    require_torch,
    wants_cuda,
)
from common.fine_tuning import DEFAULT_LORA_TARGETS, adapters_difference, trained_difference
from common.models import COMPUTE_DTYPES, GPT_PRESETS
from common.run_dir import check_run_dir, check_run_dir_allows, checkpoint_step
from common.safetensors_weights import holds_safetensors, safetensors_files


def check_launch_environment(parser: Parser) -> None:
    """Ranks and a world size without torchrun's rendezvous (MASTER_ADDR) are refused: the run would start a world
    of one, yet take its share of the data as rank RANK of WORLD_SIZE (half the data at WORLD_SIZE=2)."""
    if "MASTER_ADDR" in os.environ:
        return
    given = {name: os.environ[name] for name in LAUNCH_VARIABLES if name in os.environ}
    if all(value == ("1" if "WORLD_SIZE" in name else "0") for name, value in given.items()):
        return  # a world of one, written out
    shown = " ".join(f"{name}={value}" for name, value in given.items())
    # Printed whatever RANK says: without a launcher this is the only process.
    sys.stderr.write(
        f"{parser.prog}: error: {shown} is set, but not MASTER_ADDR: start the processes with torchrun "
        f"(torchrun --standalone --nproc_per_node=N {parser.prog} ...), or unset {' and '.join(given)} "
        "to run one process\n"
    )
    sys.exit(2)


def check_training_flags(parser: Parser, args: argparse.Namespace, tp_size: int = 1) -> None:
    """The flags every script has, first recorded as given in ``args.training_settings``. ``tp_size``: ranks that
    share each slice of the batch (a tensor-parallel group); the batch is split over the world size divided by it."""
    args.training_settings = training_settings(parser, args)
    check_launch_environment(parser)
    if args.epochs is None and args.max_steps is None:
        parser.error("give --epochs or --max-steps")
    resolve_batch_size(parser, args, tp_size)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")


def resolve_batch_size(parser: Parser, args: argparse.Namespace, tp_size: int = 1) -> None:
    """Set ``args.batch_size`` (per rank) from --batch-size, --global-batch-size or the default."""
    if args.global_batch_size is None:
        args.batch_size = args.batch_size or args.default_batch_size
        return
    if args.batch_size is not None:
        parser.error("give --batch-size (per rank) or --global-batch-size, not both")
    world_size = env_world_size() // tp_size
    slices = world_size * args.grad_accum_steps
    if args.global_batch_size % slices:
        ranks = f"{world_size} rank(s)" if tp_size == 1 else f"{world_size} data-parallel group(s)"
        parser.error(
            f"--global-batch-size {args.global_batch_size} does not divide into {ranks} "
            f"x {args.grad_accum_steps} micro-step(s)"
        )
    args.batch_size = args.global_batch_size // slices


def check_transformer_flags(parser: Parser, args: argparse.Namespace) -> None:
    """Fill the model dimensions from the preset and refuse shapes that cannot work; the data's flags are
    common.tokens.check_data_flags' (the MNIST scripts, which share this module, read no token files)."""
    for name, value in GPT_PRESETS[args.model].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.deterministic and args.dropout > 0:
        parser.error("--deterministic needs --dropout 0: dropout masks differ with the world size")
    # What --mixed-precision computes in: None for fp32, which needs no cast.
    args.compute_dtype = COMPUTE_DTYPES[args.mixed_precision]
    if args.d_model % args.n_head:
        parser.error(f"--d-model {args.d_model} must be divisible by --n-head {args.n_head}")
    check_model_size(parser, args)
    if args.lora_rank is None and (args.lora_alpha is not None or args.lora_targets):
        parser.error("--lora-alpha and --lora-targets shape the adapters that --lora-rank adds: give --lora-rank too")
    if args.lora_targets is None:
        args.lora_targets = list(DEFAULT_LORA_TARGETS)


def check_fsdp_flags(parser: Parser, args: argparse.Namespace) -> None:
    if args.cpu_offload and not wants_cuda(args.device):
        parser.error("--cpu-offload frees GPU memory by moving state to the host; this run has no GPU")
    world_size = env_world_size()
    if args.replicate_degree is not None and world_size % args.replicate_degree:
        parser.error(f"--replicate-degree {args.replicate_degree} does not divide the world size {world_size}")


def check_fsdp2_flags(parser: Parser, args: argparse.Namespace) -> None:
    """check_fsdp_flags, what this torch's FSDP2 can do, and --replicate-degree 1 (plain FSDP) by default."""
    if args.cpu_offload:
        require_torch(parser, FSDP2_CPU_OFFLOAD, "--cpu-offload with FSDP2")
    if not wants_cuda(args.device):
        require_torch(parser, FSDP2_ON_CPU, "FSDP2 on the CPU")
    check_fsdp_flags(parser, args)
    if args.replicate_degree is None:
        args.replicate_degree = 1


# torch 2.14.1: in a shard group of one rank, FSDP1's HYBRID_SHARD falls back to NO_SHARD and reduces over that group
# alone, with no error or warning (2 ranks, 20 steps: weights 0.059 from DDP's, eval loss 2.5011 against 2.4772).
ONE_RANK_SHARD_GROUPS = (
    "--sharding-strategy hybrid_shard with --replicate-degree {replicate} at {replicate} processes leaves one "
    "process in each shard group, where FSDP1 never averages the gradients across the replicas: each rank would "
    "train on its own data alone. Use ddp/train_transformer.py (that is what one process per replica is), or a "
    "--replicate-degree that leaves 2 or more processes in each group"
)


def check_fsdp1_flags(parser: Parser, args: argparse.Namespace) -> None:
    """check_fsdp_flags, and --replicate-degree as FSDP1 takes it: hybrid_shard only, one replica a node by default."""
    if args.sharding_strategy != "hybrid_shard" and args.replicate_degree is not None:
        parser.error("--replicate-degree only applies to --sharding-strategy hybrid_shard")
    check_fsdp_flags(parser, args)
    if (args.lora_rank is not None or args.freeze) and (env_world_size() == 1 or args.sharding_strategy == "no_shard"):
        # torch 2.14.1: unsharded, an FSDP1 unit with nothing to train and nothing trainable below it (the
        # embeddings' unit, the first frozen Blocks) keeps its parameters as plain tensors after a step, and the
        # state dict of model.pt and the checkpoints misses them: an AssertionError after the whole run.
        parser.error(
            "--freeze and --lora-rank under FSDP1 need 2 or more processes and a strategy that shards: unsharded, "
            "FSDP1 leaves the weights of a unit with nothing to train out of model.pt and the checkpoints. In one "
            "process use ddp/train_transformer.py or fsdp/train_transformer_fsdp2.py"
        )
    if args.sharding_strategy == "hybrid_shard" and args.replicate_degree is None:
        # One replica per machine: sharding stays on a node's fast links, only the all-reduce crosses the network.
        args.replicate_degree = env_num_nodes()
        if args.replicate_degree == 1:
            # A single machine has no nodes to replicate across; pretend it has two.
            if env_world_size() % 2:
                parser.error(
                    f"hybrid_shard on one machine: give --replicate-degree R dividing the world size {env_world_size()}"
                )
            args.replicate_degree = 2
    if args.sharding_strategy == "hybrid_shard" and env_world_size() == args.replicate_degree:
        parser.error(ONE_RANK_SHARD_GROUPS.format(replicate=args.replicate_degree))


def check_init_from(parser: Parser, path: Path) -> None:
    """--init-from names a state dict file, a .safetensors file or a Hugging Face folder, and the folder holds
    the files its index names; whether they fit the model is known once it is built."""
    if path.is_dir() and (path / ".metadata").exists():
        export = f"python -m tools.runs.export_checkpoint {path} weights.pt"
        parser.error(f"--init-from {path} is a sharded checkpoint; {export} makes a state dict of one")
    if path.is_dir():
        try:
            safetensors_files(path)
        except ValueError as err:
            parser.error(f"--init-from {path} {err}")
    elif not path.is_file():
        parser.error(f"--init-from {path}: no such file")
    if holds_safetensors(path) and not hasattr(dcp, "HuggingFaceStorageReader"):
        parser.error(
            f"--init-from {path}: safetensors are read with torch.distributed.checkpoint's HuggingFaceStorageReader, "
            f"which torch {torch.__version__} lacks: use a newer torch (docs/torch-versions.md)"
        )


def check_checkpoint_flags(parser: Parser, args: argparse.Namespace) -> None:
    """Refuse a resume that cannot work, and a start that would replace or mix with an earlier run's files."""
    check_run_dir(parser, args.run_dir)
    if args.resume and args.resume_from is not None:
        parser.error("give --resume (the newest checkpoint) or --resume-from PATH, not both")
    if args.init_from is not None:
        if args.resume_from is not None:
            parser.error("give --resume-from (continue a run) or --init-from (start one from weights), not both")
        check_init_from(parser, args.init_from)
    if args.resume_from is not None:
        if not args.resume_from.exists():
            parser.error(f"--resume-from {args.resume_from}: no such checkpoint")
        if checkpoint_step(args.resume_from) is None:
            parser.error(f"--resume-from {args.resume_from}: not a checkpoint (those are named step-N or step-N.pt)")
    check_run_dir_allows(parser, args.run_dir, resume=args.resume, resume_from=args.resume_from)


def machine_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_model_size(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A model whose fp32 weights alone exceed this machine's memory is refused now, not by the allocator: its Blocks'
    (12 d^2 each) and position embeddings; not the vocabulary's rows (the data's), so only what cannot be built."""
    weights = 4 * (12 * args.n_layer * args.d_model**2 + args.block_size * args.d_model)
    if weights > machine_memory():
        parser.error(
            f"--n-layer {args.n_layer} --d-model {args.d_model} --block-size {args.block_size}: the weights alone "
            f"would take {weights / 2**30:,.0f} GiB, more than this machine's {machine_memory() / 2**30:,.0f} GiB"
        )


def check_synthetic_size(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Synthetic sequences that could not fit in this machine's memory are refused now, not by the allocator."""
    sequences = args.train_sequences + args.heldout_sequences
    needed = sequences * (args.block_size + 1) * 8  # int64 ids, one more than the context for the targets
    memory = machine_memory()
    if needed > memory:
        parser.error(
            f"--train-sequences {args.train_sequences} and --heldout-sequences {args.heldout_sequences} at "
            f"--block-size {args.block_size}: the synthetic data would take {needed / 2**30:,.0f} GiB per process, "
            f"more than this machine's {memory / 2**30:,.0f} GiB"
        )


# What a resume may change without a word: where the run writes or computes, what it reports, how it saves or starts.
NOT_TRAINING_SETTINGS = {
    *("--run-dir", "--data-dir", "--device", "--dist-timeout"),  # where, and how long a collective waits
    *("--log-interval", "--profile"),  # what is reported; neither touches the weights or the data order
    *("--eval-interval", "--eval-batch-size", "--test-batch-size"),  # evaluation never updates a weight
    *("--checkpoint-interval", "--keep-checkpoints", "--checkpoint-format", "--trust-checkpoint"),  # saving
    *("--resume", "--resume-from", "--init-from"),  # where the run starts; a resume starts from a checkpoint
}


def training_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """Every flag of ``parser`` (one added later too) but NOT_TRAINING_SETTINGS, by long name, with its value in
    ``args``: each checkpoint records them, and a resume names each that differs. Call it right after parsing, before
    checks derive values (a per-rank batch, a preset's width) that would differ at another world size unasked."""
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


def fields_that_differ(there: Any, here: Any) -> tuple[Any, Any]:
    """Two records cut to the fields in which they differ, where both are dicts (a Hugging Face config has dozens)."""
    if not (isinstance(there, dict) and isinstance(here, dict)):
        return there, here
    fields = [name for name in {**there, **here} if there.get(name, NOT_RECORDED) != here.get(name, NOT_RECORDED)]
    return tuple({name: record.get(name, NOT_RECORDED) for name in fields} for record in (there, here))  # type: ignore[return-value]


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
