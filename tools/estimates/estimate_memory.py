"""How much memory each rank needs, under DDP and each FSDP strategy: model state, and a model's activations.

    python -m tools.estimates.estimate_memory --params 7e9 --world-size 8 --gpu-memory 80
    python -m tools.estimates.estimate_memory --params 1e9 7e9 70e9 --world-size 16 --shard-group-size 8 \\
        --precision bf16
    python -m tools.estimates.estimate_memory --model gpt2 --vocab-size 50257 --batch-size 8 --world-size 8 \
        --gpu-memory 80 --mixed-precision bf16 --activation-checkpointing
    python -m tools.estimates.estimate_memory --model medium --world-size 1024 --gpu-memory 80 --tp-degree 8

The optimizer is AdamW, as in every transformer script here. Per parameter, in bytes:

    held between steps (what the runs' "local_state_bytes" measures), on each rank
        DDP, no_shard          4 params + 4 grads + 8 Adam moments = 16 P
        full_shard, FSDP2      16 P / N                      N = ranks sharing one copy (the world size)
        shard_grad_op          16 P / N                      PyTorch reshards it after backward too
        hybrid_shard, HSDP     16 P / M                      M = --shard-group-size (ranks per replica)
      plus 4 bytes per parameter tensor for AdamW's "step" count.

bf16 mixed precision changes none of these: the scripts keep fp32 master weights, reduce gradients
in fp32 (``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)``) and keep Adam's moments in fp32;
only the copies gathered for computing are bf16. Those are the second term, "in flight" (tools.estimates.in_flight):
during backward, where a step peaks, FSDP holds c x (root unit + 2 Blocks) gathered (c x P under
shard_grad_op), c = 2 bytes for bf16 and 4 for fp32, padding included; DDP nothing, but under bf16
autocast the bf16 copies of the weights forward saved. The FSDP scripts hold no sharded gradients
during a step (zero_grad sets them to None); DDP's are its buckets (gradient_as_bucket_view), kept.

Activations, with --model: what a training step of that model holds beyond its weights, measured by
tools.estimates.activations (one fake forward and backward on the CPU, with the scripts' dtype and checkpointing;
DDP rows under autocast, FSDP rows with bf16 parameters) at --batch-size and --block-size: what forward
keeps for backward, and the most the backward adds at once (activations' gradients, logits' included;
under checkpointing, one Block rebuilt; under FSDP, a unit's unsharded gradients until its
reduce-scatter). The peak per rank is then

    model state held during the step + in flight + activations

Without --model there is nothing to measure: FSDP's in flight then adds one unit's fp32 gradients
(P / layers each, no root), and the table says what is left of the GPU for activations. Not counted
anywhere: the caching allocator's rounding and fragmentation, cuBLAS workspaces, NCCL's buffers, the
CUDA context, and AdamW's temporaries in its step (after the activations are freed).
tools.estimates.simulate measures one rank of a job of any size (fake process group, fake tensors); this
estimate is within 0.1% of it for DDP, FSDP1, FSDP2 and HSDP at 8 to 1,024 ranks.

The paper's ZeRO-2 (4P + 12P/N in fp32 terms) keeps whole parameters between steps; PyTorch's
SHARD_GRAD_OP does not, so its between-steps figure equals full_shard's and its cost shows up in
flight.
"""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from common.cli import HelpFormatter
from common.flags import positive_float, positive_int
from common.mnist import MnistNet
from common.models import GPT_PRESETS, GPTConfig, count_parameters
from tools import command_flags as sizes
from tools.estimates.activations import ActivationBytes, gpt_activations, mnist_activations
from tools.estimates.in_flight import STRATEGIES, GatheredUnits, gathered_units, in_flight_bytes, reduce_scatter_bytes
from tools.estimates.shard_sizes import COMPUTE_BYTES, StateBytes, between_steps
from tools.estimates.tensor_parallel import as_fsdp2, chained, check_degree, group_degree, one_rank_of_a_group
from tools.model_shapes import (
    add_estimator_flags,
    estimator_shapes,
    fine_tune,
    gpt_parameter_shapes,
    gpt_step_overflow,
    mnist_step_overflow,
)
from tools.strategies import STRATEGIES as RUN_STRATEGIES

