"""The bare loop the overhead benchmark holds a training script against: the same training and nothing else.

    torchrun --standalone --nproc_per_node=2 tools/benchmarks/bare_loop.py SETTINGS.json

Run by ``python -m tools.benchmarks.benchmark --overhead``, which writes SETTINGS.json from the script's own
defaults for a --model preset. It trains the repository's GPT on its synthetic Markov data, with the script's
sampler, loss, AdamW, learning-rate schedule, gradient accumulation and clipping, under DDP or FSDP2 wrapped as
the scripts wrap them: the same numbers at every step, so that the script's final logged loss equals this loop's,
bit for bit. Nothing else: no stop checks, loss checks, logging, evaluation or checkpoints. It imports torch, the
model, the data and the schedule, nothing of the scripts' bookkeeping. Rank 0 prints one line of JSON, with every
step's loss and gradient norm (``history``): a loop not built from the scripts' files, which the tests hold the
one-process reference of the equivalence tests against (tests/test_equivalence.py).

Why the same numbers: on CPU a step's time depends on them. Subnormal floats are slow on x86, and how many
a backward pass meets depends on the examples and their order: with torch's own DistributedSampler instead
of the script's (the same examples, another order) this loop's 2-rank DDP step took 35.4 ms instead of 29.8
(tiny preset, one thread per process, Intel AVX-512), and 27.0 against 27.6 once torch.set_flush_denormal(True)
took subnormals out. A bare loop that trains other numbers measures them, not the harness.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from common.data import CompactDistributedSampler, markov_data
from common.models import GPT, GPTConfig
from common.training import warmup_cosine


def wrapped(model: GPT, strategy: str, device: torch.device) -> torch.nn.Module:
    """The model under ``strategy``, with the options the scripts give it."""
    if strategy == "ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=block is not model.blocks[-1])
    return fully_shard(model, mesh=mesh)


def gradient_sync(model: torch.nn.Module, last_micro_step: bool) -> AbstractContextManager:
    """Gradients reduced at a step's last micro-step only, as the scripts do (DDP's no_sync, FSDP2's switch)."""
    if isinstance(model, DistributedDataParallel):
        return nullcontext() if last_micro_step else model.no_sync()
    model.set_requires_gradient_sync(last_micro_step)
    return nullcontext()


def mean_step_ms(settings: dict, device: torch.device) -> dict:
    """Rank 0's mean wall time of the steps after the warm-up, the last step's loss averaged over the ranks,
    the bytes of this rank's parameters, and every step's loss (this rank's) and gradient norm."""
    on_gpu = device.type == "cuda"
    rank, world_size = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(settings["seed"])
    data = markov_data(settings["block_size"], settings["train_sequences"], settings["heldout_sequences"])
    config = GPTConfig(vocab_size=data.vocab_size, **settings["model"])
    model = wrapped(GPT(config, seed=settings["seed"]).to(device), settings["strategy"], device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings["lr"], weight_decay=settings["weight_decay"])
    warmup, steps = settings["warmup"], settings["steps"]
    total = warmup + steps
    scheduler = warmup_cosine(optimizer, settings["warmup_steps"], total, settings["min_lr_ratio"])
    sampler = CompactDistributedSampler(data.train, world_size, rank, seed=settings["seed"])
    loader = DataLoader(data.train, settings["batch_size"], sampler=sampler, drop_last=True, pin_memory=on_gpu)
    micro_steps = settings["grad_accum_steps"]
    tokens = torch.tensor(world_size * micro_steps * settings["batch_size"] * settings["block_size"], device=device)
    # DDP's gradients are views of its buckets: the DDP script zeroes them in place, the FSDP2 one sets None.
    set_to_none = settings["strategy"] != "ddp"

    step, epoch, started = 0, 1, 0.0
    loss = torch.zeros((), device=device)
    history = []  # read once at the end: no step waits for the host
    while step < total:
        sampler.set_epoch(epoch)
        batches = iter(loader)
        for _ in range(min(len(loader) // micro_steps, total - step)):
            if step == warmup:
                if on_gpu:
                    torch.cuda.synchronize(device)
                started = time.perf_counter()
            optimizer.zero_grad(set_to_none=set_to_none)
            loss = torch.zeros((), device=device)
            for micro_step in range(micro_steps):
                inputs, targets = (tensor.to(device, non_blocking=True) for tensor in next(batches))
                with gradient_sync(model, last_micro_step=micro_step == micro_steps - 1):
                    # Summed, then divided by the step's tokens over all ranks, times the ranks the reduction averages.
                    summed = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten(), reduction="sum")
                    micro_loss = summed * world_size / tokens
                    micro_loss.backward()
                loss += micro_loss.detach()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), settings["grad_clip"] or math.inf)
            history.append(torch.stack([loss, norm.full_tensor() if hasattr(norm, "full_tensor") else norm]))
            optimizer.step()
            scheduler.step()
            step += 1
        epoch += 1
    if on_gpu:
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - started
    dist.all_reduce(loss := loss.detach().clone(), op=dist.ReduceOp.SUM)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]  # an FSDP2 shard
    return {
        "rank": rank,
        "step_ms": 1000 * elapsed / steps,
        "last_loss": loss.item() / world_size,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in local),
        "history": [{"loss": loss, "grad_norm": norm} for loss, norm in torch.stack(history).tolist()],
    }


def main(settings_file: str) -> None:
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
        # The scripts' TF32 matmuls (common.distributed.setup): with full fp32 ones this loop trained other numbers
        # on an H200 (last loss 1.440988 against the script's 1.441212) and timed slower kernels.
        torch.set_float32_matmul_precision("high")
    dist.init_process_group("nccl" if on_gpu else "gloo")
    try:
        result = mean_step_ms(json.loads(Path(settings_file).read_text()), device)
    finally:
        # FSDP's modules hold their process groups in reference cycles: collected at the interpreter's exit,
        # a gloo group's threads can outlive it and abort the process. Collected now, before the destroy.
        gc.collect()
        dist.destroy_process_group()
    if result["rank"] == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
