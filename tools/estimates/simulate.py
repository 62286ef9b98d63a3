"""One rank of an N-rank job, on one CPU: what it holds and sends, measured by running the scripts' own wrap.

    python -m tools.estimates.simulate --world-size 1024 --strategy fsdp2 --model gpt2 --out fsdp2-1024.json
    python -m tools.estimates.simulate --model medium gpt2 --world-size 8 64 256 1024 --strategy ddp fsdp1 fsdp2 hsdp
    python -m tools.estimates.simulate --model medium --world-size 1024 --strategy fsdp2 fsdp2_tp --tp-degree 8

The transformer script of the strategy wraps its model with its own ``wrap_model`` (the real DDP, FSDP1 or
fully_shard: their buckets, flat parameters and padding; fsdp2_tp's parallelize_module first) on torch's fake
process group, whose collectives return at once, and fake tensors, which have shapes and sizes but no memory. The
steps run as the script runs them (zero_grad, forward, loss, backward, clipping, AdamW), and one is
measured as the runs measure theirs (see ``warm_up``). For the rank: its parameter, gradient and
optimizer bytes after the step, the peak of its live tensors' bytes during it, and each collective
(common.collectives's recorder), beside what estimate_memory and estimate_communication
predict for the same job. Several values of --world-size, --strategy or --model: one job each, a table
(and with --png, state per rank by world size, drawn). --freeze, --lora-rank: as the scripts fine-tune.

What the fake world cannot do without help, tools.estimates.fake_world provides, without changing the wrap.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from common.cli import HelpFormatter, add_fine_tuning_flags
from common.collectives import Traffic, measured_step
from common.distributed import DistContext, local_state_bytes
from common.fine_tuning import add_adapters, freeze
from common.flag_checks import ONE_RANK_SHARD_GROUPS
from common.flags import non_negative_int, positive_int
from common.models import GPT, GPT_PRESETS, GPTConfig, gpt_config
from common.outputs import write_text
from tools.command_flags import (
    micro_batch_size,
    output_file,
    positive_int_up_to,
    refuse_outputs_on_one_path,
    vocabulary_size,
)
from tools.estimates import estimate_memory, modelled_collectives
from tools.estimates.activations import gpt_activations
from tools.estimates.fake_world import StepRecorder, all_reduced_bucket, fake_world, held_tensors
from tools.estimates.tensor_parallel import TensorParallel, chained, check_degree, group_degree, one_rank_of_a_group
from tools.model_shapes import ParameterShapes, estimator_shapes, fine_tune, fine_tuned_shapes, gpt_step_overflow
from tools.output_checks import add_overwrite_flag, check_output_path
from tools.runs.plot import check_figure_path, draw_scale, save_figure_or_exit
from tools.strategies import BY_NAME, TP_DEGREE

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = {  # --strategy's names, each run by the script of its rows in tools.strategies
    "ddp": BY_NAME["ddp"].script,
    "fsdp1": BY_NAME["fsdp1_full_shard"].script,
    "fsdp2": BY_NAME["fsdp2"].script,
    "hsdp": BY_NAME["fsdp2_hsdp"].script,
    "fsdp2_tp": BY_NAME["fsdp2_tp"].script,
}
MIB = 2**20
SYNTHETIC_VOCAB = estimate_memory.SYNTHETIC_VOCAB  # the scripts' default data
HSDP_SHARD_GROUP = 8  # one machine of 8 GPUs shards a copy, by default


def warm_up(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    args: argparse.Namespace,
    ctx: DistContext,
    batch: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """The steps before the measured one: two, as the runs take (their third is measured, after FSDP's lazy
    initialisation). DDP's bucket rebuild after its first synchronised step reads an order the ranks
    agreed on, which fake tensors do not hold, so DDP's measured step is its first synchronised one, after
    one under no_sync that gives AdamW its state; its gradients are then dropped, and come back during
    the measured step as views of DDP's buckets (first seen when its backward fills them)."""
    if args.strategy != "ddp":
        for _ in range(measured_step(0) - 1):
            training_step(model, optimizer, args, ctx, batch)
        return
    with model.no_sync():
        training_step(model, optimizer, args, ctx, batch)
    optimizer.zero_grad(set_to_none=True)


# fully_shard cuts each fake parameter into N pieces, so a job's time grows with N, its memory hardly: the tiny
# preset took 92 CPU-s at 16,384 ranks (23 at 4,096), gpt2 27 at 1,024 (docs/memory.md); 65,536 would take gpt2
# about 25 minutes. The estimators answer for any size at once.
MAX_RANKS = 2**14