GIB = 2**30
MIB = 2**20
MNIST = "mnist"
DEFAULT_LAYERS = 32  # FSDP units of a model given by --params alone
SYNTHETIC_VOCAB = 16  # the transformer scripts' default data, common.tokens.markov_data
# The scripts' default micro-batch, per rank.
DEFAULT_BATCH = {MNIST: 64, "gpt": 32}
GPT_SHAPE_FLAGS = ("n_layer", "n_head", "d_model", "block_size", "vocab_size")

# How each training script's "strategy" field shards its state (tools.strategies.Strategy.layout).
LAYOUTS = {strategy.name: strategy.layout for strategy in RUN_STRATEGIES}


@dataclass(frozen=True)
class Estimate:
    params: float
    strategy: str
    shard_group: int
    state: StateBytes
    in_flight: float
    activations: float | None = None  # None: no model to measure them on

    @property
    def held_in_step(self) -> int:
        """Model state during a step: the FSDP scripts' zero_grad sets the sharded gradients to None; DDP's
        gradients are its buckets, kept."""
        return self.state.total if self.strategy == "ddp" else self.state.params + self.state.optimizer

    @property
    def peak(self) -> float:
        """The model state at its peak: between steps, or held in a step plus in flight."""
        return max(self.state.total, self.held_in_step + self.in_flight)

    @property
    def peak_per_rank(self) -> float | None:
        if self.activations is None:
            return None
        return max(self.state.total, self.held_in_step + self.in_flight + self.activations)


def shard_group_for(strategy: str, world_size: int, hybrid_group: int) -> int:
    return {"ddp": 1, "full_shard": world_size, "shard_grad_op": world_size, "hybrid_shard": hybrid_group}[strategy]


def estimate_all(params: float, world_size: int, hybrid_group: int, layers: int, precision: str) -> list[Estimate]:
    """One estimate per strategy for a model of ``params`` parameters, counted as one flat tensor in ``layers``
    equal units, with no root."""
    count = round(params)
    unit = count / layers
    units = GatheredUnits(root=0, block=unit, blocks=layers, reduced=unit, trained=unit)
    estimates = []
    for strategy in STRATEGIES:
        group = shard_group_for(strategy, world_size, hybrid_group)
        layout = "replicated" if group == 1 else "flat"
        state = between_steps([(count,)], group, layout)
        in_flight = in_flight_bytes(strategy, units, precision, gradients=True)
        estimates.append(Estimate(count, strategy, group, state, in_flight))
    return estimates


def estimate_model(
    shapes: Mapping[str, Sequence[int]],
    strategy: str,
    shard_group: int,
    precision: str,
    activations: ActivationBytes,
    layout: str = "flat",
    trainable: Collection[str] | None = None,
    tp_degree: int = 1,
) -> Estimate:
    """The estimate for a GPT of these parameter shapes, its units gathered as ``layout`` pads them (FSDP1's
    "flat", FSDP2's "dim0", or "tp": FSDP2 over each rank's tensor-parallel pieces, groups of ``tp_degree``),
    with its measured activations: DDP's (``unit_gradients`` False) or FSDP's.
    ``trainable``: the names that train (None: all), as --freeze and --lora-rank leave them."""
    params = sum(math.prod(shape) for shape in shapes.values())
    pieces, layout = as_fsdp2(shapes, layout, tp_degree)  # what FSDP shards: a tensor-parallel rank's pieces
    alone = layout if shard_group == 1 else None  # a shard group of one: what FSDP gathers changes
    layout = "replicated" if shard_group == 1 else layout
    state = between_steps(pieces, shard_group, layout, trainable, precision)
    units = gathered_units(pieces, layout, shard_group, precision, trainable)
    in_flight = in_flight_bytes(strategy, units, precision, weight_copies=activations.weight_copies, alone=alone)
    if strategy != "ddp" and activations.unit_ends:
        in_flight += reduce_scatter_bytes(alone or layout, units, shard_group, precision, activations)
    return Estimate(params, strategy, shard_group, state, in_flight, activations.peak)


