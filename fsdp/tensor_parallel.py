"""What fsdp/train_transformer_fsdp2_tp.py needs beside its parallelize plan: its flag and the checks of it, a
parallel style for the fused q|k|v projection, the layout in which DCP saves that projection's pieces, and clipping
over two meshes. Kept beside the script rather than in common/, so that a copy of any other script carries none of
it (tests/test_layout.py's budget), and a copy of this script takes this file with it."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ColwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

from common import cli, flags
from common.distributed import env_world_size


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
    Any other tensor as it is. The checkpoint's identity says "qkv": "3 parts": an unsplit run's does not fit it."""
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
