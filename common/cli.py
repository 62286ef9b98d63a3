"""Command-line flags shared by the scripts, checked before any process group starts.

A typo should cost a second, not a queue wait: every flag is parsed and checked
first, and a mistake is reported once (by rank 0) with exit code 2. Each number and path
flag reads its value with a type of common.flags, as the commands' flags do.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import IO

from common.distributed import LAUNCH_VARIABLES, env_rank, env_world_size, wants_cuda
from common.flags import (
    existing_file,
    existing_path,
    folder,
    int_in_range,
    learning_rate,
    non_negative_float,
    non_negative_int,
    output_dir,
    positive_float,
    positive_int,
    probability,
    seed_value,
    timeout_seconds,
)
from common.models import GPT_PRESETS, GPTConfig
from common.run_dir import MODEL_FILE, RUN_RESULTS, checkpoint_step, complete_checkpoints
from common.tokens import BadTokenFile, first_id_outside, read_token_metadata, token_metadata_path


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (with their example commands), and every flag's default in its help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        has_default = action.default not in (None, False, argparse.SUPPRESS)
        if has_default and action.option_strings and "(default" not in text:
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage, help and errors appear once, not once per rank."""

    def print_usage(self, file: IO[str] | None = None) -> None:
        if env_rank() == 0:
            super().print_usage(file)

    def print_help(self, file: IO[str] | None = None) -> None:
        if env_rank() == 0:
            super().print_help(file)

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        if message and env_rank() == 0:
            sys.stderr.write(message)
        sys.exit(status)


def add_device_flag(container: argparse._ActionsContainer) -> None:
    """--device as every script and the commands that start ranks take it."""
    container.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: this process's GPU with NCCL if CUDA is available, else CPU with gloo",
    )


def make_parser(description: str | None, *, run_dir: str, log_interval: int) -> Parser:
    """A parser with the flags every script has: device, timeouts, seed, output."""
    parser = Parser(description=description, formatter_class=HelpFormatter)
    run = parser.add_argument_group("run")
    add_device_flag(run)
    run.add_argument(
        "--dist-timeout",
        type=timeout_seconds,
        default=600.0,
        metavar="SECONDS",
        help="how long a collective waits for the other ranks before failing (default: %(default)s)",
    )
    run.add_argument(
        "--seed",
        type=seed_value,
        default=1,
        help="seeds the initial weights, the data order and dropout, the same on every rank",
    )
    run.add_argument(
        "--run-dir",
        type=output_dir,
        default=Path(run_dir),
        help="where metrics.jsonl and model.pt go (default: %(default)s)",
    )
    run.add_argument(
        "--log-interval",
        type=positive_int,
        default=log_interval,
        metavar="STEPS",
        help="a metrics.jsonl record and a console line every this many steps; only these steps read values "
        "from the GPU",
    )
    run.add_argument(
        "--profile",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="write a torch.profiler trace of N steps after a warm-up step, one file per rank, into "
        "RUN_DIR/profile/ (open it in ui.perfetto.dev or chrome://tracing); 0: no trace (default: %(default)s)",
    )
    return parser


def add_training_flags(
    parser: Parser, *, batch_size: int, lr: float, epochs: int | None, max_steps: int | None, grad_clip: float
) -> None:
    group = parser.add_argument_group("training")
    parser.set_defaults(default_batch_size=batch_size)
    group.add_argument(
        "--batch-size",
        type=positive_int,
        help=f"examples per rank per micro-step (default: {batch_size})",
    )
    group.add_argument(
        "--global-batch-size",
        type=positive_int,
        metavar="N",
        help="examples per optimizer step over all ranks and micro-steps; the per-rank batch becomes "
        "N / (world size x --grad-accum-steps), so the same N trains the same way at any world size",
    )
    group.add_argument(
        "--grad-accum-steps",
        type=positive_int,
        default=1,
        help="micro-steps per optimizer step; gradients sync only on the last one",
    )
    group.add_argument("--lr", type=learning_rate, default=lr, help="peak learning rate (default: %(default)s)")
    group.add_argument(
        "--epochs", type=positive_int, default=epochs, help="passes over the training set (default: %(default)s)"
    )
    group.add_argument(
        "--max-steps",
        type=non_negative_int,
        default=max_steps,
        help="stop after this many optimizer steps; 0 only evaluates (default: %(default)s)",
    )
    group.add_argument(
        "--grad-clip",
        type=non_negative_float,
        default=grad_clip,
        help="clip the global gradient norm to this; 0 turns clipping off (default: %(default)s)",
    )
    group.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels and no dropout, so runs at different world sizes can be compared step by step",
    )


