"""What each rank sends per optimizer step, under DDP and each FSDP strategy, and how long it takes.

    python -m tools.estimates.estimate_communication --params 1e9 7e9 70e9 --world-size 8 --precision bf16
    python -m tools.estimates.estimate_communication --params 7e9 --world-size 16 --shard-group-size 8 \\
        --grad-accum-steps 4
    python -m tools.estimates.estimate_communication --model small --world-size 2 --lora-rank 4
    python -m tools.estimates.estimate_communication --model medium --world-size 1024 --tp-degree 8 --precision bf16

The formulas, and how FSDP pads its messages: modelled_collectives.py. With --params the model is that many
parameters in --layers equal units; with --model it is the scripts' GPT, its Blocks the units, and each row is
what that script's run records (``local_state_bytes``, ``comm_bytes_per_step``), --freeze and --lora-rank
included; --tp-degree adds FSDP2 + tensor parallelism's (tools.estimates.tensor_parallel).
"""

from __future__ import annotations

import argparse
from collections import Counter

from common.cli import HelpFormatter
from common.collectives import Traffic
from common.flags import existing_file, int_in_range, positive_float, positive_int
from common.models import GPT_PRESETS, GPTConfig
from tools.command_flags import (
    context_length,
    head_count,
    micro_batch_size,
    refuse_too_many_ranks,
    unit_count,
    vocabulary_size,
    width,
)
from tools.estimates.estimate_memory import (
    DEFAULT_BATCH,
    GIB,
    GPT_SHAPE_FLAGS,
    LAYOUTS,
    MIB,
    SYNTHETIC_VOCAB,
    StateBytes,
    add_job_flags,
    between_steps,
    count_label,
    gpt_shape,
    resolve_shard_group_size,
    shard_group_for,
)
from tools.estimates.in_flight import STRATEGIES
from tools.estimates.measured_links import CommCheck
from tools.estimates.modelled_collectives import model_collectives, run_collectives, step_seconds
from tools.estimates.shard_sizes import COMPUTE_BYTES
from tools.estimates.tensor_parallel import TensorParallel, as_fsdp2, check_degree, group_collectives, group_degree
from tools.model_shapes import ParameterShapes, add_estimator_flags, estimator_shapes, fine_tuned_shapes
from tools.strategies import named


def estimate_table(args: argparse.Namespace, check: CommCheck | None = None) -> str:
    """One row per model size and strategy: what a rank holds, what it sends, how long that takes; with
    ``check``, also how long at the bus bandwidths it measured."""
    machines = args.world_size // args.shard_group_size
    measured_header = f" measured: {check.label()} |" if check else ""
    lines = [
        "| parameters | strategy | ranks per copy | held GiB | all-gather GiB | reduce-scatter GiB | all-reduce GiB "
        f"| sent per link GiB | one machine, {args.fast_gbps:g} GB/s | {machines} machine(s), {args.slow_gbps:g} GB/s "
        f"between | compute, for scale |{measured_header}",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if check else ""),
    ]
    fast, slow = args.fast_gbps * 1e9, args.slow_gbps * 1e9
    for params in args.params:
        compute_s = 6 * params * args.tokens_per_gpu / (args.tflops * 1e12)
        for strategy in STRATEGIES:
            group = shard_group_for(strategy, args.world_size, args.shard_group_size)
            held = between_steps([(round(params),)], group, "replicated" if group == 1 else "flat").total
            collectives = model_collectives(
                strategy, params, args.layers, args.world_size, args.shard_group_size, args.precision, args.micro_steps
            )
            traffic = Traffic.of(collectives)
            sent = [traffic.bytes.get(kind, 0) / GIB for kind in ("all_gather", "reduce_scatter", "all_reduce")]
            one_machine = step_seconds(strategy, traffic, fast, slow, spans_machines=False)
            across = step_seconds(strategy, traffic, fast, slow, spans_machines=machines > 1)
            measured = f" {_precise_seconds(check.step_seconds(collectives))} |" if check else ""
            lines.append(
                f"| {count_label(params)} | {strategy} | {group} | {held / GIB:.1f} | "
                + " | ".join(f"{s:.1f}" for s in sent)
                + f" | {traffic.total_ring_bytes / GIB:.1f} | {_seconds(one_machine)} | {_seconds(across)} "
                f"| {_seconds(compute_s)} |{measured}"
            )
    return "\n".join(lines)


# With --model: each script's run, by the "strategy" its final record names, and the textbook row it is.
RUN_STRATEGIES = {
    strategy.name: strategy.textbook
    for strategy in named("ddp", "fsdp1_full_shard", "fsdp1_shard_grad_op", "fsdp1_hybrid_shard", "fsdp2")
}


