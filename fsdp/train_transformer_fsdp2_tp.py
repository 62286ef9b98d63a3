"""Train a small GPT-style transformer with FSDP2 plus tensor parallelism on a 2-D mesh.

The ranks form a grid, ("dp", "tp"). Along "tp", the --tp-degree ranks of a group
split every Block between them (tensor parallelism): each holds a slice of the
attention heads and of the MLP's hidden units and computes only those. Between
the Blocks each holds a slice of the sequence instead (sequence parallelism), so
the group gathers the whole sequence before the attention and the MLP, and hands
each rank its slice of their summed outputs after (an all-gather and a
reduce-scatter each; backward runs them the other way). The head splits the
vocabulary, and loss_parallel computes the loss from the slices of the logits.
The ranks of a group train on the same batch. Along "dp", the groups are FSDP2's
data parallelism: each trains on its own slice of the batch and fully_shard cuts
every parameter (a slice already) once more among them. The result is the model
one process trains. Lines marked DISTRIBUTED are the ones a single-GPU script
would not have.

This is fsdp/train_transformer_fsdp2.py with tensor parallelism added, kept as a
script of its own so that both stay lessons: `diff` the two to see what TP adds.
Add it when one Block's activations or gathered parameters no longer fit, or
when FSDP's all-gathers over many ranks cost more than the step: inside a
machine, where the gathers and scatters of every Block are cheap
(docs/strategies.md).

A world of one process trains the whole model unsplit, whatever --tp-degree says:
the run a split one must match, which tools.checks.check_equivalence starts with
the candidate's own flags.

    python fsdp/train_transformer_fsdp2_tp.py                                    # one process, unsplit
    torchrun --standalone --nproc_per_node=2 fsdp/train_transformer_fsdp2_tp.py  # 1 x 2: TP only
    torchrun --standalone --nproc_per_node=4 fsdp/train_transformer_fsdp2_tp.py  # 2 x 2
    torchrun --standalone --nproc_per_node=8 fsdp/train_transformer_fsdp2_tp.py --tp-degree 4 --model medium
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

# Let a plain `python` run of this script find common/ without installing the repository.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import PrepareModuleOutput, SequenceParallel, loss_parallel, parallelize_module
from torch.distributed.tensor.parallel.style import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

from common import cli, flag_checks, flags
from common.bookkeeping import Bookkeeping, FinalRecord
from common.checkpoint import Checkpointer, full_state_dict_options
from common.data import CompactDistributedSampler, eval_loader, train_loader
from common.distributed import DistContext, clean_teardown, env_world_size, errors_reported_once, launch_context, print0
from common.fine_tuning import add_adapters, freeze, merge_adapters
from common.models import GPT, checkpoint_activations, compile_layers, count_parameters, gpt_config, init_parameters
from common.run_dir import RunDirLock
from common.tokens import check_data_flags, transformer_data
from common.training import TokenCount, evaluate_language_model, plan_total_steps, seed_everything, warmup_cosine

# TENSOR PARALLELISM: what this script alone needs, kept here rather than in common/, so that a copy of any
# other script carries none of it (tests/test_layout.py's budget), and a reader sees all that TP adds in one file.


def add_tensor_parallel_flags(parser: cli.Parser) -> None:
    """The FSDP2 + tensor-parallel script's own flag: how many ranks split each Block between them."""
    parser.add_argument_group("tensor parallelism").add_argument(
        "--tp-degree",
        type=flags.positive_int,
        default=2,
        metavar="N",
        help="ranks of each tensor-parallel group: they split every Block's attention heads and MLP between "
        "them and train on the same batch; FSDP2 shards across the world size / N groups, which N must "
        "divide. One process runs the whole model unsplit",
    )


def tensor_parallel_size(parser: cli.Parser, tp_degree: int) -> int:
    """The ranks each Block is split over: --tp-degree, which must divide the world size; 1 in a world of one,
    which trains the whole model unsplit, the run a split one is compared with (tools.checks.check_equivalence
    gives its one-process reference the candidate's flags)."""
    world_size = env_world_size()
    if world_size == 1:
        return 1
    if world_size % tp_degree:
        parser.error(
            f"--tp-degree {tp_degree} does not divide the world size {world_size}: each tensor-parallel group "
            f"needs {tp_degree} ranks. Launch a multiple of {tp_degree} processes, or give a --tp-degree dividing "
            f"{world_size}"
        )
    return tp_degree