def add_schedule_flags(parser: Parser, *, warmup_steps: int, min_lr_ratio: float, weight_decay: float) -> None:
    """AdamW's weight decay and the warm-up-then-cosine schedule of the transformer scripts."""
    group = parser.add_argument_group("schedule")
    group.add_argument(
        "--warmup-steps",
        type=non_negative_int,
        default=warmup_steps,
        help="steps of linear warm-up to the peak lr",
    )
    group.add_argument(
        "--min-lr-ratio",
        type=probability,
        default=min_lr_ratio,
        help="the cosine schedule ends at lr times this",
    )
    group.add_argument(
        "--weight-decay",
        type=non_negative_float,
        default=weight_decay,
        help="AdamW's decoupled weight decay",
    )


def add_mnist_flags(parser: Parser, *, gamma: float) -> None:
    group = parser.add_argument_group("MNIST")
    group.add_argument(
        "--data-dir",
        type=folder,
        default=Path("./data"),
        help="holds MNIST/raw/; downloaded there if missing (default: %(default)s)",
    )
    group.add_argument(
        "--synthetic",
        action="store_true",
        help="train on generated 28x28 images instead of MNIST (smoke tests, no data needed)",
    )
    group.add_argument(
        "--test-batch-size", type=positive_int, default=1000, help="images per rank per evaluation batch"
    )
    group.add_argument("--gamma", type=positive_float, default=gamma, help="StepLR's lr decay per epoch")


# 128 Ki tokens: attention scores at that length already take 64 GiB per head and sequence in fp32.
context_length = int_in_range(1, 2**17, name="context_length")


def add_transformer_flags(parser: Parser) -> None:
    group = parser.add_argument_group("transformer")
    group.add_argument("--model", choices=sorted(GPT_PRESETS), default="tiny", help="size preset (default: tiny)")
    group.add_argument("--n-layer", type=positive_int, help="override the preset's number of Blocks")
    group.add_argument("--n-head", type=positive_int, help="override the preset's attention heads")
    group.add_argument("--d-model", type=positive_int, help="override the preset's width")
    group.add_argument("--block-size", type=context_length, help="override the preset's context length")
    group.add_argument("--dropout", type=probability, default=0.0, help="dropout probability in every Block")
    group.add_argument(
        "--text-file",
        type=existing_file,
        help="train character-level on this UTF-8 file instead of the synthetic Markov tokens",
    )
    group.add_argument(
        "--token-file",
        type=existing_file,
        metavar="TOKENS",
        help="train on a file of token ids that python -m common.prepare_tokens wrote, read a window at a time: a "
        "corpus of any size; its last 10%% is held out",
    )
    group.add_argument(
        "--train-sequences",
        type=positive_int,
        default=20_000,
        help="synthetic training sequences (default: %(default)s)",
    )
    group.add_argument(
        "--heldout-sequences",
        type=positive_int,
        default=1_000,
        help="held-out sequences: synthetic ones, or the last windows of a --token-file, at most a tenth of it "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--variable-length",
        action="store_true",
        help="cut each synthetic sequence to 1 to --block-size tokens, drawn from the data's seed, and pad the "
        "rest (ignore_index), as real text of uneven lengths is; each token still weighs the same in the loss",
    )
    group.add_argument(
        "--eval-interval", type=positive_int, default=100, metavar="STEPS", help="evaluate every this many steps"
    )
    group.add_argument(
        "--eval-batch-size", type=positive_int, default=100, help="held-out sequences per rank per evaluation batch"
    )