def count_label(params: float) -> str:
    """7e9 -> '7B', 1.3e8 -> '130M': how model sizes are usually named."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if params >= scale:
            return f"{params / scale:.3g}{suffix}"
    return f"{params:.0f}"


def estimate_table(estimates: Sequence[Estimate], gpu_bytes: float) -> str:
    """A markdown table: per-rank state between steps, in flight, activations, the peak, and what is left.

    Without activations (no model), "left" and "fits" are for the model state alone.
    """
    lines = [
        "| parameters | strategy | ranks per copy | params GiB | grads GiB | optimizer GiB | between steps GiB "
        "| in flight GiB | peak model state GiB | activations GiB | peak per rank GiB | left GiB | fits |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for e in estimates:
        peak = e.peak if e.peak_per_rank is None else e.peak_per_rank
        left = gpu_bytes - peak
        lines.append(
            f"| {count_label(e.params)} | {e.strategy} | {e.shard_group} | {e.state.params / GIB:.1f} "
            f"| {e.state.grads / GIB:.1f} | {e.state.optimizer / GIB:.1f} | {e.state.total / GIB:.1f} "
            f"| {e.in_flight / GIB:.1f} | {e.peak / GIB:.1f} | {gib_or_na(e.activations)} "
            f"| {gib_or_na(e.peak_per_rank)} | {left / GIB:.1f} | {'yes' if left > 0 else 'no'} |"
        )
    return "\n".join(lines)


def gib_or_na(value: float | None) -> str:
    return "n/a" if value is None else f"{value / GIB:.1f}"


def add_job_flags(parser: argparse.ArgumentParser, *, params_required: bool = True) -> None:
    """The model and the job, as this estimator and tools.estimates.estimate_communication both take them."""
    text = "parameters in the model, e.g. 7e9 (several: one row each)"
    parser.add_argument("--params", type=sizes.parameter_count, nargs="+", required=params_required, help=text)
    parser.add_argument("--world-size", type=positive_int, required=True, help="GPUs in the job")
    parser.add_argument(
        "--shard-group-size",
        type=positive_int,
        help="GPUs per machine: hybrid_shard's group sharing one sharded copy (default: gcd(world size, 8))",
    )
    parser.add_argument(
        "--precision",
        "--mixed-precision",
        dest="precision",
        choices=sorted(COMPUTE_BYTES),
        default="fp32",
        help="dtype FSDP gathers and computes in (the scripts' --mixed-precision)",
    )
    parser.add_argument(
        "--layers",
        type=sizes.layer_count,
        help=f"with --params: FSDP units (transformer blocks); one unit is params / layers (default: {DEFAULT_LAYERS})",
    )


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("activations: a model to measure them on (instead of --params)")
    group.add_argument(
        "--model",
        choices=[MNIST, *GPT_PRESETS],
        help="the scripts' model: a GPT preset (its parameters replace --params, its Blocks --layers) or the MNIST net",
    )
    group.add_argument("--n-layer", type=sizes.block_count, help="override the preset's number of Blocks")
    group.add_argument("--n-head", type=sizes.head_count, help="override the preset's attention heads")
    group.add_argument("--d-model", type=sizes.width, help="override the preset's width")
    group.add_argument("--block-size", type=sizes.context_length, help="override the preset's context length (tokens)")
    group.add_argument(
        "--vocab-size",
        type=sizes.vocabulary_size,
        help=f"the GPT's vocabulary (default: {SYNTHETIC_VOCAB}, the scripts' synthetic data; GPT-2's is 50257)",
    )
    group.add_argument(
        "--batch-size",
        type=sizes.micro_batch_size,
        help=f"sequences or images per rank per micro-step (default: the script's, "
        f"{DEFAULT_BATCH['gpt']} for the GPT and {DEFAULT_BATCH[MNIST]} for MNIST)",
    )
    group.add_argument(
        "--activation-checkpointing", action="store_true", help="each Block keeps only its input, as in the scripts"
    )
    group.add_argument(
        "--tp-degree",
        type=positive_int,
        help="add fsdp/train_transformer_fsdp2_tp.py's row, its Blocks split over groups of this many ranks",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    prog, description = "python -m tools.estimates.estimate_memory", __doc__.split("\n\n")[0]
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter)
    add_job_flags(parser, params_required=False)
    parser.add_argument("--gpu-memory", type=positive_float, required=True, help="memory of one GPU in GiB, e.g. 80")
    add_model_flags(parser)
    add_estimator_flags(parser)
    args = parser.parse_args(argv)
    if (args.params is None) == (args.model is None):
        parser.error("give --params (the model state alone) or --model (with its activations), one of them")
    sizes.refuse_too_many_ranks(parser, args)
    args.fine_tuning = estimator_shapes(parser, args, check_model_flags(parser, args))
    resolve_shard_group_size(parser, args)
    return args


def check_model_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> GPTConfig | None:
    """Refuse what the chosen model's scripts do not have; fill the GPT's shape from its preset. The GPT, if
    the model is one."""
    if args.model is None:
        if args.tp_degree is not None:
            parser.error("--tp-degree needs --model: tensor parallelism splits the GPT's Blocks, which --params lacks")
        given = [flag for flag in (*GPT_SHAPE_FLAGS, "batch_size") if getattr(args, flag) is not None]
        if given or args.activation_checkpointing:
            parser.error("activations need a model: add --model, or drop the model's flags")
        return None
    if args.batch_size is None:
        args.batch_size = DEFAULT_BATCH[MNIST if args.model == MNIST else "gpt"]
    if args.model == MNIST:
        if any(getattr(args, flag) is not None for flag in GPT_SHAPE_FLAGS):
            parser.error("--n-layer, --n-head, --d-model, --block-size and --vocab-size describe the GPT, not MNIST")
        if args.tp_degree is not None:
            parser.error("--tp-degree splits the GPT's Blocks, not the MNIST net")
        if args.precision != "fp32" or args.activation_checkpointing:
            parser.error("the MNIST scripts have neither --mixed-precision nor --activation-checkpointing")
        if (overflow := mnist_step_overflow(args.batch_size)) is not None:
            parser.error(overflow)
        return None
    config = gpt_shape(parser, args)
    if args.tp_degree is not None:
        args.tp_degree = group_degree(args.tp_degree, args.world_size)
    try:
        check_degree(
            args.tp_degree or 1, args.world_size, config.n_head, config.d_model, config.block_size, args.lora_rank
        )
    except ValueError as err:
        parser.error(str(err))
    return config


def gpt_shape(parser: argparse.ArgumentParser, args: argparse.Namespace) -> GPTConfig:
    """--model's GPT: its preset, with the shape flags given in place of the preset's, written back to ``args``."""
    for name, value in GPT_PRESETS[args.model].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.vocab_size is None:
        args.vocab_size = SYNTHETIC_VOCAB
    if args.d_model % args.n_head:
        parser.error(f"--d-model {args.d_model} must be divisible by --n-head {args.n_head}")
    config = GPTConfig(args.vocab_size, args.block_size, args.n_layer, args.n_head, args.d_model)
    # tools.estimates.estimate_communication shares this; its --batch-size sizes only the TP all-reduces.
    overflow = gpt_step_overflow(config, getattr(args, "batch_size", 1), getattr(args, "lora_rank", None))
    if overflow is not None:
        parser.error(overflow)
    return config


def resolve_shard_group_size(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--shard-group-size defaults to one machine of up to 8 GPUs, and must divide --world-size. --layers
    divides --params into units; a --model has its own."""
    if args.model is not None and args.layers is not None:
        parser.error("--layers divides --params into FSDP units; --model's units are its Blocks (--n-layer)")
    args.layers = DEFAULT_LAYERS if args.layers is None else args.layers
    if args.shard_group_size is None:
        args.shard_group_size = math.gcd(args.world_size, 8)
    if args.shard_group_size < 1 or args.world_size % args.shard_group_size:
        parser.error(f"--shard-group-size {args.shard_group_size} must divide --world-size {args.world_size}")