world_size_type = positive_int_up_to(
    MAX_RANKS,
    "ranks",
    "a simulation's time grows with its ranks (gpt2 takes minutes at 16,384); tools.estimates.estimate_memory and "
    "tools.estimates.estimate_communication answer for any size",
    name="world_size",
)


class Progress:
    """A job's progress on stderr (the table goes to stdout): a line as it starts, one as it ends with each phase's
    time. fully_shard cutting gpt2 into thousands of pieces takes minutes, with nothing else to show for it."""

    def __init__(self, index: int, count: int, job: argparse.Namespace) -> None:
        self.name = f"simulate: job {index}/{count}"
        self.times: dict[str, float] = {}
        self.last = self.started = time.perf_counter()
        self.say(
            f"{self.name}, {job.model} {job.strategy} at {job.world_size:,} ranks: wrapping the model, then stepping"
        )

    def phase(self, name: str) -> None:
        now = time.perf_counter()
        self.times[name], self.last = now - self.last, now

    def done(self) -> None:
        phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.times.items())
        self.say(f"{self.name} done in {time.perf_counter() - self.started:.1f} s ({phases})")

    @staticmethod
    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.estimates.simulate", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    text = "ranks in the simulated job (several: a table)"
    parser.add_argument("--world-size", type=world_size_type, nargs="+", required=True, help=text)
    text = "the script and its sharding (several: a table)"
    parser.add_argument("--strategy", choices=sorted(SCRIPTS), nargs="+", required=True, help=text)
    parser.add_argument(
        "--model", choices=sorted(GPT_PRESETS), nargs="+", default=["tiny"], help="size preset (default: tiny)"
    )
    parser.add_argument(
        "--replicate-degree",
        type=positive_int,
        help="copies of the model (hsdp: default world size / gcd(world size, 8), one copy per 8 ranks; fsdp1: "
        "hybrid_shard with this many copies; fsdp2: 1)",
    )
    parser.add_argument(
        "--mixed-precision", choices=["fp32", "bf16"], default="fp32", help="compute dtype (default: fp32)"
    )
    parser.add_argument(
        "--tp-degree",
        type=positive_int,
        help=f"fsdp2_tp: ranks per tensor-parallel group, which split each Block (default: {TP_DEGREE})",
    )
    parser.add_argument("--rank", type=non_negative_int, default=0, help="the rank simulated (default: 0)")
    text = "sequences per rank per step (default: the script's)"
    parser.add_argument("--batch-size", type=micro_batch_size, help=text)
    text = "the data's vocabulary (default: %(default)s)"
    parser.add_argument("--vocab-size", type=vocabulary_size, default=SYNTHETIC_VOCAB, help=text)
    add_fine_tuning_flags(parser, title="fine-tuning, as the transformer scripts take it", alpha=False)
    parser.add_argument("--out", type=output_file, help="write the figures here as JSON (several jobs: a list)")
    parser.add_argument("--png", type=output_file, help="draw state per rank by world size here (.png or .svg)")
    add_overwrite_flag(parser)
    args = parser.parse_args(argv)
    if args.tp_degree is not None and "fsdp2_tp" not in args.strategy:  # None: not given, so not ignored unseen
        parser.error(f"--tp-degree is for --strategy fsdp2_tp, not {' '.join(args.strategy)}: add it, or drop the flag")
    args.tp_degree = args.tp_degree or TP_DEGREE
    refuse_outputs_on_one_path(parser, args)
    if args.out is not None:
        check_output_path(parser, args.out, "--out", overwrite=args.overwrite)
    if args.png is not None:
        check_figure_path(parser, args.png, "--png", args.overwrite)
    try:
        args.jobs = [job(args, n, s, m) for m in args.model for n in args.world_size for s in args.strategy]
    except ValueError as err:
        parser.error(str(err))
    for model in args.model:  # a --freeze or --lora-targets that the scripts would refuse, refused here
        config = GPTConfig(vocab_size=args.vocab_size, **GPT_PRESETS[model])
        overflow = gpt_step_overflow(config, args.batch_size or estimate_memory.DEFAULT_BATCH["gpt"], args.lora_rank)
        if overflow is not None:
            parser.error(overflow)
        estimator_shapes(parser, args, config)
    return args