def check_transformer_flags(parser: Parser, args: argparse.Namespace) -> None:
    """Fill the model dimensions from the preset and refuse shapes that cannot work."""
    for name, value in GPT_PRESETS[args.model].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.deterministic and args.dropout > 0:
        parser.error("--deterministic needs --dropout 0: dropout masks differ with the world size")
    if args.d_model % args.n_head:
        parser.error(f"--d-model {args.d_model} must be divisible by --n-head {args.n_head}")
    if args.text_file is not None and args.token_file is not None:
        parser.error("give --text-file or --token-file, not both")
    if args.text_file is not None:
        check_text_file(parser, args.text_file, args.block_size)
    if args.token_file is not None:
        check_token_file(parser, args.token_file, args.block_size)
    if args.variable_length and (args.text_file or args.token_file):
        parser.error("--variable-length cuts the synthetic sequences; the windows of a text or token file are whole")
    if args.text_file is None and args.token_file is None:
        check_synthetic_size(parser, args)
    check_model_size(parser, args)


def machine_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_model_size(parser: Parser, args: argparse.Namespace) -> None:
    """A model whose fp32 weights alone exceed this machine's memory is refused now, not by the allocator.

    Its Blocks' weights (12 d^2 each) and position embeddings are counted; the vocabulary's rows, which
    depend on the data, are left out, so this refuses only what cannot be built.
    """
    weights = 4 * (12 * args.n_layer * args.d_model**2 + args.block_size * args.d_model)
    if weights > machine_memory():
        parser.error(
            f"--n-layer {args.n_layer} --d-model {args.d_model} --block-size {args.block_size}: the weights alone "
            f"would take {weights / 2**30:,.0f} GiB, more than this machine's {machine_memory() / 2**30:,.0f} GiB"
        )


def check_synthetic_size(parser: Parser, args: argparse.Namespace) -> None:
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


def check_text_file(parser: Parser, path: Path, block_size: int) -> None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        parser.error(f"--text-file {path}: no such file")
    except UnicodeDecodeError:
        parser.error(f"--text-file {path}: not UTF-8 text")
    except OSError as err:
        parser.error(f"--text-file {path}: cannot read it ({err.strerror})")
    # 90% trains and 10% is held out; each part needs at least one window.
    needed = 10 * (block_size + 1)
    if len(text) < needed:
        parser.error(
            f"--text-file {path} has {len(text)} characters; at --block-size {block_size} it needs at least {needed}"
        )


def check_token_file(parser: Parser, path: Path, block_size: int) -> None:
    """A token file and its TOKENS.json that agree, and every id in the file inside the vocabulary: the model
    has a row for each, instead of an IndexError (a device assert on a GPU) at the first batch that holds one."""
    if not path.is_file():
        parser.error(f"--token-file {path}: no such file")
    try:
        metadata = read_token_metadata(path)
    except BadTokenFile as err:
        parser.error(f"--token-file {path}: {err}")
    size = path.stat().st_size
    if size != 2 * metadata.tokens:
        parser.error(f"--token-file {path} holds {size} bytes; its .json says {metadata.tokens} uint16 tokens")
    # 90% trains and 10% is held out; each part needs at least one window.
    needed = 10 * (block_size + 2)
    if metadata.tokens < needed:
        parser.error(
            f"--token-file {path} has {metadata.tokens} tokens; --block-size {block_size} needs at least {needed}"
        )
    try:
        outside = first_id_outside(path, metadata.tokens, metadata.vocab_size)
    except OSError as err:
        parser.error(f"--token-file {path}: cannot read it ({err.strerror or err})")
    if outside is not None:
        position, token = outside
        parser.error(
            f"--token-file {path} holds id {token} (token {position:,}), but {token_metadata_path(path).name} says "
            f"vocab_size {metadata.vocab_size}: the model would have no row for it. Was either file changed after "
            "common.prepare_tokens wrote them?"
        )


def check_launch_environment(parser: Parser) -> None:
    """Ranks and a world size without torchrun's rendezvous (MASTER_ADDR) are refused.

    Without it the run would start a world of one, yet take its share of the data as rank RANK of
    WORLD_SIZE: half the data at WORLD_SIZE=2, and a final record that claims two processes.
    """
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