@dataclass(frozen=True)
class MeasuredModel:
    """A model of the scripts, described, and each strategy's estimate with its measured activations."""

    description: str
    layers: int
    estimates: list[Estimate]


def forward_of(strategy: str, precision: str) -> str:
    """How a strategy's script computes in ``precision`` (see tools.estimates.activations.FORWARDS)."""
    if precision == "fp32":
        return "fp32"
    return "autocast" if strategy == "ddp" else "param_dtype"


def measure_model(args: argparse.Namespace) -> MeasuredModel:
    """Measure the model's activations at the job's micro-batch, and estimate each strategy with them."""
    if args.model == MNIST:
        params = count_parameters(MnistNet())
        peak = mnist_activations(args.batch_size).peak
        estimates = estimate_all(params, args.world_size, args.shard_group_size, 1, args.precision)
        description = f"MNIST net, {args.batch_size} images per rank"
        return MeasuredModel(description, 1, [replace(e, activations=peak) for e in estimates])
    config = GPTConfig(args.vocab_size, args.block_size, args.n_layer, args.n_head, args.d_model)
    tuned, prepare = args.fine_tuning, None
    shapes, trainable = (tuned.shapes, tuned.trainable) if tuned else (gpt_parameter_shapes(config), None)
    if tuned is not None:
        prepare = functools.partial(
            fine_tune, freeze_patterns=args.freeze, lora_rank=args.lora_rank, lora_targets=args.lora_targets
        )
    measured: dict[tuple[str, bool], ActivationBytes] = {}  # every FSDP row computes and holds alike
    estimates = []
    for strategy in STRATEGIES:
        how = (forward_of(strategy, args.precision), strategy != "ddp")
        if how not in measured:
            measured[how] = gpt_activations(
                config,
                args.batch_size,
                checkpointing=args.activation_checkpointing,
                forward=how[0],
                unit_gradients=how[1],
                prepare=prepare,
            )
        group = shard_group_for(strategy, args.world_size, args.shard_group_size)
        estimates.append(estimate_model(shapes, strategy, group, args.precision, measured[how], trainable=trainable))
    if args.tp_degree is not None:  # FSDP2 over each rank's pieces, with the activations of what a rank computes
        split_blocks = functools.partial(one_rank_of_a_group, degree=args.tp_degree) if args.tp_degree > 1 else None
        local = chained(prepare, split_blocks)  # a world of one (degree 1) computes the whole model
        split = gpt_activations(
            config,
            args.batch_size,
            checkpointing=args.activation_checkpointing,
            forward=forward_of("full_shard", args.precision),
            unit_gradients=True,
            prepare=local,
        )
        dp = args.world_size // args.tp_degree
        split = estimate_model(shapes, "full_shard", dp, args.precision, split, "tp", trainable, args.tp_degree)
        estimates.append(replace(split, strategy="fsdp2_tp", shard_group=args.world_size))
    description = (
        f"GPT {args.model} ({args.n_layer} Blocks of width {args.d_model}, vocabulary {args.vocab_size}), "
        f"{args.batch_size} sequences of {args.block_size} tokens per rank"
        + (", activation checkpointing" if args.activation_checkpointing else "")
    )
    return MeasuredModel(description, args.n_layer, estimates)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    measured = measure_model(args) if args.model is not None else None
    layers = measured.layers if measured is not None else args.layers
    if measured is None:
        estimates = [
            estimate
            for params in args.params
            for estimate in estimate_all(params, args.world_size, args.shard_group_size, layers, args.precision)
        ]
    else:
        estimates = measured.estimates
        print(measured.description)
    tuned = args.fine_tuning
    print(
        f"{args.world_size} GPUs of {args.gpu_memory:g} GiB, AdamW, {args.precision} compute, "
        f"{layers} FSDP units, hybrid groups of {args.shard_group_size}\n"
    )
    print(estimate_table(estimates, args.gpu_memory * GIB))
    print(
        "\nbetween steps: fp32 weights, gradients and Adam moments of the rank's shard, as the runs' "
        "local_state_bytes count them."
        "\nin flight: what is gathered during backward, where a step peaks: FSDP's root unit and two Blocks, "
        "DDP's bf16 weight copies under autocast" + ("." if measured else "; FSDP's adds one unit's gradients (rough).")
    )
    if tuned is not None:
        print(
            f"\nfine-tuning: {tuned.trainable_numel:,} of {tuned.numel:,} values train. Per rank between steps, "
            "MiB, as the runs' final records count them (local_state_bytes):"
        )
        rows = {"ddp": ("replicated", 1), "fsdp1": ("flat", args.world_size), "fsdp2": ("dim0", args.world_size)}
        for strategy, (layout, group) in rows.items():
            held = between_steps(tuned.shapes, group, layout, tuned.trainable, args.precision).as_dict()
            print(f"  {strategy:<6}", ", ".join(f"{kind} {value / MIB:.2f}" for kind, value in held.items()))
    if measured is None:
        print("Activations are NOT included (they need --model): they must fit in what is left.")
        return
    per_strategy = ", ".join(f"{e.strategy} {e.activations / MIB:,.1f} MiB" for e in measured.estimates)
    recomputed = ", one Block recomputed" if args.activation_checkpointing else ""
    print(
        f"activations: what forward keeps for backward and the most backward adds to it (gradients{recomputed}), "
        f"measured: {per_strategy}.\npeak per rank: state held during the step (FSDP: no sharded gradients) + "
        "in flight + activations. Not in it: the allocator's fragmentation, cuBLAS workspaces, NCCL buffers."
    )


if __name__ == "__main__":
    main()