def job(args: argparse.Namespace, world_size: int, strategy: str, model: str) -> argparse.Namespace:
    """One simulated job of the command line's lists; ValueError for one that cannot be simulated."""
    if args.rank >= world_size:
        raise ValueError(f"--rank {args.rank} is not a rank of a world of {world_size}")
    replicate_degree = args.replicate_degree
    if replicate_degree is None:
        replicate_degree = world_size // math.gcd(world_size, HSDP_SHARD_GROUP) if strategy == "hsdp" else 1
    elif strategy in ("ddp", "fsdp2", "fsdp2_tp") and replicate_degree != 1:
        raise ValueError(f"--replicate-degree is for hsdp and fsdp1 (hybrid_shard), not {strategy}")
    if world_size % replicate_degree:
        raise ValueError(f"--replicate-degree {replicate_degree} does not divide --world-size {world_size}")
    if strategy == "fsdp1" and replicate_degree > 1 and replicate_degree == world_size:
        raise ValueError(ONE_RANK_SHARD_GROUPS.format(replicate=replicate_degree))
    if strategy == "fsdp1" and (args.freeze or args.lora_rank):
        # Its fake flat parameters lose the units with nothing to train (measured: half the bytes held).
        raise ValueError("--freeze and --lora-rank are simulated for ddp, fsdp2 and hsdp, not fsdp1")
    # The ranks of a tensor-parallel group, refused where the script refuses.
    tp_degree = group_degree(args.tp_degree, world_size) if strategy == "fsdp2_tp" else 1
    preset = GPT_PRESETS[model]
    check_degree(tp_degree, world_size, preset["n_head"], preset["d_model"], preset["block_size"], args.lora_rank)
    return argparse.Namespace(
        world_size=world_size,
        strategy=strategy,
        model=model,
        replicate_degree=replicate_degree,
        mixed_precision=args.mixed_precision,
        rank=args.rank,
        tp_degree=tp_degree,
        batch_size=args.batch_size,
        vocab_size=args.vocab_size,
        # fine_tune's arguments, by name
        fine_tuning={"freeze_patterns": args.freeze, "lora_rank": args.lora_rank, "lora_targets": args.lora_targets},
    )


def script_argv(args: argparse.Namespace) -> list[str]:
    """The flags that give the script the simulated job's model and sharding."""
    argv = ["--device", "cpu", "--model", args.model, "--mixed-precision", args.mixed_precision]
    if args.batch_size is not None:
        argv += ["--batch-size", str(args.batch_size)]
    if args.strategy == "hsdp" or (args.strategy == "fsdp1" and args.replicate_degree > 1):
        argv += ["--replicate-degree", str(args.replicate_degree)]
    if args.strategy == "fsdp1" and args.replicate_degree > 1:
        argv += ["--sharding-strategy", "hybrid_shard"]
    if args.strategy == "fsdp2_tp":
        argv += ["--tp-degree", str(args.tp_degree)]
    tuning = args.fine_tuning
    argv += [flag for pattern in tuning["freeze_patterns"] for flag in ("--freeze", pattern)]
    argv += ["--lora-rank", str(tuning["lora_rank"])] if tuning["lora_rank"] else []
    argv += [flag for pattern in tuning["lora_targets"] or [] for flag in ("--lora-targets", pattern)]
    return argv


def record_strategy(args: argparse.Namespace) -> str:
    """The strategy as a run's final record names it (what the estimators take)."""
    if args.strategy == "fsdp1":
        return "fsdp1_hybrid_shard" if args.replicate_degree > 1 else "fsdp1_full_shard"
    if args.strategy == "hsdp" and args.replicate_degree > 1:
        return "fsdp2_hsdp"
    if args.strategy == "fsdp2_tp":
        return "fsdp2_tp"
    return "ddp" if args.strategy == "ddp" else "fsdp2"  # HSDP of one replica (8 ranks or fewer by default) is FSDP2


def training_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    args: argparse.Namespace,
    ctx: DistContext,
    batch: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """One optimizer step as the strategy's script takes it (one micro-step, a step that does not log)."""
    inputs, targets = batch
    optimizer.zero_grad(set_to_none=args.strategy != "ddp")  # DDP keeps its gradients as bucket views
    with args.script_loss():  # DDP's autocast is its wrap's (wrap_model), as in the script
        logits = model(inputs)
        summed = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        loss = summed * ctx.world_size / (targets.numel() * ctx.world_size)
        loss.backward()
    if args.strategy == "fsdp1":
        model.clip_grad_norm_(1.0)
    elif args.strategy == "fsdp2_tp":  # its gradients live on two meshes, which torch's clipping cannot stack
        args.script_clip(model.parameters(), 1.0)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if hasattr(norm, "full_tensor"):
            norm.full_tensor()
    optimizer.step()


