"""Train the MNIST CNN with FullyShardedDataParallel (FSDP1).

Every rank stores only a 1/N shard of the parameters, gradients and optimizer
state, gathers a unit's full weights just before it runs, and trains on its own
slice of each batch; gradients are averaged, so it trains the model DDP would.
Lines marked DISTRIBUTED are the ones a single-GPU script would not have.

    python fsdp/train_mnist.py                                    # one process
    torchrun --standalone --nproc_per_node=4 fsdp/train_mnist.py  # four, one machine
    python fsdp/train_mnist.py --synthetic --epochs 1             # no dataset needed
"""

from __future__ import annotations

import functools
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
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
from torch.optim.lr_scheduler import StepLR

from common import cli, flag_checks
from common.bookkeeping import Bookkeeping, FinalRecord
from common.checkpoint import Checkpointer, full_state_dict_options
from common.data import CompactDistributedSampler, eval_loader, train_loader
from common.distributed import DistContext, clean_teardown, errors_reported_once, launch_context, print0
from common.flags import positive_int
from common.hangs import HangWatch
from common.mnist import MnistNet, evaluate_classifier, load_mnist, normalize_images, synthetic_mnist
from common.run_dir import RunDirLock
from common.training import plan_total_steps, seed_everything


def parse_args(argv: list[str] | None = None):
    parser = cli.make_parser(__doc__, run_dir="runs/fsdp_mnist", log_interval=50)
    # The training defaults this script owns, in one place; the other flags' defaults are shared (common/cli.py).
    cli.add_training_flags(parser, batch_size=64, lr=1.0, epochs=3, max_steps=None, grad_clip=0.0)
    cli.add_mnist_flags(parser, gamma=0.7)
    parser.add_argument_group("FSDP1").add_argument(
        "--min-num-params",
        type=positive_int,
        default=20_000,
        help="a submodule with at least this many parameters becomes its own FSDP unit (default: %(default)s)",
    )
    cli.add_checkpoint_flags(parser, sharded=True)
    args = parser.parse_args(argv)
    settings = flag_checks.training_settings(parser, args)  # as given: what each checkpoint records
    flag_checks.resolve_flags(parser, args)  # the values the flags leave open, such as the per-rank batch
    flag_checks.check_training_flags(parser, args)
    flag_checks.check_checkpoint_flags(parser, args)
    return args, settings


def wrap_model(model: torch.nn.Module, args, ctx: DistContext) -> torch.nn.Module:
    """DISTRIBUTED: the whole of FSDP1 is this one wrap.

    FSDP keeps 1/N of every unit's parameters on this rank and gathers the rest just in time. Every
    submodule with at least --min-num-params parameters is a unit: here only fc1 (1.18M of 1.2M); the
    small layers share the root unit (a CNN this small gains nothing from sharding). Every rank seeded
    the same generator and built the same weights, so FSDP shards identical copies (FSDP1's
    sync_module_states would broadcast rank 0's instead, on GPUs only).
    """
    return FSDP(
        model,
        auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=args.min_num_params),
        device_id=ctx.device,  # CPU runs need it too, or FSDP looks for an accelerator
        use_orig_params=True,  # the optimizer sees the original parameters, as views of this rank's shard
    )


def forward_backward(model: torch.nn.Module, micro_batches: list, ctx: DistContext) -> torch.Tensor:
    """One optimizer step's forward and backward passes, a micro-batch at a time; the step's loss, on the device."""
    step_loss = torch.zeros((), device=ctx.device)
    for micro_step, (images, labels) in enumerate(micro_batches):
        # uint8 pixels cross to the device (a quarter of float32's bytes) and are normalised there.
        images = normalize_images(images.to(ctx.device, non_blocking=True))
        labels = labels.to(ctx.device, non_blocking=True)
        # DISTRIBUTED: skip the gradient reduction on all but the last
        # micro-step; gradients add up locally until then.
        last_micro_step = micro_step == len(micro_batches) - 1
        with nullcontext() if last_micro_step else model.no_sync():
            loss = F.cross_entropy(model(images), labels) / len(micro_batches)  # YOUR LOSS
            loss.backward()
        step_loss += loss.detach()
    return step_loss


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list,
    run: Bookkeeping,
    step: int,
    args,
    ctx: DistContext,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimizer step ``step + 1``: the gradients of its micro-batches, clipped, and the update; its loss and the
    global gradient norm, on the device."""
    run.begin_step(step)  # from here to end_step: one optimizer step, nothing else
    optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(model, micro_batches, ctx)
    run.watch_loss(loss, step + 1)  # DISTRIBUTED: every rank stops, or none (read on the steps that log)
    # Clipping also measures the global gradient norm that is logged; with
    # --grad-clip 0 the limit is infinite, so it measures without clipping.
    # DISTRIBUTED: FSDP's own clip combines the shards' norms into the global one.
    grad_norm = model.clip_grad_norm_(args.grad_clip or math.inf)
    optimizer.step()
    run.end_step()
    return loss, grad_norm


def evaluate(model: torch.nn.Module, loader, run: Bookkeeping, step: int, ctx: DistContext, **fields) -> dict:
    """The test set's loss and accuracy of the model after ``step`` steps, in metrics.jsonl and on the console."""
    with run.paused():  # not training time
        result = evaluate_classifier(model, loader, ctx, normalize_images)
    run.write("eval", step=step, **fields, **result)
    print0(f"eval at step {step}: loss {result['loss']:.4f} | accuracy {result['accuracy']:.2%}")
    return result


