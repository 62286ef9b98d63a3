"""The flags the training scripts share, grouped as --help shows them. A type of common.flags reads each number and path
flag, so a value no flag means is refused while parsing; what only a combination rules out is flag_checks'."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import IO

import common.flags as flags
from common.distributed import env_rank
from common.models import GPT_PRESETS


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

    default_batch_size: int | None = None  # the script's; no argparse default, so that a checkpoint records "unset"

    def _print_message(self, message: str, file: IO[str] | None = None) -> None:
        if env_rank() == 0:
            super()._print_message(message, file)


def add_device_flag(container: argparse._ActionsContainer) -> None:
    """--device as every script and the commands that start ranks take it."""
    text = "auto: this process's GPU with NCCL if CUDA is available, else CPU with gloo"
    container.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help=text)


def make_parser(description: str | None, *, run_dir: str, log_interval: int) -> Parser:
    parser = Parser(description=description, formatter_class=HelpFormatter)
    run = parser.add_argument_group("run")
    add_device_flag(run)
    text = "how long a collective waits for the other ranks before failing"
    run.add_argument("--dist-timeout", type=flags.timeout_seconds, default=600.0, metavar="SECONDS", help=text)
    text = (
        "end the job with one hang report (which rank, which collective, which line; files in RUN_DIR/hang/) when no "
        "training step ends for this long; the clock runs from the first step's end to the last's and stands still in "
        "evaluations and checkpoint saves (a hang in those ends at --dist-timeout, with the same report); keep it "
        "below --dist-timeout so that the report comes first"
    )
    run.add_argument("--hang-timeout", type=flags.hang_seconds, default=300.0, metavar="SECONDS", help=text)
    text = (
        "torch's Flight Recorder keeps the last collectives of each rank for the hang report; --no-flight-recorder "
        "turns it and the hang watchdog off"
    )
    run.add_argument("--flight-recorder", action=argparse.BooleanOptionalAction, default=True, help=text)
    text = "seeds the initial weights, the data order and dropout, the same on every rank"
    run.add_argument("--seed", type=flags.seed_value, default=1, help=text)
    text = "where metrics.jsonl and model.pt go"
    run.add_argument("--run-dir", type=flags.output_dir, default=Path(run_dir), help=text)
    text = "a metrics.jsonl record and a console line every this many steps; only these steps read values from the GPU"
    run.add_argument("--log-interval", type=flags.positive_int, default=log_interval, metavar="STEPS", help=text)
    text = (
        "write a torch.profiler trace of N steps after a warm-up step, one file per rank, into RUN_DIR/profile/ (open "
        "it in ui.perfetto.dev or chrome://tracing); 0: no trace (default: %(default)s)"
    )
    run.add_argument("--profile", type=flags.non_negative_int, default=0, metavar="N", help=text)
    text = (
        "rank 0 also writes metrics.jsonl's numbers into RUN_DIR/tensorboard/ as TensorBoard scalars, the step as x "
        "(tensorboard --logdir runs); needs the tensorboard package"
    )
    run.add_argument("--tensorboard", action="store_true", help=text)
    return parser


def add_training_flags(
    parser: Parser, *, batch_size: int, lr: float, epochs: int | None, max_steps: int | None, grad_clip: float
) -> None:
    group = parser.add_argument_group("training")
    parser.default_batch_size = batch_size
    text = f"examples per rank per micro-step (default: {batch_size})"
    group.add_argument("--batch-size", type=flags.positive_int, help=text)
    text = (
        "examples per optimizer step over all ranks and micro-steps; the per-rank batch becomes N / (world size "
        "[/ --tp-degree under tensor parallelism] x --grad-accum-steps), so the same N trains alike at any world size"
    )
    group.add_argument("--global-batch-size", type=flags.positive_int, metavar="N", help=text)
    text = "micro-steps per optimizer step; gradients sync only on the last one"
    group.add_argument("--grad-accum-steps", type=flags.positive_int, default=1, help=text)
    group.add_argument("--lr", type=flags.learning_rate, default=lr, help="peak learning rate")
    text = "passes over the training set (default: %(default)s)"
    group.add_argument("--epochs", type=flags.positive_int, default=epochs, help=text)
    text = "stop after this many optimizer steps; 0 only evaluates (default: %(default)s)"
    group.add_argument("--max-steps", type=flags.non_negative_int, default=max_steps, help=text)
    text = "clip the global gradient norm to this; 0 turns clipping off (default: %(default)s)"
    group.add_argument("--grad-clip", type=flags.non_negative_float, default=grad_clip, help=text)
    text = "deterministic kernels and no dropout, so runs at different world sizes can be compared step by step"
    group.add_argument("--deterministic", action="store_true", help=text)


def add_schedule_flags(parser: Parser, *, warmup_steps: int, min_lr_ratio: float, weight_decay: float) -> None:
    group = parser.add_argument_group("schedule")
    text = "steps of linear warm-up to the peak lr"
    group.add_argument("--warmup-steps", type=flags.non_negative_int, default=warmup_steps, help=text)
    text = "the cosine schedule ends at lr times this"
    group.add_argument("--min-lr-ratio", type=flags.probability, default=min_lr_ratio, help=text)
    text = "AdamW's decoupled weight decay"
    group.add_argument("--weight-decay", type=flags.non_negative_float, default=weight_decay, help=text)


def add_mnist_flags(parser: Parser, *, gamma: float) -> None:
    group = parser.add_argument_group("MNIST")
    text = "holds MNIST/raw/; downloaded there if missing"
    group.add_argument("--data-dir", type=flags.folder, default=Path("./data"), help=text)
    text = "train on generated 28x28 images instead of MNIST (smoke tests, no data needed)"
    group.add_argument("--synthetic", action="store_true", help=text)
    text = "images per rank per evaluation batch"
    group.add_argument("--test-batch-size", type=flags.positive_int, default=1000, help=text)
    group.add_argument("--gamma", type=flags.positive_float, default=gamma, help="StepLR's lr decay per epoch")


def add_transformer_flags(parser: Parser) -> None:
    group = parser.add_argument_group("transformer")
    group.add_argument("--model", choices=sorted(GPT_PRESETS), default="tiny", help="size preset")
    group.add_argument("--n-layer", type=flags.positive_int, help="override the preset's number of Blocks")
    group.add_argument("--n-head", type=flags.positive_int, help="override the preset's attention heads")
    group.add_argument("--d-model", type=flags.positive_int, help="override the preset's width")
    # At most 128 Ki tokens: attention scores at that length already take 64 GiB per head and sequence in fp32.
    context_length = flags.int_in_range(1, 2**17, name="context_length")
    group.add_argument("--block-size", type=context_length, help="override the preset's context length")
    group.add_argument("--dropout", type=flags.probability, default=0.0, help="dropout probability in every Block")
    text = "train character-level on this UTF-8 file instead of the synthetic Markov tokens"
    group.add_argument("--text-file", type=flags.existing_file, help=text)
    text = (
        "train on a file of token ids that python -m tools.runs.prepare_tokens wrote, read a window at a time: a "
        "corpus of any size; its last 10%% is held out"
    )
    group.add_argument("--token-file", type=flags.existing_file, metavar="TOKENS", help=text)
    text = "synthetic training sequences"
    group.add_argument("--train-sequences", type=flags.positive_int, default=20_000, help=text)
    text = "held-out sequences: synthetic ones, or the last windows of a --token-file, at most a tenth of it"
    group.add_argument("--heldout-sequences", type=flags.positive_int, default=1_000, help=text)
    text = (
        "cut each synthetic sequence to 1 to --block-size tokens, drawn from the data's seed, and pad the rest "
        "(ignore_index), as real text of uneven lengths is; each token still weighs the same in the loss"
    )
    group.add_argument("--variable-length", action="store_true", help=text)
    text = "evaluate every this many steps"
    group.add_argument("--eval-interval", type=flags.positive_int, default=100, metavar="STEPS", help=text)
    text = "held-out sequences per rank per evaluation batch"
    group.add_argument("--eval-batch-size", type=flags.positive_int, default=100, help=text)
    add_fine_tuning_flags(parser)


def add_fine_tuning_flags(parser: Parser, *, title: str = "fine-tuning", alpha: bool = True) -> None:
    """The transformer scripts' fine-tuning flags, and the estimators' (without --lora-alpha: it changes no byte)."""
    tuning = parser.add_argument_group(title)
    text = (
        "train without the parameters whose names match this glob (repeatable): they keep their starting values "
        "(--init-from's) and get no gradient, no optimizer state and no all-reduce, e.g. --freeze 'tok_emb.*' --freeze "
        "'blocks.0.*'"
    )
    tuning.add_argument("--freeze", type=flags.name_pattern, action="append", default=[], metavar="PATTERN", help=text)
    text = (
        "train LoRA adapters of this rank beside the linear layers --lora-targets names, and freeze every other "
        "parameter; model.pt holds the adapters merged into the weights (default: no adapters)"
    )
    tuning.add_argument("--lora-rank", type=flags.positive_int, help=text)
    if alpha:
        text = "the adapters' update is scaled by alpha / rank (default: 2 x --lora-rank, a scale of 2)"
        tuning.add_argument("--lora-alpha", type=flags.positive_float, help=text)
    text = (
        "glob over module names: the linear layers that get adapters (repeatable; default: 'blocks.*.attn.*' and "
        "'blocks.*.mlp.*', every linear layer of the Blocks)"
    )
    tuning.add_argument("--lora-targets", type=flags.name_pattern, action="append", metavar="PATTERN", help=text)


def add_compute_flags(parser: Parser, *, precisions: list[str]) -> None:
    """How the transformer scripts compute: the same flags under DDP and FSDP, so they compare fairly."""
    group = parser.add_argument_group("compute")
    text = (
        "dtype of the matrix multiplications in forward and backward (DDP: torch.autocast; FSDP: the dtype its "
        "gathered parameters take); weights, optimizer state and gradient reduction stay fp32"
    )
    group.add_argument("--mixed-precision", choices=precisions, default="fp32", help=text)
    text = "keep only each Block's input in forward and recompute the rest in backward: less memory, more compute"
    group.add_argument("--activation-checkpointing", action="store_true", help=text)
    text = "torch.compile each Block (the first steps are slow while it compiles)"
    group.add_argument("--compile", action="store_true", help=text)
    text = (
        "AdamW's fused kernel, AdamW(fused=True): one kernel updates every parameter (default: torch's choice, its "
        "foreach kernels on GPUs)"
    )
    # None when not given, not False: AdamW(fused=False) would also turn its foreach kernels off.
    group.add_argument("--fused-adamw", action="store_true", default=None, help=text)
    text = (
        "the kernel every attention must use (torch.nn.attention.sdpa_kernel): flash (FlashAttention-2; bf16 or fp16 "
        "on GPUs), efficient and cudnn (GPUs only), math (plain operations) (default: torch's choice at every call)"
    )
    group.add_argument("--sdpa-backend", choices=["flash", "efficient", "cudnn", "math"], help=text)


def add_fsdp_flags(parser: Parser) -> None:
    group = parser.add_argument_group("FSDP")
    text = "keep the sharded parameters, gradients and optimizer state in host memory (CUDA runs only)"
    group.add_argument("--cpu-offload", action="store_true", help=text)
    text = (
        "hybrid sharding: R groups each hold a full sharded copy, shard within a group, all-reduce across groups; must "
        "divide the world size"
    )
    group.add_argument("--replicate-degree", type=flags.positive_int, metavar="R", help=text)


def add_fsdp1_flags(parser: Parser) -> None:
    group = parser.add_argument_group("FSDP1")
    strategies = ["full_shard", "shard_grad_op", "hybrid_shard", "no_shard"]
    text = (
        "full_shard: ZeRO-3, parameters too; shard_grad_op: ZeRO-2, parameters stay gathered between forward and "
        "backward; hybrid_shard: full_shard within a group, replicated across groups; no_shard: DDP"
    )
    group.add_argument("--sharding-strategy", choices=strategies, default="full_shard", help=text)
    text = (
        "when to all-gather the next unit's parameters in backward: before (pre) or after (post) the current unit's "
        "gradient computation, or not ahead of time (none)"
    )
    group.add_argument("--backward-prefetch", choices=["pre", "post", "none"], default="pre", help=text)


def add_fsdp2_flags(parser: Parser) -> None:
    group = parser.add_argument_group("FSDP2")
    text = (
        "free each Block's gathered parameters after its forward and gather them again for backward; "
        "--no-reshard-after-forward keeps them (ZeRO-2-like: more memory, one all-gather less per step)"
    )
    group.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True, help=text)


def add_checkpoint_flags(parser: Parser, *, sharded: bool, asynchronous: bool = False) -> None:
    """Checkpoint and resume flags; ``sharded`` adds --checkpoint-format (the FSDP scripts), ``asynchronous``
    --async-checkpoint (the transformer scripts)."""
    group = parser.add_argument_group("checkpoints")
    text = (
        "save a checkpoint into RUN_DIR/checkpoints every this many steps; 0: only when asked to stop (SIGTERM, "
        "SIGUSR1 or a RUN_DIR/STOP file) (default: %(default)s)"
    )
    group.add_argument("--checkpoint-interval", type=flags.non_negative_int, default=0, metavar="STEPS", help=text)
    text = "keep the newest K checkpoints, delete older ones"
    group.add_argument("--keep-checkpoints", type=flags.positive_int, default=2, metavar="K", help=text)
    text = "continue from the newest checkpoint in --run-dir; start from step 0 if there is none"
    group.add_argument("--resume", action="store_true", help=text)
    text = "continue from this checkpoint (RUN_DIR/checkpoints/step-N)"
    group.add_argument("--resume-from", type=flags.existing_path, metavar="PATH", help=text)
    text = (
        "start from these weights: a state dict of this model (a run's model.pt, or python -m "
        "tools.runs.export_checkpoint's output), at step 0 with a fresh optimizer; with --resume, a checkpoint in "
        "--run-dir comes first"
    )
    group.add_argument("--init-from", type=flags.existing_path, metavar="PATH", help=text)
    if asynchronous:
        text = (
            "write each checkpoint in the background while training goes on: a step waits only while the state is "
            "copied; sharded (torch.distributed.checkpoint's async_save), so under DDP too"
        )
        group.add_argument("--async-checkpoint", action="store_true", help=text)
    if sharded:
        text = (
            "sharded: each rank writes its own shard (torch.distributed.checkpoint), resumable at another world size; "
            "full: rank 0 gathers everything into one file"
        )
        group.add_argument("--checkpoint-format", choices=["sharded", "full"], default="sharded", help=text)
        add_trust_flag(group)


def add_trust_flag(group: argparse._ActionsContainer) -> None:
    """--trust-checkpoint, for the training scripts and tools.runs.export_checkpoint alike."""
    text = (
        "load a sharded checkpoint even if its .metadata holds more than DCP's own records; that file is a pickle, so "
        "this runs whatever code it names: only for checkpoints from someone you trust"
    )
    group.add_argument("--trust-checkpoint", action="store_true", help=text)
