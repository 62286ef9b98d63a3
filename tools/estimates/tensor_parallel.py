"""FSDP2 plus tensor parallelism (fsdp/train_transformer_fsdp2_tp.py), as the estimators count it: what each
rank keeps of every parameter, and the collectives tensor and sequence parallelism add to a step.

The script splits each Block over the T ranks of a tensor-parallel group, then FSDP2 shards each rank's
pieces over the D = world / T groups ("dp"). T splits:

    attn.qkv.weight   (3d, d)    by rows, each of q, k and v in T (FusedColwiseParallel): (3d/T, d)
    mlp.fc            (4d, d)    weight and bias by rows (ColwiseParallel): (4d/T, d) and (4d/T,)
    attn.proj.weight  (d, d)     by columns (RowwiseParallel): (d, d/T)
    mlp.proj.weight   (d, 4d)    by columns: (d, 4d/T)
    head.weight       (V, d)     by rows, the vocabulary (ColwiseParallel): (V/T, d), the first ranks one
                                 row more where T does not divide V

and leaves whole on every rank of the group: the row-wise layers' biases (added once, after the sum), the
LayerNorms (sequence-parallel: whole weights, each rank's slice of the tokens) and the embeddings. FSDP2
then cuts every piece along its first dimension, as in the FSDP2 script, but the fused q|k|v piece along
its columns (the script's shard_placement_fn): ``fsdp_shapes`` writes that one transposed, so that the
"dim0" counting of tools.estimates.shard_sizes counts each rank's share exactly.

Between the Blocks a rank holds its slice of the sequence. Per Block and micro-step, forward gathers the
whole sequence before the attention and before the MLP (all-gather) and hands each rank its slice of the
row-wise layers' summed outputs (reduce-scatter); backward runs the same four the other way round. Each
message is the micro-batch's hidden states, batch x block_size x d_model in the compute dtype (activation
checkpointing, not counted here, would run forward's twice). Outside the Blocks: the head gathers the
sequence (forward) and scatters its gradient (backward), the embeddings' output gradient is gathered
(backward, when they train), and loss_parallel all-reduces three fp32 values per token (the largest logit,
the sum of exponentials, the target's logit). Once a step, each LayerNorm's gradient, a partial sum over
each rank's tokens, is all-reduced over the group (in the compute dtype; in fp32 under accumulation, where
FSDP2 accumulates gradients in its reduce dtype). The gradient-norm clipping adds, per mesh of gradients
(the embeddings' on dp, the rest on (dp, tp)), an fp32 all-reduce of one value per tensor over each of that
mesh's dimensions; a dimension of one rank sends nothing. For the peak, ``one_rank_of_a_group`` gives a GPT
what one rank computes, whose activations tools.estimates.activations measures.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from tools.estimates.shard_sizes import FP32

COLUMN_WISE = ("attn.qkv.", "mlp.fc.")  # split by their outputs: weight rows and bias
ROW_WISE = ("attn.proj.", "mlp.proj.")  # split by their inputs: weight columns; the bias stays whole
SEQUENCE_PARALLEL = ("ln1.", "ln2.")  # whole weights on every rank, each rank's slice of the tokens
FUSED = "attn.qkv.weight"  # FSDP2 shards it by its columns, after TP cut its rows in thirds
HEAD = "head.weight"  # split by the vocabulary's rows
EMBEDDINGS = ("tok_emb.", "pos_emb.")  # whole on every rank of a group, on the data-parallel mesh alone
BLOCK_GATHERS = 2  # per Block and pass: before the attention and the MLP (forward), their gradients (backward)
BLOCK_SCATTERS = 2  # per Block and pass: the row-wise layers' outputs (forward), the gathers' gradients (backward)
LOSS_ALL_REDUCES = 3  # loss_parallel, per token: the largest logit, the sum of exponentials, the target's logit


def is_split(name: str) -> bool:
    """Whether the script's parallelize_module puts this parameter on the (dp, tp) mesh: every one but the
    embeddings' (the row-wise biases and the LayerNorms too, replicated over tp)."""
    return not name.startswith(EMBEDDINGS)


