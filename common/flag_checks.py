"""What the flags leave open (resolve_flags fills it in), what only their combination or the launch rules out (check_*):
decided after parsing, before any process group, so a mistake costs a second and is one message with exit code 2."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
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
from common.fine_tuning import DEFAULT_LORA_TARGETS
from common.models import GPT_PRESETS
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


def resolve_flags(parser: Parser, args: argparse.Namespace) -> None:
    """Fill in what the flags leave open, each into its own flag, in this order wherever a script has the flag: the
    per-rank batch, the preset's sizes, the adapters' targets, the replicas. After training_settings, before checks."""
    check_launch_environment(parser)  # the batch and the replicas are cut from torchrun's world size
    resolve_batch_size(parser, args)
    if "model" in args:
        for name, value in GPT_PRESETS[args.model].items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    if "lora_targets" in args and args.lora_rank is not None and args.lora_targets is None:
        args.lora_targets = list(DEFAULT_LORA_TARGETS)
    if "replicate_degree" in args and args.replicate_degree is None:
        args.replicate_degree = default_replicate_degree(parser, args)


def resolve_batch_size(parser: Parser, args: argparse.Namespace) -> None:
    """The per-rank batch from --batch-size, --global-batch-size or the default; a --tp-degree group shares one."""
    if args.global_batch_size is None:
        args.batch_size = args.batch_size or parser.default_batch_size
        return
    if args.batch_size is not None:
        parser.error("give --batch-size (per rank) or --global-batch-size, not both")
    world_size = env_world_size() // getattr(args, "tp_degree", 1)  # the data-parallel groups, under TP
    slices = world_size * args.grad_accum_steps
    if args.global_batch_size % slices:
        ranks = f"{world_size} rank(s)" if world_size == env_world_size() else f"{world_size} data-parallel group(s)"
        parser.error(
            f"--global-batch-size {args.global_batch_size} does not divide into {ranks} "
            f"x {args.grad_accum_steps} micro-step(s)"
        )
    args.batch_size = args.global_batch_size // slices


def default_replicate_degree(parser: Parser, args: argparse.Namespace) -> int | None:
    """FSDP2: 1, plain FSDP. FSDP1 (--sharding-strategy): under hybrid_shard one replica a machine, so that sharding
    stays on a node's fast links and only the all-reduce crosses the network; one machine pretends to be two."""
    if "sharding_strategy" not in args:
        return 1
    if args.sharding_strategy != "hybrid_shard":
        return None
    if env_num_nodes() == 1 and (world_size := env_world_size()) % 2:
        parser.error(f"hybrid_shard on one machine: give --replicate-degree R dividing the world size {world_size}")
    return max(env_num_nodes(), 2)


def check_training_flags(parser: Parser, args: argparse.Namespace) -> None:
    """The flags every script has, once resolve_flags has filled in the per-rank batch."""
    if args.epochs is None and args.max_steps is None:
        parser.error("give --epochs or --max-steps")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine")
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:  # looked up, not imported
        parser.error("--tensorboard needs the tensorboard package, which is not installed: pip install tensorboard")


def check_transformer_flags(parser: Parser, args: argparse.Namespace) -> None:
    """Refuse shapes that cannot work; the data flags are common.tokens' (which an MNIST script's copy leaves out)."""
    if args.deterministic and args.dropout > 0:
        parser.error("--deterministic needs --dropout 0: dropout masks differ with the world size")
    if args.d_model % args.n_head:
        parser.error(f"--d-model {args.d_model} must be divisible by --n-head {args.n_head}")
    check_model_size(parser, args)
    check_sdpa_backend(parser, args)
    if args.lora_rank is None and (args.lora_alpha is not None or args.lora_targets):
        parser.error("--lora-alpha and --lora-targets shape the adapters that --lora-rank adds: give --lora-rank too")


def check_sdpa_backend(parser: Parser, args: argparse.Namespace) -> None:
    """Refuse an attention kernel this run cannot use: torch would fail at the first forward, naming no flag."""
    backend, on_gpu = args.sdpa_backend, wants_cuda(args.device)
    if backend in ("efficient", "cudnn") and not on_gpu:
        parser.error(f"--sdpa-backend {backend} is a CUDA kernel and this run has no GPU: on CPU use flash or math")
    if backend in ("flash", "cudnn") and on_gpu and args.mixed_precision == "fp32":
        parser.error(f"--sdpa-backend {backend} on a GPU computes in bf16 or fp16: add --mixed-precision bf16")