def model_estimates(args: argparse.Namespace) -> dict[str, tuple[int, StateBytes, list[tuple[str, int, int]]]]:
    """With --model, by run strategy: ranks per copy, what a rank holds between steps, and one step's
    collectives, as that script's run with the same flags records them."""
    model: ParameterShapes = args.shapes
    estimates = {}
    for strategy, textbook in RUN_STRATEGIES.items():
        group = shard_group_for(textbook, args.world_size, args.shard_group_size)
        held = between_steps(model.shapes, group, LAYOUTS[strategy], model.trainable, args.precision)
        collectives = run_collectives(
            strategy, model.shapes, args.world_size, group, args.precision, args.micro_steps, trainable=model.trainable
        )
        estimates[strategy] = (group, held, collectives)
    if args.tp_degree is not None:
        estimates["fsdp2_tp"] = tensor_parallel_estimate(args)
    return estimates


def tensor_parallel_estimate(args: argparse.Namespace) -> tuple[int, StateBytes, list[tuple[str, int, int]]]:
    """``model_estimates``'s row for fsdp/train_transformer_fsdp2_tp.py in groups of --tp-degree ranks: FSDP2
    shards each rank's pieces over the world / --tp-degree groups, and each group trains --batch-size sequences.
    Every rank of the job holds pieces of one copy: its ranks per copy are the world size."""
    model: ParameterShapes = args.shapes
    dp = args.world_size // args.tp_degree
    pieces, layout = as_fsdp2(model.shapes, "tp", args.tp_degree)
    held = between_steps(pieces, dp, layout, model.trainable, args.precision)
    collectives = run_collectives(
        "fsdp2_tp",
        model.shapes,
        args.world_size,
        dp,
        args.precision,
        args.micro_steps,
        trainable=model.trainable,
        tp=job_tensor_parallel(args),
    )
    return args.world_size, held, collectives


def job_tensor_parallel(args: argparse.Namespace) -> TensorParallel:
    """The job's groups of --tp-degree ranks, each training --batch-size sequences a micro-step."""
    return TensorParallel(args.tp_degree, args.batch_size, args.block_size, args.d_model)


def tensor_parallel_seconds(
    collectives: list[tuple[str, int, int]],
    inside_groups: list[tuple[str, int, int]],
    machine: int,
    fast: float,
    slow: float,
    spans: bool,
) -> float:
    """fsdp2_tp's step time: tensor parallelism's collectives (``inside_groups``, among ``collectives``) stay
    inside a machine of ``machine`` ranks when one holds a group; the rest, FSDP2's across the groups, run as
    full_shard's. Told apart by kind and group size, FSDP2's over as many data-parallel groups as a TP group has
    ranks were once priced at the fast links."""
    degree = max((group for _, _, group in inside_groups), default=1)
    if degree > machine:
        inside_groups = []
    rest = Counter(collectives)
    rest.subtract(Counter(inside_groups))
    across = Traffic.of(rest.elements())
    return Traffic.of(inside_groups).total_ring_bytes / fast + step_seconds("full_shard", across, fast, slow, spans)


def model_table(args: argparse.Namespace, check: CommCheck | None = None) -> str:
    """``estimate_table`` for the scripts' GPT, one row per script's strategy, in MiB: the runs' own figures."""
    machines = args.world_size // args.shard_group_size
    lines = [
        "| strategy | ranks per copy | params MiB | grads MiB | optimizer MiB | all-gather MiB | reduce-scatter MiB "
        f"| all-reduce MiB | sent per link MiB | one machine, {args.fast_gbps:g} GB/s | {machines} machine(s), "
        f"{args.slow_gbps:g} GB/s between |" + (f" measured: {check.label()} |" if check else ""),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if check else ""),
    ]
    fast, slow = args.fast_gbps * 1e9, args.slow_gbps * 1e9
    for strategy, (group, held, collectives) in model_estimates(args).items():
        traffic = Traffic.of(collectives)
        sent = [traffic.bytes.get(kind, 0) for kind in ("all_gather", "reduce_scatter", "all_reduce")]
        if strategy == "fsdp2_tp":
            compute_bytes = COMPUTE_BYTES.get(args.precision, 2)
            shapes: ParameterShapes = args.shapes
            inside = group_collectives(
                shapes.shapes, job_tensor_parallel(args), compute_bytes, args.micro_steps, shapes.trainable
            )
            times = [
                tensor_parallel_seconds(collectives, inside, args.shard_group_size, fast, slow, spans)
                for spans in (False, machines > 1)
            ]
        else:
            times = [
                step_seconds(RUN_STRATEGIES[strategy], traffic, fast, slow, spans_machines=spans)
                for spans in (False, machines > 1)
            ]
        one_machine, across = times
        measured = f" {_precise_seconds(check.step_seconds(collectives))} |" if check else ""
        lines.append(
            f"| {strategy} | {group} | "
            + " | ".join(f"{value / MIB:.2f}" for value in [*held.as_dict().values(), *sent])
            + f" | {traffic.total_ring_bytes / MIB:.2f} | {_precise_seconds(one_machine)} "
            + f"| {_precise_seconds(across)} |{measured}"
        )
    return "\n".join(lines)


