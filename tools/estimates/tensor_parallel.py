"""FSDP2 plus tensor parallelism (fsdp/train_transformer_fsdp2_tp.py), as the estimators count it: what each
rank keeps of every parameter, and the all-reduces tensor parallelism adds to a step.

The script splits each Block over the T ranks of a tensor-parallel group, then FSDP2 shards each rank's
pieces over the D = world / T groups ("dp"). Per Block, T splits:

    attn.qkv.weight   (3d, d)    by rows, each of q, k and v in T (FusedColwiseParallel): (3d/T, d)
    mlp.fc            (4d, d)    weight and bias by rows (ColwiseParallel): (4d/T, d) and (4d/T,)
    attn.proj.weight  (d, d)     by columns (RowwiseParallel): (d, d/T)
    mlp.proj.weight   (d, 4d)    by columns: (d, 4d/T)

and leaves whole on every rank of the group: the row-wise layers' biases (added once, after the sum), the
LayerNorms, and outside the Blocks the embeddings, the final norm and the head. FSDP2 then cuts every piece
along its first dimension, as in the FSDP2 script, but the fused q|k|v piece along its columns
(the script's shard_placement_fn): ``fsdp_shapes`` writes that one transposed, so that the "dim0"
counting of tools.estimates.shard_sizes counts each rank's share exactly.

Each row-wise layer ends forward with an all-reduce of its partial output over the group, and each
column-wise layer's input gradient is one in backward: 2 + 2 per Block and micro-step, each of the
micro-batch's hidden states, batch x block_size x d_model in the compute dtype (activation checkpointing,
not counted here, would run forward's twice). The gradient-norm clipping adds, per mesh of gradients (the
split layers' on (dp, tp), the rest on dp), an fp32 all-reduce of one value per tensor over each of that
mesh's dimensions; a dimension of one rank sends nothing. For the peak, ``local_blocks`` gives a GPT the
Blocks one rank computes, whose activations tools.estimates.activations measures.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch.nn as nn

from tools.estimates.shard_sizes import FP32

COLUMN_WISE = ("attn.qkv.", "mlp.fc.")  # split by their outputs: weight rows and bias
ROW_WISE = ("attn.proj.", "mlp.proj.")  # split by their inputs: weight columns; the bias stays whole
FUSED = "attn.qkv.weight"  # FSDP2 shards it by its columns, after TP cut its rows in thirds
FORWARD_ALL_REDUCES = 2  # per Block: the attention's and the MLP's row-wise output
BACKWARD_ALL_REDUCES = 2  # per Block: the column-wise layers' input gradients


def is_split(name: str) -> bool:
    """Whether the script's parallelize_module puts this parameter on the (dp, tp) mesh: every parameter of
    the four parallelised layers of a Block, the row-wise biases too (replicated over tp)."""
    return name.startswith("blocks.") and any(f".{layer}" in name for layer in (*COLUMN_WISE, *ROW_WISE))


def tp_piece(name: str, shape: Sequence[int], degree: int) -> tuple[int, ...]:
    """What one rank of a tensor-parallel group of ``degree`` keeps of this parameter (all ranks alike)."""
    shape = tuple(shape)
    if degree == 1 or not name.startswith("blocks."):
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


def check_degree(degree: int, world_size: int, heads: int, d_model: int, lora_rank: int | None = None) -> None:
    """ValueError for a tensor-parallel group of ``degree`` ranks that the script cannot run in this job."""
    if degree == 1:
        return
    if world_size % degree:
        raise ValueError(f"--tp-degree {degree} does not divide the world size {world_size}")
    if heads % degree:
        raise ValueError(f"--tp-degree {degree} must divide the attention heads ({heads}): a rank holds whole heads")
    if d_model % (world_size // degree):
        # FSDP2 cuts the q|k|v piece by its columns, and refuses an uneven cut of any dimension but the first
        # (torch 2.14.1: "FSDP does not support uneven sharding on dim 1").
        raise ValueError(
            f"the {world_size // degree} data-parallel groups must divide the width ({d_model}): FSDP2 cuts the "
            "q|k|v weight by its columns, evenly only"
        )
    if lora_rank:
        raise ValueError("--lora-rank with --tp-degree above 1: the script does not split the adapters' layers")


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
        """One TP all-reduce's message: the micro-batch's hidden states in the compute dtype."""
        return self.batch * self.block_size * self.d_model * compute_bytes


def tp_collectives(
    tp: TensorParallel, blocks: int, compute_bytes: int, micro_steps: int = 1
) -> list[tuple[str, int, int]]:
    """The activation all-reduces of one optimizer step, ``(kind, message bytes, group size)``: every micro-step,
    every Block, forward and backward; none in a group of one."""
    if tp.degree == 1:
        return []
    count = micro_steps * blocks * (FORWARD_ALL_REDUCES + BACKWARD_ALL_REDUCES)
    return [("all_reduce", tp.activation_bytes(compute_bytes), tp.degree)] * count


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


def local_blocks(model: nn.Module, degree: int) -> None:
    """Make ``model``'s Blocks what one rank of a group computes (its heads, its hidden units), so that a measure of
    its activations (tools.estimates.activations, ``prepare``) counts a tensor-parallel rank's; the residual stream,
    the norms, the embeddings and the logits stay whole, as they do on the rank."""
    for block in model.blocks:
        width = block.attn.qkv.in_features
        block.attn.qkv = nn.Linear(width, 3 * width // degree, bias=False)
        block.attn.proj = nn.Linear(width // degree, width)
        block.attn.n_head //= degree
        block.mlp.fc = nn.Linear(width, block.mlp.fc.out_features // degree)
        block.mlp.proj = nn.Linear(block.mlp.proj.in_features // degree, width)


def chained(*steps: Callable[[nn.Module], None] | None) -> Callable[[nn.Module], None]:
    """One ``prepare`` of tools.estimates.activations that takes ``steps`` in turn (None: no step)."""

    def prepare(model: nn.Module) -> None:
        for step in steps:
            if step is not None:
                step(model)

    return prepare
