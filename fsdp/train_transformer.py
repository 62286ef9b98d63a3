"""Train a small GPT-style transformer with FullyShardedDataParallel (FSDP1).

Each transformer Block becomes one FSDP unit: every rank stores only its 1/N
shard of the unit's parameters, gradients and optimizer state, gathers its full
weights just before the unit runs, and trains on its own slice of each batch;
gradients are averaged, so it trains the model DDP would. Lines marked
DISTRIBUTED are the ones a single-GPU script would not have. The default data
is a synthetic Markov source whose lowest reachable loss is known, so the run
can tell how close it got.

FSDP1 is the older, FlatParameter-based API, shown because much code still uses
it; new code should prefer FSDP2 (fsdp/train_transformer_fsdp2.py).

    python fsdp/train_transformer.py                                    # one process
    torchrun --standalone --nproc_per_node=4 fsdp/train_transformer.py  # four, one machine
    torchrun --standalone --nproc_per_node=4 fsdp/train_transformer.py --sharding-strategy hybrid_shard
    torchrun --standalone --nproc_per_node=8 fsdp/train_transformer.py --model medium --mixed-precision bf16 \\
        --activation-checkpointing
"""

from __future__ import annotations

import math
import sys
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

# Let a plain `python` run of this script find common/ without installing the repository.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import CustomPolicy

from common import cli, flag_checks
from common.bookkeeping import Bookkeeping, FinalRecord
from common.checkpoint import Checkpointer, full_state_dict_options
from common.data import CompactDistributedSampler, eval_loader, train_loader
from common.distributed import DistContext, clean_teardown, errors_reported_once, launch_context, print0
from common.fine_tuning import LowRankUpdate, add_adapters, freeze, merge_adapters
from common.hangs import HangWatch
from common.models import GPT, checkpoint_activations, compile_layers, count_parameters, gpt_config, init_parameters
from common.run_dir import RunDirLock
from common.tokens import check_data_flags, transformer_data
from common.training import TokenCount, evaluate_language_model, plan_total_steps, seed_everything, warmup_cosine

PREFETCH = {"pre": BackwardPrefetch.BACKWARD_PRE, "post": BackwardPrefetch.BACKWARD_POST, "none": None}
# The same strategy without resharding after forward, for the last Block (see wrap_model).
KEEP_GATHERED = {"full_shard": ShardingStrategy.SHARD_GRAD_OP, "hybrid_shard": ShardingStrategy._HYBRID_SHARD_ZERO2}


def parse_args(argv: list[str] | None = None):
    parser = cli.make_parser(__doc__, run_dir="runs/fsdp_transformer", log_interval=25)
    # The training defaults this script owns, in one place; the other flags' defaults are shared (common/cli.py).
    cli.add_training_flags(parser, batch_size=32, lr=1e-2, epochs=None, max_steps=600, grad_clip=1.0)
    cli.add_schedule_flags(parser, warmup_steps=30, min_lr_ratio=0.1, weight_decay=0.1)
    cli.add_transformer_flags(parser)
    cli.add_compute_flags(parser, precisions=["fp32", "bf16", "fp16"])
    cli.add_fsdp_flags(parser)
    cli.add_fsdp1_flags(parser)
    cli.add_checkpoint_flags(parser, sharded=True, asynchronous=True)
    args = parser.parse_args(argv)
    settings = flag_checks.training_settings(parser, args)  # as given: what each checkpoint records
    flag_checks.resolve_flags(parser, args)  # the values the flags leave open, such as the per-rank batch
    flag_checks.check_training_flags(parser, args)
    flag_checks.check_checkpoint_flags(parser, args)
    flag_checks.check_transformer_flags(parser, args)
    check_data_flags(parser, args)
    flag_checks.check_fsdp1_flags(parser, args)
    return args, settings