def _precise_seconds(value: float | None) -> str:
    """Three significant digits: a small model's step on a CPU check takes milliseconds."""
    if value is None:
        return "n/a (a kind it did not measure)"
    return f"{value * 1000:.3g} ms" if value < 1 else f"{value:.3g} s"


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.1f} s"


# The estimate lists every unit's collectives in every micro-step: these bounds keep that list small
# (10,000 units x 1,024 micro-steps took 115 s and 2.6 GB; 100,000 pairs take no time to speak of).
micro_step_count = int_in_range(1, 1024, name="micro_step_count")
MAX_UNIT_STEPS = 100_000


# Each of GPT_SHAPE_FLAGS capped as in tools.estimates.estimate_memory; the Blocks for the time listing them takes.
SHAPE_TYPES = {
    "n_layer": unit_count,
    "n_head": head_count,
    "d_model": width,
    "block_size": context_length,
    "vocab_size": vocabulary_size,
}


def add_gpt_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("the scripts' GPT (instead of --params)")
    group.add_argument(
        "--model",
        choices=list(GPT_PRESETS),
        help="a GPT preset of the transformer scripts: its parameters replace --params, its Blocks --layers",
    )
    group.add_argument(
        "--tp-degree",
        type=positive_int,
        help="add the row of fsdp/train_transformer_fsdp2_tp.py, its tensor-parallel groups of this many ranks "
        "(inside a machine of --shard-group-size)",
    )
    group.add_argument(
        "--batch-size",
        type=micro_batch_size,
        help=f"with --tp-degree: sequences per group per micro-step, whose hidden states its all-reduces carry "
        f"(default: {DEFAULT_BATCH['gpt']}, the scripts')",
    )
    for flag in GPT_SHAPE_FLAGS:
        default = f"{SYNTHETIC_VOCAB}, the scripts' synthetic data" if flag == "vocab_size" else "the preset's"
        group.add_argument(
            f"--{flag.replace('_', '-')}",
            type=SHAPE_TYPES[flag],
            help=f"the scripts' flag of that name (default: {default})",
        )