def save_model(model: torch.nn.Module, ctx: DistContext, checkpoints: Checkpointer) -> None:
    """DISTRIBUTED: model.pt, the whole model under its own parameter names (no wrapper's prefix), as CPU
    tensors, which rank 0 writes; the other ranks only learn whether that worked."""
    state = get_model_state_dict(model, options=full_state_dict_options(ctx.device))
    checkpoints.save_model(state)


def train(args, settings: dict, ctx: DistContext, lock: RunDirLock) -> None:
    run = Bookkeeping(args.run_dir, ctx, args.log_interval, args.profile, lock, args.tensorboard)  # the run's records
    seed_everything(args.seed, args.deterministic)
    # YOUR DATA: datasets of (input, target) pairs; the sampler and the evaluation take any such.
    train_set, test_set = synthetic_mnist() if args.synthetic else load_mnist(args.data_dir, ctx)
    # DISTRIBUTED: each rank draws its own slice of every epoch's shuffle (torch's DistributedSampler, without
    # a table of the order), as many batches as every other rank: none waits alone.
    sampler = CompactDistributedSampler(train_set, ctx.world_size, ctx.rank, seed=args.seed)  # DISTRIBUTED
    loader = train_loader(train_set, args.batch_size, sampler, ctx)
    test_loader = eval_loader(test_set, args.test_batch_size, ctx)
    steps_per_epoch = len(loader) // args.grad_accum_steps
    total_steps = plan_total_steps(steps_per_epoch, args.epochs, args.max_steps)
    global_batch = args.batch_size * args.grad_accum_steps * ctx.world_size

    model = MnistNet(dropout=not args.deterministic).to(ctx.device)  # YOUR MODEL
    model = wrap_model(model, args, ctx)  # DISTRIBUTED
    # DISTRIBUTED: built after the wrap: under FSDP it must hold (and keep state for) only this rank's shards.
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)  # stepped once per epoch

    # DISTRIBUTED: a full checkpoint is one file from rank 0; a sharded one, each rank's own shards.
    checkpoints = Checkpointer(
        ctx,
        args.run_dir,
        model=model,
        optimizer=optimizer,
        extra={"scheduler": scheduler},
        identity={"model": "MnistNet"},  # YOUR CHECKPOINT IDENTITY: what it resumes from
        strategy="fsdp1_full_shard",  # recorded; a resume names a switch
        settings=settings,  # the flags as given, recorded; a resume names each change
        global_batch_size=global_batch,
        sharded=args.checkpoint_format == "sharded",
        trust=args.trust_checkpoint,
        interval=args.checkpoint_interval,  # save(step) writes one every N steps
        keep=args.keep_checkpoints,
        check_before_save=run.check_loss,  # a non-finite loss never reaches a checkpoint
        while_saving=run.paused,
    )
    resumed = checkpoints.resume(args.resume, args.resume_from, args.init_from)  # YOUR WEIGHTS: --init-from
    run.start(resumed, total_steps, global_batch)
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
            loss, grad_norm = train_step(model, optimizer, micro_batches, run, step, args, ctx)
            step += 1
            run.report(step, epoch, loss, grad_norm, scheduler.get_last_lr()[0])  # on the steps that log
        scheduler.step()
        result = evaluate(model, test_loader, run, step, ctx, epoch=epoch)
    checkpoints.save(step)
    if result is None:  # --max-steps 0, or resumed at the end: evaluate the model as it is
        result = evaluate(model, test_loader, run, step, ctx)
    save_model(model, ctx, checkpoints)  # DISTRIBUTED
    record = FinalRecord(script="fsdp/train_mnist.py", strategy=checkpoints.strategy, steps=step, evaluation=result)
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