def is_sequence_parallel(name: str) -> bool:
    """A LayerNorm's weight or bias: its gradient is each rank's part, summed over the group once a step."""
    return name.startswith("ln_f.") or (name.startswith("blocks.") and any(f".{n}" in name for n in SEQUENCE_PARALLEL))


def tp_piece(name: str, shape: Sequence[int], degree: int) -> tuple[int, ...]:
    """What one rank of a tensor-parallel group of ``degree`` keeps of this parameter: the busiest rank's, where
    the vocabulary does not split evenly."""
    shape = tuple(shape)
    if degree == 1:
        return shape
    if name == HEAD:
        return (-(-shape[0] // degree), *shape[1:])  # torch.chunk's cut: the first ranks take one row more
    if not name.startswith("blocks."):
        return shape
    if any(f".{layer}" in name for layer in COLUMN_WISE):
        return (split(shape[0], degree, name), *shape[1:])
    if any(f".{layer}weight" in name for layer in ROW_WISE):
        return (shape[0], split(shape[1], degree, name))
    return shape  # LayerNorms, and the row-wise biases: added once, after the partial sums are


def split(size: int, degree: int, name: str) -> int:
    if size % degree:
        raise ValueError(f"{name}: {size} does not split over a tensor-parallel group of {degree}")
    return size // degree


def group_degree(tp_degree: int, world_size: int) -> int:
    """The ranks each Block is split over in a job of ``world_size``: ``tp_degree``, but 1 in a world of one, which
    the script trains unsplit whatever --tp-degree says (its tensor_parallel_size)."""
    return 1 if world_size == 1 else tp_degree


def check_degree(
    degree: int, world_size: int, heads: int, d_model: int, block_size: int, lora_rank: int | None = None
) -> None:
    """ValueError for a tensor-parallel group of ``degree`` ranks that the script cannot run in this job."""
    if degree == 1:
        return
    if world_size % degree:
        raise ValueError(f"--tp-degree {degree} does not divide the world size {world_size}")
    if heads % degree:
        raise ValueError(f"--tp-degree {degree} must divide the attention heads ({heads}): a rank holds whole heads")
    if block_size % degree:
        raise ValueError(
            f"--tp-degree {degree} must divide the block size ({block_size}): a rank holds an equal slice of each "
            "sequence between the Blocks"
        )
    if d_model % (world_size // degree):
        # FSDP2 cuts the q|k|v piece by its columns, and refuses an uneven cut of any dimension but the first
        # (torch 2.14.1: "FSDP does not support uneven sharding on dim 1").
        raise ValueError(
            f"the {world_size // degree} data-parallel groups must divide the width ({d_model}): FSDP2 cuts the "
            "q|k|v weight by its columns, evenly only"
        )
    if lora_rank:
        raise ValueError("--lora-rank with --tp-degree above 1: the script does not split the adapters' layers")


def refused_world_sizes(
    world_sizes: Iterable[int], parsed: tuple[argparse.Namespace, dict[str, Any]] | None
) -> dict[int, str]:
    """The world sizes at which the FSDP2 + TP script, given ``parsed`` (what its parse_args returned: the flags
    resolved and as given; None: not run), would refuse to start, each with check_degree's reason."""
    refused = {}
    for world_size in world_sizes if parsed is not None else []:
        args, given = parsed
        # As given: parsed in this one process, the script resolved --tp-degree to a world of one's 1.
        degree = group_degree(given["--tp-degree"], world_size)
        try:
            check_degree(degree, world_size, args.n_head, args.d_model, args.block_size, args.lora_rank)
        except ValueError as err:
            refused[world_size] = str(err)
    return refused


def fsdp_shapes(shapes: Mapping[str, Sequence[int]], degree: int) -> dict[str, tuple[int, ...]]:
    """Each parameter as FSDP2 cuts it over the data-parallel groups: the rank's tensor-parallel piece, the
    dimension FSDP2 shards first (the fused q|k|v piece's columns, so written transposed when split)."""
    pieces = {}
    for name, shape in shapes.items():
        piece = tp_piece(name, shape, degree)
        pieces[name] = piece[::-1] if degree > 1 and name.endswith(FUSED) else piece
    return pieces


@dataclass(frozen=True)
class TensorParallel:
    """A job's tensor parallelism: ``degree`` ranks per group, each micro-step's hidden states on a rank
    (``batch`` sequences of ``block_size`` tokens of width ``d_model``)."""

    degree: int
    batch: int
    block_size: int
    d_model: int

    def activation_bytes(self, compute_bytes: int) -> int:
        """One gather's or scatter's message: the micro-batch's hidden states in the compute dtype."""
        return self.batch * self.block_size * self.d_model * compute_bytes


def tp_collectives(
    tp: TensorParallel, blocks: int, compute_bytes: int, micro_steps: int = 1, embeddings_train: bool = True
) -> list[tuple[str, int, int]]:
    """The activations' collectives of one optimizer step, ``(kind, message bytes, group size)``: every
    micro-step, every Block, forward and backward, the head's, the embeddings' gradient (``embeddings_train``)
    and the loss's; none in a group of one."""
    if tp.degree == 1:
        return []
    hidden = tp.activation_bytes(compute_bytes)
    gathers = 2 * blocks * BLOCK_GATHERS + 1 + int(embeddings_train)  # the head's input; the embeddings' gradient
    scatters = 2 * blocks * BLOCK_SCATTERS + 1  # the head's input gradient
    per_micro_step = [("all_gather", hidden, tp.degree)] * gathers + [("reduce_scatter", hidden, tp.degree)] * scatters
    per_micro_step += [("all_reduce", FP32 * tp.batch * tp.block_size, tp.degree)] * LOSS_ALL_REDUCES
    return per_micro_step * micro_steps


def norm_gradient_collectives(
    shapes: Mapping[str, Sequence[int]], degree: int, compute_bytes: int, micro_steps: int, trains: Collection[str]
) -> list[tuple[str, int, int]]:
    """Each trained LayerNorm tensor's gradient, summed over the group once a step: in the compute dtype, or in
    fp32 where FSDP2 accumulated it over micro-steps (its reduce dtype)."""
    if degree == 1:
        return []
    dtype_bytes = compute_bytes if micro_steps == 1 else FP32
    return [
        ("all_reduce", math.prod(shape) * dtype_bytes, degree)
        for name, shape in shapes.items()
        if name in trains and is_sequence_parallel(name)
    ]


def group_collectives(
    shapes: Mapping[str, Sequence[int]],
    tp: TensorParallel,
    compute_bytes: int,
    micro_steps: int,
    trains: Collection[str],
) -> list[tuple[str, int, int]]:
    """All that tensor parallelism sends inside each group in one optimizer step: the activations' gathers and
    scatters, the loss's all-reduces and the LayerNorms' gradients."""
    blocks = len({".".join(name.split(".")[:2]) for name in shapes if name.startswith("blocks.")})
    embeddings_train = any(name.startswith(EMBEDDINGS) for name in trains)
    activations = tp_collectives(tp, blocks, compute_bytes, micro_steps, embeddings_train)
    return activations + norm_gradient_collectives(shapes, tp.degree, compute_bytes, micro_steps, trains)


def norm_collectives(
    shapes: Mapping[str, Sequence[int]], degree: int, dp: int, trainable: Collection[str] | None = None
) -> list[tuple[str, int, int]]:
    """The gradient norm's all-reduces (the script's clip_grad_norm_over_meshes): per mesh, one fp32 value per
    tensor with a gradient, over each of its dimensions of more than one rank."""
    trains = set(shapes) if trainable is None else set(trainable)
    split_tensors = sum(1 for name in shapes if name in trains and degree > 1 and is_split(name))
    whole_tensors = sum(1 for name in shapes if name in trains) - split_tensors
    collectives = []
    for tensors, dims in ((whole_tensors, (dp,)), (split_tensors, (dp, degree))):
        collectives += [("all_reduce", FP32 * tensors, size) for size in dims if tensors and size > 1]
    return collectives


def as_fsdp2(shapes: Mapping[str, Sequence[int]], layout: str, degree: int) -> tuple[dict[str, tuple[int, ...]], str]:
    """The shapes and layout that tools.estimates.shard_sizes counts a rank's share of: for "tp" (the FSDP2 +
    TP script's layout), each rank's pieces as FSDP2 cuts them along "dim0"; any other layout as it is."""
    if layout != "tp":
        return {name: tuple(shape) for name, shape in shapes.items()}, layout
    return fsdp_shapes(shapes, degree), "dim0"


class GatherSequence(nn.Module):
    """Stands in for DTensor's all-gather of the sequence, with its buffers: the collective stacks the ranks'
    slices along the batch, then they are laid side by side along the sequence, a tensor ``degree`` times as long."""

    def __init__(self, degree: int) -> None:
        super().__init__()
        self.degree = degree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(x.repeat(self.degree, 1, 1).chunk(self.degree), dim=1)


class ScatterSequence(nn.Module):
    """Stands in for DTensor's reduce-scatter of the sequence, with its buffers: the slices of the sequence are
    stacked along the batch for the collective, which leaves a new tensor of this rank's tokens."""

    def __init__(self, degree: int) -> None:
        super().__init__()
        self.degree = degree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(x.chunk(self.degree, dim=1))[: x.shape[0]].clone()


class Gathered(nn.Module):
    """``module`` run on the gathered sequence, its output scattered again (the attention of one rank)."""

    def __init__(self, module: nn.Module, degree: int) -> None:
        super().__init__()
        self.gather, self.module, self.scatter = GatherSequence(degree), module, ScatterSequence(degree)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scatter(self.module(self.gather(x)))


def one_rank_of_a_group(model: nn.Module, degree: int) -> None:
    """Make ``model`` what one rank of a group computes, so that a measure of its activations
    (tools.estimates.activations, ``prepare``) counts a tensor-parallel rank's: its slice of the sequence
    between the Blocks and in every LayerNorm, the whole sequence and its own heads and hidden units inside the
    attention and the MLP, its own slice of the vocabulary's logits. The collectives become copies of the sizes
    they make. Shapes and sizes only: the values differ from a rank's."""
    for block in model.blocks:
        width = block.attn.qkv.in_features
        block.attn.qkv = nn.Linear(width, 3 * width // degree, bias=False)
        block.attn.proj = nn.Linear(width // degree, width)
        block.attn.n_head //= degree
        block.attn = Gathered(block.attn, degree)
        hidden = block.mlp.fc.out_features // degree
        block.mlp.fc = nn.Sequential(GatherSequence(degree), nn.Linear(width, hidden))
        block.mlp.proj = nn.Sequential(nn.Linear(hidden, width), ScatterSequence(degree))
    model.drop = nn.Sequential(model.drop, ScatterSequence(degree))
    vocab = model.head.out_features
    model.head = nn.Sequential(GatherSequence(degree), nn.Linear(width, -(-vocab // degree), bias=False))


def chained(*steps: Callable[[nn.Module], None] | None) -> Callable[[nn.Module], None]:
    """One ``prepare`` of tools.estimates.activations that takes ``steps`` in turn (None: no step)."""

    def prepare(model: nn.Module) -> None:
        for step in steps:
            if step is not None:
                step(model)

    return prepare