def gpt_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> GPTConfig | None:
    """Exactly one of --params and --model; with --model, its GPT: the preset and the flags that override it,
    its Blocks the FSDP units (``args.layers``)."""
    if (args.params is None) == (args.model is None):
        parser.error("give --params (a model of that size) or --model (the scripts' GPT), one of them")
    if args.model is None:
        if any(getattr(args, flag) is not None for flag in GPT_SHAPE_FLAGS):
            parser.error("--n-layer, --n-head, --d-model, --block-size and --vocab-size shape --model's GPT")
        if args.tp_degree is not None or args.batch_size is not None:
            parser.error("--tp-degree and --batch-size need --model: tensor parallelism splits the GPT's Blocks")
        return None
    if args.batch_size is not None and args.tp_degree is None:
        parser.error("--batch-size sizes the tensor-parallel all-reduces: give --tp-degree with it")
    args.batch_size = args.batch_size or DEFAULT_BATCH["gpt"]
    config = gpt_shape(parser, args)
    args.layers = config.n_layer
    if args.tp_degree is not None:
        args.tp_degree = group_degree(args.tp_degree, args.world_size)
        try:
            check_degree(args.tp_degree, args.world_size, config.n_head, config.d_model, config.block_size)
        except ValueError as err:
            parser.error(str(err))
    return config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.estimates.estimate_communication",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    add_job_flags(parser, params_required=False)
    add_gpt_flags(parser)
    add_estimator_flags(parser)
    parser.add_argument(
        "--grad-accum-steps", dest="micro_steps", type=micro_step_count, default=1, help="K micro-steps per step"
    )
    parser.add_argument(
        "--fast-gbps",
        type=positive_float,
        default=450.0,
        help="GB/s per direction of a fast link (default: %(default)s, NVLink 4)",
    )
    parser.add_argument(
        "--slow-gbps",
        type=positive_float,
        default=12.5,
        help="GB/s of a slow link (default: %(default)s, 100 Gbit/s Ethernet)",
    )
    parser.add_argument(
        "--tokens-per-gpu",
        type=positive_float,
        default=16384,
        help="tokens per GPU per step, for the compute column (with --params)",
    )
    parser.add_argument(
        "--tflops",
        type=positive_float,
        default=400.0,
        help="achieved TFLOP/s per GPU, for the compute column with --params (default: "
        "%(default)s, about 40%% of an H100's dense bf16 peak)",
    )
    parser.add_argument(
        "--comm-check",
        type=existing_file,
        metavar="FILE",
        help="a comm check's JSON (python -m tools.checks.comm_check --out FILE): adds each step's time at the bus "
        "bandwidths it measured",
    )
    args = parser.parse_args(argv)
    resolve_shard_group_size(parser, args)
    refuse_too_many_ranks(parser, args)
    config = gpt_of(parser, args)
    if args.layers * args.micro_steps > MAX_UNIT_STEPS:
        units = "--layers" if config is None else "--n-layer"
        parser.error(
            f"{units} {args.layers} x --grad-accum-steps {args.micro_steps} is more than {MAX_UNIT_STEPS:,} "
            f"units' collectives to list; fewer {units} give the same bytes in larger messages"
        )
    args.shapes = estimator_shapes(parser, args, config)
    if config is not None:
        args.shapes = args.shapes or fine_tuned_shapes(config)
        args.description = (
            f"GPT {args.model} ({config.n_layer} Blocks of width {config.d_model}, vocabulary {config.vocab_size}, "
            f"{config.block_size} tokens of context): {args.shapes.numel:,} parameters, "
            f"{args.shapes.trainable_numel:,} of them trained"
        )
    try:
        args.check = CommCheck.load(args.comm_check) if args.comm_check else None
    except ValueError as err:
        parser.error(f"--comm-check {args.comm_check}: {err}")
    return args


def measured_note(check: CommCheck, world_size: int, machines: int) -> str:
    """How the measured column was computed, and where the check's ranks differ from the job's."""
    note = (
        f"\nmeasured: each collective's bytes per link over the bus bandwidth that the comm check measured for its "
        f"kind ({check.label()}, {check.device_name}),\nits time interpolated between the two message sizes around "
        "it (see CommCheck), summed over the step with nothing overlapped. DDP in buckets of 1 MiB, then 25 MiB."
    )
    if (check.nodes > 1) != (machines > 1):
        where = "several nodes" if check.nodes > 1 else "one node"
        note += (
            f"\nThe check ran on {where}, the job on {machines} machine(s): bus bandwidth carries over between "
            "numbers of ranks, not between the links inside a machine and those between machines."
        )
    elif check.world_size != world_size:
        note += f"\nThe check ran on {check.world_size} ranks, the job on {world_size}: bus bandwidth carries over."
    return note


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.shapes is not None:
        print(args.description)
    print(
        f"{args.world_size} GPUs, machines of {args.shard_group_size}, {args.precision} gathers, fp32 gradient "
        f"reduction, {args.layers} FSDP units, {args.micro_steps} micro-step(s) per step\n"
    )
    if args.shapes is None:
        print(estimate_table(args, args.check))
        print(
            "\nheld: model state per rank between steps (tools.estimates.estimate_memory). all-gather, reduce-scatter, "
            "all-reduce: message bytes per optimizer step."
        )
    else:
        print(model_table(args, args.check))
        print(
            "\nEach row is what that script's run records at its end: params, grads, optimizer: local_state_bytes "
            "of the rank that holds the most;\nall-gather, reduce-scatter, all-reduce: comm_bytes_per_step, the "
            "message bytes of one optimizer step (the script's scalar all-reduces included)."
        )
    print(
        "sent per link: what a ring algorithm sends from each rank. The times divide it by the bandwidth of the "
        "slowest link each collective crosses,\nas if nothing overlapped it (DDP and FSDP both hide much of it "
        "behind compute; rough: real collectives reach 70-90% of a link's peak)."
    )
    if args.shapes is None:
        print(f"compute: 6 x parameters x {args.tokens_per_gpu:g} tokens per GPU at {args.tflops:g} TFLOP/s.")
    if args.check:
        print(measured_note(args.check, args.world_size, args.world_size // args.shard_group_size))


if __name__ == "__main__":
    main()