def check_training_flags(parser: Parser, args: argparse.Namespace) -> None:
    check_launch_environment(parser)
    if args.epochs is None and args.max_steps is None:
        parser.error("give --epochs or --max-steps")
    resolve_batch_size(parser, args)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: CUDA is not available on this machine")


def resolve_batch_size(parser: Parser, args: argparse.Namespace) -> None:
    """Set ``args.batch_size`` (per rank) from --batch-size, --global-batch-size or the default."""
    if args.global_batch_size is None:
        args.batch_size = args.batch_size or args.default_batch_size
        return
    if args.batch_size is not None:
        parser.error("give --batch-size (per rank) or --global-batch-size, not both")
    world_size = env_world_size()
    slices = world_size * args.grad_accum_steps
    if args.global_batch_size % slices:
        parser.error(
            f"--global-batch-size {args.global_batch_size} does not divide into {world_size} rank(s) "
            f"x {args.grad_accum_steps} micro-step(s)"
        )
    args.batch_size = args.global_batch_size // slices


def gpt_config(args: argparse.Namespace, vocab_size: int) -> GPTConfig:
    return GPTConfig(
        vocab_size=vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        d_model=args.d_model,
        dropout=args.dropout,
    )


def add_compute_flags(parser: Parser, *, precisions: list[str]) -> None:
    """How the transformer scripts compute: the same flags under DDP and FSDP, so they compare fairly."""
    group = parser.add_argument_group("compute")
    group.add_argument(
        "--mixed-precision",
        choices=precisions,
        default="fp32",
        help="dtype of the matrix multiplications in forward and backward (DDP: torch.autocast; FSDP: the "
        "dtype its gathered parameters take); weights, optimizer state and gradient reduction stay fp32 "
        "(default: %(default)s)",
    )
    group.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="keep only each Block's input in forward and recompute the rest in backward: less memory, more compute",
    )
    group.add_argument(
        "--compile", action="store_true", help="torch.compile each Block (the first steps are slow while it compiles)"
    )


def add_fsdp_flags(parser: Parser) -> None:
    """Flags both FSDP transformer scripts have; each script adds its own on top."""
    group = parser.add_argument_group("FSDP")
    group.add_argument(
        "--cpu-offload",
        action="store_true",
        help="keep the sharded parameters, gradients and optimizer state in host memory (CUDA runs only)",
    )
    group.add_argument(
        "--replicate-degree",
        type=positive_int,
        metavar="R",
        help="hybrid sharding: R groups each hold a full sharded copy, shard within a group, "
        "all-reduce across groups; must divide the world size",
    )


def check_fsdp_flags(parser: Parser, args: argparse.Namespace) -> None:
    if args.cpu_offload and not wants_cuda(args.device):
        parser.error("--cpu-offload frees GPU memory by moving state to the host; this run has no GPU")
    world_size = env_world_size()
    if args.replicate_degree is not None and world_size % args.replicate_degree:
        parser.error(f"--replicate-degree {args.replicate_degree} does not divide the world size {world_size}")


def add_checkpoint_flags(parser: Parser, *, sharded: bool) -> None:
    """Checkpoint and resume flags; ``sharded`` adds --checkpoint-format (the FSDP scripts)."""
    group = parser.add_argument_group("checkpoints")
    group.add_argument(
        "--checkpoint-interval",
        type=non_negative_int,
        default=0,
        metavar="STEPS",
        help="save a checkpoint into RUN_DIR/checkpoints every this many steps; 0: only when asked to stop "
        "(SIGTERM, SIGUSR1 or a RUN_DIR/STOP file) (default: %(default)s)",
    )
    group.add_argument(
        "--keep-checkpoints",
        type=positive_int,
        default=2,
        metavar="K",
        help="keep the newest K checkpoints, delete older ones (default: %(default)s)",
    )
    group.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --run-dir; start from step 0 if there is none",
    )
    group.add_argument(
        "--resume-from",
        type=existing_path,
        metavar="PATH",
        help="continue from this checkpoint (RUN_DIR/checkpoints/step-N)",
    )
    group.add_argument(
        "--init-from",
        type=existing_path,
        metavar="PATH",
        help="start from these weights: a state dict of this model (a run's model.pt, or python -m "
        "common.export_checkpoint's output), at step 0 with a fresh optimizer; with --resume, a checkpoint "
        "in --run-dir comes first",
    )
    if sharded:
        group.add_argument(
            "--checkpoint-format",
            choices=["sharded", "full"],
            default="sharded",
            help="sharded: each rank writes its own shard (torch.distributed.checkpoint), resumable at another "
            "world size; full: rank 0 gathers everything into one file (default: %(default)s)",
        )
        add_trust_flag(group)