def check_tensor_parallel_flags(parser: cli.Parser, args: argparse.Namespace) -> None:
    """What a split of each Block over ``args.tp_degree`` ranks rules out; after resolve_flags, which
    fills in the preset's heads."""
    if args.replicate_degree != 1:  # at any degree: wrap_model builds no replicas, so it would go unheard
        parser.error(
            "--replicate-degree: this script shards over every data-parallel group (no HSDP replicas); "
            "HSDP is fsdp/train_transformer_fsdp2.py --replicate-degree"
        )
    if args.tp_degree == 1:
        return
    if args.n_head % args.tp_degree:
        parser.error(
            f"--tp-degree {args.tp_degree} must divide the attention heads ({args.n_head}): a rank holds whole heads"
        )
    if args.block_size % args.tp_degree:
        parser.error(
            f"--tp-degree {args.tp_degree} must divide the block size ({args.block_size}): between the Blocks each "
            "rank holds an equal slice of every sequence"
        )
    groups = env_world_size() // args.tp_degree
    if args.d_model % groups:
        # FSDP2 cuts the q|k|v pieces by their columns (wrap_model's shard_placement_fn), and only evenly: torch
        # 2.14.1 raised "FSDP does not support uneven sharding on dim 1" in the wrap, on every rank.
        parser.error(
            f"the {groups} data-parallel groups must divide the width (--d-model {args.d_model}): FSDP2 cuts the "
            "q|k|v weight by its columns, evenly only. Launch fewer or more processes, or change --tp-degree"
        )
    if args.lora_rank is not None:
        parser.error("--lora-rank with --tp-degree above 1: the adapters' layers are not split across ranks here")
    # torch 2.14.1's broadcast of a whole state dict (set_model_state_dict, broadcast_from_rank0) cuts the q|k|v
    # weight into contiguous rows, not by its thirds: a rank got rows of q and k, with no error, and trained on them.
    if args.checkpoint_format == "full":
        parser.error(
            "--checkpoint-format full with --tp-degree above 1: loading a whole state dict into split "
            "q|k|v weights scrambles them in this torch; keep the sharded format (the default)"
        )
    if args.init_from is not None:
        parser.error(
            f"--init-from with --tp-degree above 1: loading whole weights into split q|k|v weights "
            f"scrambles them in this torch. Start from {args.init_from} with fsdp/train_transformer_fsdp2.py"
        )


class FusedColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a projection whose output is several tensors side by side (the attention's q, k
    and v): each rank takes its slice of every part, so it holds the same heads of q, k and v.

    A plain ColwiseParallel cuts the fused rows into contiguous pieces: at 2 ranks the first would hold all
    of q and half of k. _StridedShard(0, split_factor=parts) cuts each part apart instead, and the output,
    kept in that layout, is this rank's [q | k | v] for its own heads, which CausalSelfAttention splits in 3.
    """

    def __init__(self, parts: int) -> None:
        super().__init__(output_layouts=_StridedShard(2, split_factor=parts))
        self.parts = parts

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for key, parameter in list(module.named_parameters(recurse=False)):
            split = distribute_tensor(parameter, device_mesh, [_StridedShard(0, split_factor=self.parts)])
            module.register_parameter(key, nn.Parameter(split, requires_grad=parameter.requires_grad))


def parallelize_blocks(layers: Iterable[nn.Module], tp_mesh: DeviceMesh, local_heads: int) -> None:
    """Split every Block over the ranks of ``tp_mesh`` (Megatron-LM's tensor and sequence parallelism).

    Between the Blocks each rank holds its own slice of the sequence, and the LayerNorms, whose weights every
    rank keeps whole, work on that slice alone (SequenceParallel). Before the attention and the MLP the
    group gathers the whole sequence (all-gather); each rank then computes its own heads (their q, k and v)
    and its own hidden units: a column-wise layer cuts the outputs, and the row-wise layer after it cuts its
    inputs to match and hands each rank its slice of the summed output (reduce-scatter). Backward runs the
    other one at each place. A norm's gradient from one slice of the sequence is part of the gradient:
    SequenceParallel's DTensor weights make autograd sum it over the group.
    """
    gather_the_sequence = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {
        "ln1": SequenceParallel(),
        "attn": gather_the_sequence,
        "attn.qkv": FusedColwiseParallel(parts=3),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln2": SequenceParallel(),
        "mlp": gather_the_sequence,
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    for layer in layers:
        parallelize_module(layer, tp_mesh, plan)
        layer.attn.n_head = local_heads


def _tp_placement(tensor: torch.Tensor) -> object:
    """``tensor``'s placement on the mesh dimension named "tp", or None.

    Only that one: FSDP2, sharding a column-wise weight over "dp" on top of its "tp" rows, places its own
    _StridedShard(0, split_factor=tp) on "dp". Taken for the q|k|v split, it had the MLP's weights saved
    as (tp, rows / tp, ...) boxes that hold other rows at another mesh shape (a 2 x 2 checkpoint resumed
    at 1 x 2 trained on scrambled MLP weights from the first step).
    """
    if not isinstance(tensor, DTensor):
        return None
    names = tensor.device_mesh.mesh_dim_names or ()
    return tensor.placements[names.index("tp")] if "tp" in names else None


def split_in_parts(parameter: torch.Tensor) -> bool:
    """Whether FusedColwiseParallel split ``parameter``: a _StridedShard on the "tp" mesh dimension."""
    return isinstance(_tp_placement(parameter), _StridedShard)


def parts_apart(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor that FusedColwiseParallel split, as the same memory seen as (parts, rows / parts, ...): each rank's
    piece of that is one box, which DCP can save and load in place. Of (3 d, d) split in thirds over "tp", a rank
    holds rows of q, of k and of v, three boxes: DCP (torch 2.14.1) writes them as one and refuses the overlap.
    Any other tensor as it is."""
    split = _tp_placement(tensor)
    if not isinstance(split, _StridedShard):
        return tensor
    assert isinstance(tensor, DTensor)
    others = [p for p in tensor.placements if p is not split]
    # FSDP2 shards the q|k|v weights by their columns (shard_placement_fn), never by strided rows.
    if any(isinstance(p, _StridedShard) for p in others):
        raise ValueError(f"q|k|v weights placed {tensor.placements}: only one strided split is laid out here")
    placements = [
        Shard(1) if p is split else Shard(p.dim + 1) if isinstance(p, Shard) else p for p in tensor.placements
    ]
    parts = split.split_factor
    local = tensor.to_local()
    shape = torch.Size((parts, tensor.shape[0] // parts, *tensor.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    view = local.view(parts, local.shape[0] // parts, *local.shape[1:])
    return DTensor.from_local(view, tensor.device_mesh, placements, run_check=False, shape=shape, stride=stride)


def whole(value: torch.Tensor) -> torch.Tensor:
    """A value that every rank of a group holds alike, as a plain tensor: the loss_parallel loss is a DTensor."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def clip_grad_norm_over_meshes(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ for DTensor gradients that live on different meshes; the global norm, a plain tensor.

    Under FSDP2 plus tensor parallelism every parameter that parallelize_module placed lives on the 2-D mesh
    and the embeddings on the data-parallel one, and torch's clip_grad_norm_ refuses to stack their norms.
    Each mesh's part is combined over its own ranks first, as torchtitan does.
    """
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for parameter in parameters:
        if parameter.grad is not None:
            by_mesh.setdefault(getattr(parameter.grad, "device_mesh", None), []).append(parameter)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in by_mesh.values()]
    total = torch.stack([norm.full_tensor() if isinstance(norm, DTensor) else norm for norm in norms]).norm()
    for group in by_mesh.values():  # one mesh at a time too: torch's foreach ops refuse a mix
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def parse_args(argv: list[str] | None = None):
    parser = cli.make_parser(__doc__, run_dir="runs/fsdp2_tp_transformer", log_interval=25)
    # The training defaults this script owns, in one place; the other flags' defaults are shared (common/cli.py).
    cli.add_training_flags(parser, batch_size=32, lr=1e-2, epochs=None, max_steps=600, grad_clip=1.0)
    cli.add_schedule_flags(parser, warmup_steps=30, min_lr_ratio=0.1, weight_decay=0.1)
    cli.add_transformer_flags(parser)
    cli.add_compute_flags(parser, precisions=["fp32", "bf16"])
    cli.add_fsdp_flags(parser)
    cli.add_fsdp2_flags(parser)
    add_tensor_parallel_flags(parser)
    cli.add_checkpoint_flags(parser, sharded=True)
    args = parser.parse_args(argv)
    settings = flag_checks.training_settings(parser, args)  # as given: what each checkpoint records
    args.tp_degree = tensor_parallel_size(parser, args.tp_degree)  # 1 in a world of one; resolve_flags reads it
    flag_checks.resolve_flags(parser, args)  # the values the flags leave open, such as the per-rank batch
    flag_checks.check_training_flags(parser, args)
    flag_checks.check_checkpoint_flags(parser, args)
    flag_checks.check_transformer_flags(parser, args)
    check_data_flags(parser, args)
    flag_checks.check_fsdp2_flags(parser, args)
    check_tensor_parallel_flags(parser, args)
    return args, settings


def wrap_model(model: GPT, args, ctx: DistContext) -> torch.nn.Module:
    """DISTRIBUTED: tensor parallelism inside each group, then FSDP2 across the groups, in the order they
    need: splitting, compiling, activation checkpointing, sharding, then the memory and values of this
    rank's pieces.

    The model arrives on the meta device: shapes without memory. Each rank allocates and initialises
    only its own pieces once both have cut them, so no rank ever holds the whole model: it may be
    larger than one GPU. The weights still equal what one process would build.
    """
    layers = model.blocks  # YOUR LAYERS: the ones that repeat; each is split, then becomes one FSDP unit
    # The mesh: a grid of (world size / tp) x tp ranks, row by row, so that a tensor-parallel group is
    # consecutive ranks (one machine's GPUs: TP's gathers and scatters run in every Block, fast links only)
    # and FSDP shards across the groups. Passed explicitly (on CPU too) so FSDP2 never guesses a device type.
    shape, dim_names = (ctx.world_size // args.tp_degree, args.tp_degree), ("dp", "tp")
    print0(f"2-D mesh: {shape[0]} data-parallel group(s) of {shape[1]} tensor-parallel rank(s)")
    if args.cpu_offload:
        # Offloaded shards live in host memory, and the collectives on them (the
        # global gradient norm, gathering model.pt) need a CPU backend beside NCCL.
        backends = dict.fromkeys(dim_names, "cpu:gloo,cuda:nccl")
        mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=dim_names, backend_override=backends)
    else:
        mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=dim_names)
    if args.tp_degree > 1:  # a world of one trains the model unsplit: the reference a split run must match
        frozen = [name for name, parameter in model.named_parameters() if not parameter.requires_grad]  # --freeze
        parallelize_blocks(layers, mesh["tp"], args.n_head // args.tp_degree)
        parallelize_module(
            model,
            mesh["tp"],
            {
                # Each rank keeps its own slice of the sequence from the embeddings on (a slice of a whole
                # tensor: nothing sent), and the final norm works on that slice too.
                "drop": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
                "ln_f": SequenceParallel(),
                # The head gathers the sequence and computes its own slice of the vocabulary's logits, kept as a
                # DTensor for loss_parallel (forward_backward): no rank ever holds every logit.
                "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
            },
        )
        # torch 2.14.1's SequenceParallel makes the norms' weights anew, forgetting a frozen one's requires_grad:
        # turned off again here, before fully_shard sees which parameters train.
        for name in frozen:
            model.get_parameter(name).requires_grad_(False)
    if args.compile:
        compile_layers(layers)
    if args.activation_checkpointing:
        # Before sharding, so fully_shard below takes each checkpointed layer whole:
        # its recomputation in backward runs while FSDP has that layer's
        # parameters gathered for the gradients anyway.
        checkpoint_activations(model, layers)
    fsdp_options = {
        "mesh": mesh["dp"],  # the tp dimension's split already happened: FSDP shards across the groups
        # A fused q|k|v weight, split by thirds, is sharded by its columns: FSDP2's usual rows on top of the
        # strided rows gave a wrong full_tensor() in torch 2.14.1 (measured; model.pt and the equivalence
        # check read it).
        "shard_placement_fn": lambda parameter: Shard(1) if split_in_parts(parameter) else None,
        # Compute in bf16, but reduce gradients in fp32 so that summing N ranks'
        # contributions loses nothing; the sharded parameters themselves stay fp32.
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.mixed_precision == "bf16"
        else MixedPrecisionPolicy(),
        # Pinned host memory for fast copies: a GPU feature.
        "offload_policy": CPUOffloadPolicy() if args.cpu_offload else None,
    }
    # One FSDP unit per layer, gathered just before it runs and freed after. Not the last
    # layer: its backward comes next, and freeing it would mean gathering it again at once.
    for layer in layers:
        keep_gathered = layer is layers[-1] or not args.reshard_after_forward
        fully_shard(layer, reshard_after_forward=not keep_gathered, **fsdp_options)
    # The root takes what is left (embeddings, final norm, head). Left at its default, FSDP2
    # keeps the root's parameters after forward: backward needs them first.
    fully_shard(model, **fsdp_options)
    # Memory for this rank's shards only (in host memory when offloaded), then their values.
    model.to_empty(device="cpu" if args.cpu_offload else ctx.device)
    init_parameters(model, args.seed)
    return model


def forward_backward(
    model: torch.nn.Module, micro_batches: list, tokens: torch.Tensor, ctx: DistContext, dp_size: int
) -> torch.Tensor:
    """One optimizer step's forward and backward passes, a micro-batch at a time; the step's loss, on the device.

    ``tokens`` is how many targets count in the whole step over every rank: each micro-step's summed loss is
    divided by it, so a token weighs the same at any world size and accumulation split.
    """
    step_loss = torch.zeros((), device=ctx.device)
    for micro_step, (inputs, targets) in enumerate(micro_batches):
        inputs, targets = inputs.to(ctx.device, non_blocking=True), targets.to(ctx.device, non_blocking=True)
        # DISTRIBUTED: skip the gradient reduce-scatter on all but the last
        # micro-step (FSDP2's no_sync); unsharded gradients add up locally until then.
        model.set_requires_gradient_sync(micro_step == len(micro_batches) - 1)
        logits = model(inputs)
        # YOUR LOSS. In fp32 whatever the compute dtype: a bf16 softmax is too coarse.
        # DISTRIBUTED: times the data-parallel groups, since FSDP's gradient reduction averages over them;
        # the ranks of a group hold parts of one gradient, which no reduction averages.
        # DISTRIBUTED: under TP the logits are a DTensor, each rank's slice of the vocabulary; loss_parallel
        # computes the cross-entropy from the slices (small all-reduces per token), gathering no logits.
        with loss_parallel():
            summed = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
            loss = summed * dp_size / tokens
            loss.backward()
        step_loss += whole(loss.detach())
    return step_loss


def save_model(model: torch.nn.Module, args, ctx: DistContext, checkpoints: Checkpointer) -> None:
    """DISTRIBUTED: model.pt, the whole model under its own parameter names (no wrapper's prefix), as CPU
    tensors, which rank 0 writes; the other ranks only learn whether that worked."""
    # Without a backward to follow, the evaluation may have left parameters gathered
    # (--no-reshard-after-forward, the root unit): shard them again, so the memory
    # figures of the final record describe the training state.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    state = get_model_state_dict(model, options=full_state_dict_options(ctx.device))
    state = merge_adapters(state, args.lora_rank, args.lora_alpha)  # a model.pt of the plain model
    checkpoints.save_model(state)


def train(args, settings: dict, ctx: DistContext) -> None:
    # metrics.jsonl, the console's progress, stop requests, the observed step and the final record
    run = Bookkeeping(args.run_dir, ctx, args.log_interval, args.profile)
    seed_everything(args.seed, args.deterministic)
    # YOUR DATA: datasets of (input, target) pairs; the sampler and the evaluation take any such.
    data = transformer_data(args)  # --text-file, --token-file, or the synthetic Markov source
    print0(f"data: {data.description}")
    # DISTRIBUTED: the data-parallel groups: the mesh's rows (wrap_model), rank = group x tp + place in it.
    dp_size, dp_rank = ctx.world_size // args.tp_degree, ctx.rank // args.tp_degree
    # DISTRIBUTED: each group draws its own slice of every epoch's shuffle: torch's DistributedSampler, its
    # order computed as it goes (no table); the ranks of a group draw the same, since they split one model.
    sampler = CompactDistributedSampler(data.train, dp_size, dp_rank, seed=args.seed)  # DISTRIBUTED
    loader = train_loader(data.train, args.batch_size, sampler, ctx)
    # DISTRIBUTED: the held-out set split over the groups too; the evaluation counts each group once.
    heldout_loader = eval_loader(data.heldout, args.eval_batch_size, replace(ctx, rank=dp_rank, world_size=dp_size))
    steps_per_epoch = len(loader) // args.grad_accum_steps
    total_steps = plan_total_steps(steps_per_epoch, args.epochs, args.max_steps)
    global_batch = args.batch_size * args.grad_accum_steps * dp_size
    print0(
        f"{ctx.world_size} process(es) on {ctx.device.type} ({ctx.backend}) | global batch {global_batch} "
        f"sequences of {args.block_size} tokens | {total_steps} steps"
    )

    config = gpt_config(args, data.vocab_size)
    # DISTRIBUTED: shapes without memory: wrap_model gives each rank its shards alone (see there).
    with torch.device("meta"):
        model = GPT(config, seed=None)  # YOUR MODEL
    print0(f"model: {count_parameters(model):,} parameters, {args.n_layer} blocks of width {args.d_model}")
    add_adapters(model, args.lora_rank, args.lora_alpha, args.lora_targets, args.seed)  # --lora-rank
    freeze(model, args.freeze)  # --freeze: before the wrap, which sees which parameters need gradients
    model = wrap_model(model, args, ctx)  # DISTRIBUTED
    # DISTRIBUTED: built after the wrap: under FSDP it must hold (and keep state for) only this rank's shards.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = warmup_cosine(optimizer, args.warmup_steps, total_steps, args.min_lr_ratio)

    # DISTRIBUTED: a full checkpoint is one file from rank 0; a sharded one, each rank's own shards.
    checkpoints = Checkpointer(
        ctx,
        args.run_dir,
        model=model,
        optimizer=optimizer,
        extra={"scheduler": scheduler},
        # YOUR CHECKPOINT IDENTITY: what it resumes from. Split over "tp", the fused q|k|v weights are saved as
        # (3, d, d) (parts_apart): another layout than a checkpoint of an unsplit run, so a resume across is refused.
        identity={"model": config.shape(), "qkv": "3 parts" if args.tp_degree > 1 else None},
        strategy="fsdp2_tp",  # recorded; a resume names a switch
        settings=settings,  # the flags as given, recorded; a resume names each change
        global_batch_size=global_batch,
        sharded=args.checkpoint_format == "sharded",
        trust=args.trust_checkpoint,
        interval=args.checkpoint_interval,
        keep=args.keep_checkpoints,
        check_before_save=run.check_loss,  # a non-finite loss never reaches a checkpoint
        sharded_view=parts_apart,  # DISTRIBUTED: the q|k|v pieces as boxes DCP can write
    )
    # YOUR WEIGHTS: --init-from's state dict of this model, where no checkpoint of this run comes first.
    resumed = checkpoints.resume(args.resume, args.resume_from, args.init_from)
    run.start(resumed, total_steps, global_batch * args.block_size, unit="tokens")
    # Padded data counts its tokens every step (one all-reduce); data that never pads knows the count.
    count_tokens = TokenCount(data.padded, global_batch * args.block_size, ctx, copies=args.tp_degree)
    step = resumed.step
    result = None
    while step < total_steps:
        epoch = step // steps_per_epoch + 1
        done_in_epoch = step % steps_per_epoch
        # DISTRIBUTED: a new shuffle each epoch, the same on every rank. A run resumed mid-epoch starts
        # after the examples it trained (every rank's), at any world size, and reads none of them again.
        loader.sampler.set_epoch(epoch, start=done_in_epoch * global_batch)
        batches = iter(loader)
        for _ in range(min(steps_per_epoch - done_in_epoch, total_steps - step)):
            # Between two steps the saved state describes the run completely.
            if run.stop_requested():  # DISTRIBUTED: all ranks agree, so all of them stop at this step
                run.stop(step, checkpoints.save(step))
            if checkpoints.due(step):
                with run.paused():
                    checkpoints.save(step)
            logs = run.logs_after(step)  # only these steps read values from the device: no other step waits
            micro_batches = [next(batches) for _ in range(args.grad_accum_steps)]
            # DISTRIBUTED: the tokens that count in this step, on every rank, counted before the measured
            # step (bookkeeping, not the strategy's): each micro-step's loss is divided by them.
            tokens = count_tokens(micro_batches)
            run.begin_step(step)  # from here to end_step: one optimizer step, nothing else
            optimizer.zero_grad(set_to_none=True)
            step_loss = forward_backward(model, micro_batches, tokens, ctx, dp_size)
            run.watch_loss(step_loss, step + 1, read=logs)  # DISTRIBUTED: every rank stops, or none
            # Clipping also measures the logged global gradient norm (--grad-clip 0: measures only).
            # DISTRIBUTED: of DTensor slices on two meshes (what TP placed on both dimensions, the embeddings on
            # "dp"), which torch's clip_grad_norm_ cannot stack: each mesh's part is combined over its ranks first.
            grad_norm = clip_grad_norm_over_meshes(model.parameters(), args.grad_clip or math.inf)
            optimizer.step()
            scheduler.step()
            run.end_step()
            step += 1
            if logs:
                run.report(step, epoch, step_loss, grad_norm, scheduler.get_last_lr()[0])
            if step % args.eval_interval == 0 or step == total_steps:
                with run.paused(), loss_parallel():  # DISTRIBUTED: the logits stay split, as in training
                    result = evaluate_language_model(model, heldout_loader, ctx, copies=args.tp_degree)
                    run.write("eval", step=step, epoch=epoch, **result)
                    print0(f"eval at step {step}: held-out loss {result['loss']:.4f} nats/token")

    if checkpoints.due(step):
        checkpoints.save(step)
    if result is None:  # --max-steps 0, or resumed at the end: evaluate the model as it is
        with loss_parallel():
            result = evaluate_language_model(model, heldout_loader, ctx, copies=args.tp_degree)
        run.write("eval", step=step, **result)
    save_model(model, args, ctx, checkpoints)  # DISTRIBUTED
    run.finish(
        model,
        optimizer,
        FinalRecord(
            script="fsdp/train_transformer_fsdp2_tp.py",
            strategy=checkpoints.strategy,
            global_batch_size=global_batch,
            steps=step,
            evaluation=result,
            mixed_precision=args.mixed_precision,
            reshard_after_forward=args.reshard_after_forward,
            data=data,
            model_config=config.shape(),
        ),
    )


@record  # DISTRIBUTED: a crash's traceback reaches torchrun's error summary
def main(argv: list[str] | None = None) -> None:
    args, settings = parse_args(argv)
    with errors_reported_once():  # a FatalError or a Ctrl-C: one line from rank 0, one exit code from all
        ctx = launch_context(args.device)  # rank, world size and device, from torchrun's variables
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
            with RunDirLock(args.run_dir, ctx):
                train(args, settings, ctx)
        finally:
            with clean_teardown():  # what holds the groups lets go first (FSDP's cycles, a failed step)
                dist.destroy_process_group()  # DISTRIBUTED: every rank leaves, however the run ended


if __name__ == "__main__":
    main()