def wrap_model(model: GPT, args, ctx: DistContext) -> torch.nn.Module:
    """DISTRIBUTED: FSDP1, in the order it needs: compiling, sharding, then activation checkpointing.

    The model arrives on the meta device: shapes without memory. FSDP materialises one unit at a time,
    initialises it (materialize) and keeps this rank's shard of it, so no rank ever holds the whole
    model: it may be larger than one GPU. The weights still equal what one process would build.
    """
    layers = list(model.blocks)  # YOUR LAYERS: the ones that repeat; each becomes one FSDP unit
    names = {module: name for name, module in model.named_modules()}

    def materialize(module: torch.nn.Module) -> None:
        module.to_empty(device=ctx.device, recurse=False)
        init_parameters(module, args.seed, prefix=names[module], recurse=False)

    def fsdp_unit(module: torch.nn.Module) -> bool | dict:
        # Each layer is one FSDP unit, gathered just before it runs and freed after; what no layer
        # claims (embeddings, final norm, head) forms the root unit, which FSDP never frees after
        # forward: backward needs it first. Nor the last layer: its backward comes next, and freeing
        # it would mean gathering it again at once. (FSDP2 does the same below its root.)
        if module is layers[-1] and args.sharding_strategy in KEEP_GATHERED:
            return {"sharding_strategy": KEEP_GATHERED[args.sharding_strategy]}
        # --lora-rank: each adapter a unit of its own, apart from the frozen weights it adapts. A unit is one
        # flat parameter, and FSDP1 keeps a gradient for all of it as soon as any part of it trains.
        return module in layers or isinstance(module, LowRankUpdate)

    if args.compile:
        compile_layers(layers)
    if args.sharding_strategy == "no_shard":
        print0("note: no_shard keeps full copies and all-reduces gradients: the same as DDP (use DDP for that)")
    mesh = None
    if args.sharding_strategy == "hybrid_shard":
        # Rows of the mesh replicate, columns shard: consecutive ranks (one machine's GPUs) share a sharded copy.
        shard_degree = ctx.world_size // args.replicate_degree
        mesh = init_device_mesh(
            ctx.device.type, (args.replicate_degree, shard_degree), mesh_dim_names=("replicate", "shard")
        )
        print0(f"hybrid_shard: {args.replicate_degree} replica(s), each sharded across {shard_degree} rank(s)")
    compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.mixed_precision)  # None: fp32
    model = FSDP(
        model,
        auto_wrap_policy=CustomPolicy(fsdp_unit),
        sharding_strategy=ShardingStrategy[args.sharding_strategy.upper()],
        device_mesh=mesh,
        # Compute in low precision, but reduce gradients in fp32 so that summing
        # N ranks' contributions loses nothing; the shards themselves stay fp32.
        mixed_precision=None
        if compute_dtype is None
        else MixedPrecision(param_dtype=compute_dtype, reduce_dtype=torch.float32),
        cpu_offload=CPUOffload(offload_params=args.cpu_offload),
        backward_prefetch=PREFETCH[args.backward_prefetch],
        device_id=ctx.device,  # CPU runs need it too, or FSDP looks for an accelerator
        param_init_fn=materialize,
        use_orig_params=True,  # the optimizer and the metrics see the original parameters, as views of shards
    )
    if args.activation_checkpointing:
        # Inside each FSDP unit, so the recomputation in backward runs while that
        # unit's parameters are gathered anyway.
        checkpoint_activations(model, layers)
    return model