def add_trust_flag(group: argparse._ActionsContainer) -> None:
    """--trust-checkpoint, for the training scripts and common.export_checkpoint alike."""
    group.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="load a sharded checkpoint even if its .metadata holds more than DCP's own records; that file "
        "is a pickle, so this runs whatever code it names: only for checkpoints from someone you trust",
    )


def check_run_dir(parser: Parser, run_dir: Path) -> None:
    """A --run-dir the run cannot write is refused now, not after the model is built or trained.

    The flag's type checks what the user gives; this checks the default too.
    """
    try:
        output_dir(str(run_dir))
    except argparse.ArgumentTypeError as err:
        parser.error(f"argument --run-dir: {err}")


def check_checkpoint_flags(parser: Parser, args: argparse.Namespace) -> None:
    """Refuse a resume that cannot work, and a start that would replace or mix with an earlier run's files."""
    check_run_dir(parser, args.run_dir)
    if args.resume and args.resume_from is not None:
        parser.error("give --resume (the newest checkpoint) or --resume-from PATH, not both")
    if args.init_from is not None:
        if args.resume_from is not None:
            parser.error("give --resume-from (continue a run) or --init-from (start one from weights), not both")
        if args.init_from.is_dir():
            parser.error(
                f"--init-from {args.init_from} is a folder, as a sharded checkpoint is; "
                f"python -m common.export_checkpoint {args.init_from} weights.pt makes a state dict of one"
            )
        if not args.init_from.is_file():
            parser.error(f"--init-from {args.init_from}: no such file")
    if args.resume_from is not None:
        if not args.resume_from.exists():
            parser.error(f"--resume-from {args.resume_from}: no such checkpoint")
        if checkpoint_step(args.resume_from) is None:
            parser.error(f"--resume-from {args.resume_from}: not a checkpoint (those are named step-N or step-N.pt)")
        if args.run_dir.resolve() in args.resume_from.resolve().parents:
            return  # back to an earlier point of this run (its own checkpoints, or abandoned/)
    existing = complete_checkpoints(args.run_dir)
    results = [name for name in RUN_RESULTS if (args.run_dir / name).exists()]
    if args.resume_from is not None and (existing or results):
        parser.error(
            f"--resume-from {args.resume_from} is another run's checkpoint, and --run-dir {args.run_dir} already "
            "holds a run of its own; continuing there would mix the two. Choose a new --run-dir"
        )
    if not args.resume and existing:
        parser.error(
            f"--run-dir {args.run_dir} already holds checkpoints of an earlier run (newest: {existing[-1].name}); "
            "pass --resume to continue it, or choose another --run-dir"
        )
    # A run without checkpoints (the default --checkpoint-interval 0) leaves only these; a fresh
    # run would replace them, and one that then failed would leave neither run's record.
    if not existing and results and not args.resume:
        parser.error(
            f"--run-dir {args.run_dir} already holds an earlier run ({', '.join(results)}); a fresh run would replace "
            "it. Choose another --run-dir, or delete those files to start over"
        )
    if not existing and MODEL_FILE in results:
        parser.error(
            f"--resume: {args.run_dir} holds a finished run's model.pt and no checkpoint to continue from; "
            "starting over would replace it. Choose another --run-dir, or delete model.pt to start over"
        )