def check_fsdp_flags(parser: Parser, args: argparse.Namespace) -> None:
    if args.cpu_offload and not wants_cuda(args.device):
        parser.error("--cpu-offload frees GPU memory by moving state to the host; this run has no GPU")
    world_size = env_world_size()
    if args.replicate_degree is not None and world_size % args.replicate_degree:
        parser.error(f"--replicate-degree {args.replicate_degree} does not divide the world size {world_size}")


def check_fsdp2_flags(parser: Parser, args: argparse.Namespace) -> None:
    """check_fsdp_flags, and what this torch's FSDP2 can do."""
    if args.cpu_offload:
        require_torch(parser, FSDP2_CPU_OFFLOAD, "--cpu-offload with FSDP2")
    if not wants_cuda(args.device):
        require_torch(parser, FSDP2_ON_CPU, "FSDP2 on the CPU")
    check_fsdp_flags(parser, args)


# torch 2.14.1: in a shard group of one rank, FSDP1's HYBRID_SHARD falls back to NO_SHARD and reduces over that group
# alone, with no error or warning (2 ranks, 20 steps: weights 0.059 from DDP's, eval loss 2.5011 against 2.4772).
ONE_RANK_SHARD_GROUPS = (
    "--sharding-strategy hybrid_shard with --replicate-degree {replicate} at {replicate} processes leaves one "
    "process in each shard group, where FSDP1 never averages the gradients across the replicas: each rank would "
    "train on its own data alone. Use ddp/train_transformer.py (that is what one process per replica is), or a "
    "--replicate-degree that leaves 2 or more processes in each group"
)


def check_fsdp1_flags(parser: Parser, args: argparse.Namespace) -> None:
    """check_fsdp_flags, and --replicate-degree as FSDP1 takes it: with hybrid_shard only."""
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
    if getattr(args, "async_checkpoint", False) and getattr(args, "checkpoint_format", None) == "full":
        parser.error(
            "--async-checkpoint writes sharded checkpoints, each rank its own shards, in the background; "
            "--checkpoint-format full gathers everything onto rank 0 and writes one file: drop one of them"
        )
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
    *("--log-interval", "--profile", "--tensorboard"),  # what is reported; none touches the weights or the data order
    *("--hang-timeout", "--no-flight-recorder"),  # the hang watch: it watches the run, never changes it
    *("--eval-interval", "--eval-batch-size", "--test-batch-size"),  # evaluation never updates a weight
    *("--checkpoint-interval", "--keep-checkpoints", "--checkpoint-format", "--trust-checkpoint"),  # saving
    "--async-checkpoint",  # how a checkpoint is written, not what it holds
    *("--resume", "--resume-from", "--init-from"),  # where the run starts; a resume starts from a checkpoint
}


def training_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """Every flag of ``parser`` (one added later too) but NOT_TRAINING_SETTINGS, by long name, with its value in
    ``args``: each checkpoint records them, and a resume names each that differs. Call it right after parsing, before
    resolve_flags fills in values (a per-rank batch, a preset's width) that differ at another world size unasked."""
    flags = {max(action.option_strings, key=len): action.dest for action in parser._actions if action.option_strings}
    given = {flag: dest for flag, dest in flags.items() if flag not in NOT_TRAINING_SETTINGS and dest in args}
    return {flag: plain_setting(getattr(args, dest)) for flag, dest in given.items()}


def plain_setting(value: Any) -> Any:
    """``value`` as data that a checkpoint (weights_only) and metrics.jsonl (JSON) both hold."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [plain_setting(item) for item in value]
    return str(value)  # a Path, or anything else a flag's type makes


NOT_RECORDED = "(not recorded)"  # a flag that the script which wrote the checkpoint did not have yet


def fields_that_differ(there: Any, here: Any) -> tuple[Any, Any]:
    """Two records cut to the fields in which they differ, where both are dicts (a Hugging Face config has dozens)."""
    if not (isinstance(there, dict) and isinstance(here, dict)):
        return there, here
    fields = [name for name in {**there, **here} if there.get(name, NOT_RECORDED) != here.get(name, NOT_RECORDED)]
    return tuple({name: record.get(name, NOT_RECORDED) for name in fields} for record in (there, here))  # type: ignore[return-value]