def simulate(args: argparse.Namespace, progress: Progress | None = None) -> dict[str, Any]:
    """The figures of one rank: measured (its own state, peak and collectives) and the estimators'."""
    script = runpy.run_path(str(REPO / SCRIPTS[args.strategy]))
    wrap_model = script["wrap_model"]
    args.script_clip = getattr(script.get("tp"), "clip_grad_norm_over_meshes", None)  # the TP script's helpers'
    # The TP script's logits are split over the vocabulary: its loss runs under loss_parallel, backward too.
    args.script_loss = script.get("loss_parallel", contextlib.nullcontext)
    # The torchrun variables the script's flag checks read, for the simulated rank.
    with mock.patch.dict(
        os.environ,
        WORLD_SIZE=str(args.world_size),
        RANK=str(args.rank),
        LOCAL_WORLD_SIZE=str(args.world_size),
        MASTER_ADDR="fake",
    ):
        script_args, _ = script["parse_args"](script_argv(args))
    config = gpt_config(script_args, args.vocab_size)
    with (
        mock.patch.dict(os.environ, RANK=str(args.rank)),  # the wrap prints on rank 0 only (print0)
        fake_world(args.world_size, args.rank, wrap_model.__globals__) as ctx,
        FakeTensorMode(allow_non_fake_inputs=True),
    ):
        # Built as each script builds it, but FSDP1's on fake CPU tensors (see the module's docstring).
        if args.strategy == "ddp":
            model = GPT(config, seed=script_args.seed)
        elif args.strategy == "fsdp1":
            model = GPT(config, seed=None)
        else:
            with torch.device("meta"):
                model = GPT(config, seed=None)
        add_adapters(model, script_args.lora_rank, script_args.lora_alpha, script_args.lora_targets, script_args.seed)
        freeze(model, script_args.freeze)
        model = wrap_model(model, script_args, ctx)
        if progress is not None:
            progress.phase("wrap")
        if args.strategy == "ddp":
            model.register_comm_hook(None, all_reduced_bucket)
        optimizer = torch.optim.AdamW(model.parameters(), lr=script_args.lr, weight_decay=script_args.weight_decay)
        shape = (script_args.batch_size, script_args.block_size)
        batch = (torch.randint(0, args.vocab_size, shape), torch.randint(0, args.vocab_size, shape))
        warm_up(model, optimizer, args, ctx, batch)
        recorder = StepRecorder([*held_tensors(model, optimizer), *batch])
        with recorder:
            training_step(model, optimizer, args, ctx, batch)
        state = local_state_bytes(model, optimizer)
    if progress is not None:
        progress.phase("steps")
    tuned = fine_tuned_shapes(config, **args.fine_tuning)
    collectives = [(c.kind, c.message_bytes, c.group_size) for c in recorder.collectives]
    traffic = Traffic.of(collectives)
    result = {
        "strategy": record_strategy(args),
        "world_size": args.world_size,
        "rank": args.rank,
        "replicate_degree": args.replicate_degree,
        "mixed_precision": args.mixed_precision,
        "batch_size": script_args.batch_size,
        "model": args.model,
        "model_config": config.shape(),
        "params_bytes": state["params"],
        "grads_bytes": state["grads"],
        "optimizer_bytes": state["optimizer"],
        "peak_bytes": recorder.peak,
        "sent_bytes_per_step": traffic.total_ring_bytes,
        **traffic.as_record(),
        "collectives": collectives,
        **{key: value for key, value in args.fine_tuning.items() if value},
        "estimate": estimate(args, config, script_args.batch_size, tuned),
        # P, the values a rank's copy holds (adapters included), and T, those that train: 4P + 12T bytes unsharded
        "parameter_count": tuned.numel,
        "trained_parameter_count": tuned.trainable_numel,
    }
    if progress is not None:
        progress.phase("estimate")
        progress.done()
    return result