def forward_backward(
    model: torch.nn.Module, micro_batches: list, tokens: torch.Tensor, args, ctx: DistContext, scaler: ShardedGradScaler
) -> torch.Tensor:
    """One optimizer step's forward and backward passes, a micro-batch at a time; the step's loss, on the device.

    ``tokens``: the targets that count in the whole step, over every rank. Each micro-step's summed loss is
    divided by it, so a token weighs the same at any world size and accumulation split.
    """
    step_loss = torch.zeros((), device=ctx.device)
    for micro_step, (inputs, targets) in enumerate(micro_batches):
        inputs, targets = inputs.to(ctx.device, non_blocking=True), targets.to(ctx.device, non_blocking=True)
        # DISTRIBUTED: skip the gradient reduction on all but the last
        # micro-step; gradients add up locally until then. Not in low precision: FSDP1
        # would add them up in that dtype; reduced every micro-step, they add up in fp32 shards.
        last_micro_step = micro_step == len(micro_batches) - 1
        with nullcontext() if last_micro_step or args.mixed_precision != "fp32" else model.no_sync():
            logits = model(inputs)
            # YOUR LOSS. In fp32 whatever the compute dtype: a low-precision softmax is too coarse.
            # DISTRIBUTED: times the world size, since the gradient reduction averages over ranks.
            summed = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
            loss = summed * ctx.world_size / tokens
            scaler.scale(loss).backward()
        step_loss += loss.detach()
    return step_loss


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list,
    count_tokens: TokenCount,
    run: Bookkeeping,
    step: int,
    args,
    ctx: DistContext,
    scaler: ShardedGradScaler,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimizer step ``step + 1``: the gradients of its micro-batches, clipped, and the update; its loss and the
    global gradient norm, on the device."""
    # DISTRIBUTED: the tokens that count in this step, on every rank, counted before the measured step
    # (bookkeeping, not the strategy's): each micro-step's loss is divided by them.
    tokens = count_tokens(micro_batches)
    run.begin_step(step)  # from here to end_step: one optimizer step, nothing else
    optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(model, micro_batches, tokens, args, ctx, scaler)
    run.watch_loss(loss, step + 1)  # DISTRIBUTED: every rank stops, or none (read on the steps that log)
    scaler.unscale_(optimizer)
    # Clipping also measures the global gradient norm that is logged; with
    # --grad-clip 0 the limit is infinite, so it measures without clipping.
    # DISTRIBUTED: FSDP's own clip combines the shards' norms into the global one.
    grad_norm = model.clip_grad_norm_(args.grad_clip or math.inf)
    scaler.step(optimizer)
    scaler.update()
    run.end_step()
    return loss, grad_norm


def evaluate(model: torch.nn.Module, loader, run: Bookkeeping, step: int, ctx: DistContext, **fields) -> dict:
    """The held-out loss of the model after ``step`` steps, in metrics.jsonl and on the console."""
    # Eager, compiled or not: evaluation is not timed, and a compiled Block traced again without gradients costs a
    # compilation more (and fails under FSDP1 in bf16 on torch 2.14.1, its bf16 parameters holding fp32 gradients).
    with run.paused(), torch.compiler.set_stance("force_eager"):  # not training time
        result = evaluate_language_model(model, loader, ctx)
    run.write("eval", step=step, **fields, **result)
    print0(f"eval at step {step}: held-out loss {result['loss']:.4f} nats/token")
    return result


def save_model(model: torch.nn.Module, args, ctx: DistContext, checkpoints: Checkpointer) -> None:
    """DISTRIBUTED: model.pt, the whole model under its own parameter names (no wrapper's prefix), as CPU
    tensors, which rank 0 writes; the other ranks only learn whether that worked."""
    state = get_model_state_dict(model, options=full_state_dict_options(ctx.device))
    state = merge_adapters(state, args.lora_rank, args.lora_alpha)  # a model.pt of the plain model
    checkpoints.save_model(state)


def train(args, settings: dict, ctx: DistContext, lock: RunDirLock) -> None:
    run = Bookkeeping(args.run_dir, ctx, args.log_interval, args.profile, lock, args.tensorboard)  # the run's records
    seed_everything(args.seed, args.deterministic)
    data = transformer_data(args)  # YOUR DATA: (input, target) pairs of --text-file, --token-file or a Markov source
    print0(f"data: {data.description}")
    # DISTRIBUTED: each rank draws its own slice of every epoch's shuffle (torch's DistributedSampler, without
    # a table of the order), as many batches as every other rank: none waits alone.
    sampler = CompactDistributedSampler(data.train, ctx.world_size, ctx.rank, seed=args.seed)  # DISTRIBUTED
    loader = train_loader(data.train, args.batch_size, sampler, ctx)
    heldout_loader = eval_loader(data.heldout, args.eval_batch_size, ctx)
    steps_per_epoch = len(loader) // args.grad_accum_steps
    total_steps = plan_total_steps(steps_per_epoch, args.epochs, args.max_steps)
    global_batch = args.batch_size * args.grad_accum_steps * ctx.world_size

    config = gpt_config(args, data.vocab_size)
    # DISTRIBUTED: shapes without memory: wrap_model gives each rank its shards alone (see there).
    with torch.device("meta"):
        model = GPT(config, seed=None)  # YOUR MODEL
    print0(f"model: {count_parameters(model):,} parameters, {args.n_layer} blocks of width {args.d_model}")
    add_adapters(model, args.lora_rank, args.lora_alpha, args.lora_targets, args.seed)  # --lora-rank
    freeze(model, args.freeze)  # --freeze: before the wrap, which sees which parameters need gradients
    model = wrap_model(model, args, ctx)  # DISTRIBUTED
    # DISTRIBUTED: built after the wrap: under FSDP it must hold (and keep state for) only this rank's shards.
    optimizer = torch.optim.AdamW(model.parameters(), args.lr, weight_decay=args.weight_decay, fused=args.fused_adamw)
    scheduler = warmup_cosine(optimizer, args.warmup_steps, total_steps, args.min_lr_ratio)
    scaler = ShardedGradScaler(ctx.device.type, enabled=args.mixed_precision == "fp16")  # fp16 loss scaling
    checkpoints = Checkpointer(
        ctx,
        args.run_dir,
        model=model,
        optimizer=optimizer,
        extra={"scheduler": scheduler, "scaler": scaler},
        identity={"model": config.shape()},  # YOUR CHECKPOINT IDENTITY: what it resumes from
        strategy=f"fsdp1_{args.sharding_strategy}",  # recorded; a resume names a switch
        settings=settings,  # the flags as given, recorded; a resume names each change
        global_batch_size=global_batch,
        sharded=args.checkpoint_format == "sharded",  # DISTRIBUTED: each rank writes its shards, or rank 0 all
        trust=args.trust_checkpoint,
        asynchronous=args.async_checkpoint,  # written in the background while the steps go on
        interval=args.checkpoint_interval,  # save(step) writes one every N steps
        keep=args.keep_checkpoints,
        check_before_save=run.check_loss,  # a non-finite loss never reaches a checkpoint
        while_saving=run.paused,
    )
    resumed = checkpoints.resume(args.resume, args.resume_from, args.init_from)  # YOUR WEIGHTS: --init-from
    run.start(resumed, total_steps, global_batch, tokens_per_example=args.block_size)
    count_tokens = TokenCount(data.padded, global_batch * args.block_size, ctx)  # padded data: counted each step
    step, result = resumed.step, None
    while step < total_steps:
        epoch, done_in_epoch = step // steps_per_epoch + 1, step % steps_per_epoch
        # DISTRIBUTED: a new shuffle each epoch, the same on every rank. A run resumed mid-epoch starts
        # after the examples it trained (every rank's), at any world size, and reads none of them again.
        sampler.set_epoch(epoch, start=done_in_epoch * global_batch)
        batches = iter(loader)
        for _ in range(min(steps_per_epoch - done_in_epoch, total_steps - step)):
            # Between two steps the saved state describes the run completely.
            if run.stop_requested():  # DISTRIBUTED: all ranks agree, so all of them stop at this step
                run.stop(step, checkpoints.save(step, force=True))
            checkpoints.save(step)  # where --checkpoint-interval asks for one
            micro_batches = [next(batches) for _ in range(args.grad_accum_steps)]
            loss, grad_norm = train_step(model, optimizer, micro_batches, count_tokens, run, step, args, ctx, scaler)
            scheduler.step()
            step += 1
            run.report(step, epoch, loss, grad_norm, scheduler.get_last_lr()[0])  # on the steps that log
            if step % args.eval_interval == 0 or step == total_steps:
                result = evaluate(model, heldout_loader, run, step, ctx, epoch=epoch)
    checkpoints.save(step)
    if result is None:  # --max-steps 0, or resumed at the end: evaluate the model as it is
        result = evaluate(model, heldout_loader, run, step, ctx)
    save_model(model, args, ctx, checkpoints)  # DISTRIBUTED
    record = FinalRecord(
        script="fsdp/train_transformer.py",
        strategy=checkpoints.strategy,
        steps=step,
        evaluation=result,
        mixed_precision=args.mixed_precision,
        data=data,
        model_config=config.shape(),
    )
    run.finish(model, optimizer, record)


@record  # DISTRIBUTED: a crash's traceback reaches torchrun's error summary
def main(argv: list[str] | None = None) -> None:
    args, settings = parse_args(argv)
    with errors_reported_once():  # a FatalError or a Ctrl-C: one line from rank 0, one exit code from all
        ctx = launch_context(args.device)  # rank, world size and device, from torchrun's variables
        hang_watch = HangWatch(args.run_dir, ctx, args.hang_timeout, args.flight_recorder)  # before the group
        timeout = timedelta(seconds=args.dist_timeout)
        # DISTRIBUTED: every rank waits here until all WORLD_SIZE ranks have joined: NCCL between
        # GPUs, gloo between CPU processes. They meet in torchrun's store (ctx.rendezvous_store).
        dist.init_process_group(  # DISTRIBUTED
            ctx.backend,
            store=ctx.rendezvous_store(timeout),
            rank=ctx.rank,
            world_size=ctx.world_size,
            timeout=timeout,  # how long a collective waits for the others before it fails
            device_id=ctx.device if ctx.device.type == "cuda" else None,
        )
        try:
            ctx = ctx.with_host_group()  # where ranks agree on host-side facts: a stop, a failed save
            # One run at a time writes RUN_DIR; the lock goes with this process, however it ends.
            with RunDirLock(args.run_dir, ctx) as lock, hang_watch:  # DISTRIBUTED: a hang ends in one report
                train(args, settings, ctx, lock)
        finally:
            with clean_teardown():  # what holds the groups lets go first (FSDP's cycles, a failed step)
                dist.destroy_process_group()  # DISTRIBUTED: every rank leaves, however the run ended


if __name__ == "__main__":
    main()