def estimate(args: argparse.Namespace, config: Any, batch_size: int, tuned: ParameterShapes) -> dict[str, float]:
    """What estimate_memory and estimate_communication (modelled_collectives) say of the same job."""
    shapes, trainable, prepare = tuned.shapes, tuned.trainable, functools.partial(fine_tune, **args.fine_tuning)
    strategy = record_strategy(args)
    group = 1 if args.strategy == "ddp" else args.world_size // args.replicate_degree // args.tp_degree
    kind = "ddp" if strategy == "ddp" else "hybrid_shard" if args.replicate_degree > 1 else "full_shard"
    forward = estimate_memory.forward_of(kind, args.mixed_precision)
    if args.tp_degree > 1:  # what one rank of a group computes
        prepare = chained(prepare, functools.partial(one_rank_of_a_group, degree=args.tp_degree))
    activations = gpt_activations(
        config, batch_size, checkpointing=False, forward=forward, unit_gradients=kind != "ddp", prepare=prepare
    )
    layout = estimate_memory.LAYOUTS[strategy]
    precision = args.mixed_precision
    memory = estimate_memory.estimate_model(
        shapes, kind, group, precision, activations, layout, trainable, tp_degree=args.tp_degree
    )
    tp = TensorParallel(args.tp_degree, batch_size, config.block_size, config.d_model)
    traffic = modelled_collectives.run_estimate(
        strategy, shapes, args.world_size, group, precision, loss_check=False, trainable=trainable, tp=tp
    )
    return {
        "params_bytes": memory.state.params,
        "grads_bytes": memory.state.grads,
        "optimizer_bytes": memory.state.optimizer,
        "peak_bytes": memory.peak_per_rank,
        "sent_bytes_per_step": traffic.total_ring_bytes,
    }


FIGURES = ("params_bytes", "grads_bytes", "optimizer_bytes", "peak_bytes", "sent_bytes_per_step")


def ratio(estimated: float, simulated: float) -> str:
    return f"{estimated / simulated:.4f}" if simulated else "n/a"  # a world of one sends nothing


def report(result: dict[str, Any]) -> str:
    lines = [
        f"rank {result['rank']} of {result['world_size']}, {result['strategy']}, replicate degree "
        f"{result['replicate_degree']}, {result['mixed_precision']}, model {result['model_config']}",
        "",
        "| figure | simulated | estimated | estimated / simulated |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, simulated, estimated in ((name, result[name], result["estimate"][name]) for name in FIGURES):
        lines.append(f"| {name} | {simulated:,.0f} | {estimated:,.0f} | {ratio(estimated, simulated)} |")
    lines.append("\ncollectives of the step (kind, message bytes, group size):")
    lines += [f"  {kind} {size:,} {group}" for kind, size, group in result["collectives"]]
    return "\n".join(lines)


def scale_table(results: list[dict[str, Any]]) -> str:
    """Per-rank model state and bytes sent per step, one row per job, against (4P + 12T) / N (16P / N in full
    training: P values held, T of them trained) and the estimators."""
    lines = [
        "| model | ranks | strategy | ranks per copy | state per rank MiB | x (4P + 12T) / ranks per copy "
        "| estimated / simulated | sent per step MiB | estimated / simulated | peak MiB | estimated / simulated |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for result in results:
        held, trained = result["parameter_count"], result["trained_parameter_count"]
        group = result["world_size"] // result["replicate_degree"] if result["strategy"] != "ddp" else 1
        state = sum(result[f"{kind}_bytes"] for kind in ("params", "grads", "optimizer"))
        estimated = sum(result["estimate"][f"{kind}_bytes"] for kind in ("params", "grads", "optimizer"))
        sent, sent_estimated = result["sent_bytes_per_step"], result["estimate"]["sent_bytes_per_step"]
        lines.append(
            f"| {result['model']} | {result['world_size']:,} | {result['strategy']} | {group:,} | {state / MIB:,.2f} "
            f"| {state / ((4 * held + 12 * trained) / group):.3f} | {estimated / state:.4f} | {sent / MIB:,.1f} "
            f"| {ratio(sent_estimated, sent)} | {result['peak_bytes'] / MIB:,.1f} "
            f"| {ratio(result['estimate']['peak_bytes'], result['peak_bytes'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = [simulate(job, Progress(index, len(args.jobs), job)) for index, job in enumerate(args.jobs, 1)]
    print(report(results[0]) if len(results) == 1 else scale_table(results))
    if args.out is not None:
        written = results[0] if len(results) == 1 else results
        write_text(args.out, json.dumps(written, indent=2) + "\n", overwrite=args.overwrite)
        print(f"wrote {args.out}")
    if args.png is not None:
        save_figure_or_exit(draw_scale(results), args.png, args.overwrite, "--png", "; the table above holds it all")
        print(f"drew {args.png}")


if __name__ == "__main__":
    main()
