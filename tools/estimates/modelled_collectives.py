"""The collectives of one optimizer step, modelled: which kinds, of how many bytes, on groups of how many
ranks, for DDP and each FSDP strategy, from a model's parameter shapes or from its size alone.

N ranks, P parameters in L FSDP units, K accumulation micro-steps; c bytes per gathered element
(4 for fp32, 2 for bf16: the gathered copies are in the compute dtype), r bytes per reduced
gradient element (4: the scripts reduce in fp32 under every precision). Message sizes per step:

    DDP                 all-reduce r x P once per optimizer step (``no_sync`` on the other micro-steps),
                        in buckets (the first of 1 MiB, then 25 MiB each)
    full_shard, FSDP2   all-gather c x P_u before each unit's forward, and again before its backward
                        if it was resharded after forward; reduce-scatter r x P_u once per unit
    shard_grad_op       the forward all-gather only: units stay gathered from forward to backward
    hybrid, HSDP        full_shard inside groups of M ranks, then all-reduce r x P_u / M of each
                        reduced shard across the N / M groups

Under accumulation (``no_sync`` / ``set_requires_gradient_sync(False)``), measured on torch 2.14:
FSDP1 full_shard and hybrid and FSDP2 free the gathered parameters after every backward and gather
them again in the next micro-step's forward (K times the all-gathers), but reduce-scatter once.
FSDP1 shard_grad_op keeps them gathered between micro-steps: the all-gathers of K = 1. Which units
reshard after forward, and whether micro-steps reduce, are parameters (``FsdpBehaviour``), not
assumptions: they change with how a script calls FSDP.

On a ring of n ranks a rank sends (n-1)/n of each all-gather's or reduce-scatter's message and
2(n-1)/n of each all-reduce's; ``step_seconds`` divides those bytes by a link's bandwidth. Messages are
padded as FSDP pads them: FSDP1 starts each parameter at a 16-byte boundary (``use_orig_params``)
and pads each unit to a multiple of the group; FSDP2 pads each parameter's first dimension to a
multiple of the group.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common.collectives import Traffic
from tools.estimates.shard_sizes import (
    COMPUTE_BYTES,
    fsdp1_flat_elements,
    fsdp2_padded_elements,
    fsdp_unit_names,
)
from tools.estimates.tensor_parallel import TensorParallel, fsdp_shapes, group_collectives, norm_collectives

FP32 = 4
REDUCE_BYTES = FP32  # every script reduces gradients in fp32, whatever it computes in
DDP_FIRST_BUCKET_BYTES = 2**20  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default


def ddp_bucket_sizes(tensor_bytes: Sequence[int]) -> list[int]:
    """DDP's gradient buckets: filled in reverse order of the parameters, the first closed at 1 MiB, the rest at 25.

    A parameter is never split, so a bucket closes once it reaches its cap. (After its first
    iteration DDP rebuilds the buckets in the order gradients became ready, usually this one.)
    """
    buckets: list[int] = []
    current = 0
    for size in reversed(tensor_bytes):
        current += size
        if current >= (DDP_FIRST_BUCKET_BYTES if not buckets else DDP_BUCKET_BYTES):
            buckets.append(current)
            current = 0
    if current:
        buckets.append(current)
    return buckets


def ddp_step(
    tensor_elements: Sequence[int], world_size: int, micro_steps: int = 1, sync_every_micro_step: bool = False
) -> Traffic:
    """DDP: all-reduce every gradient, bucket by bucket, in fp32; once per step under ``no_sync``."""
    reductions = micro_steps if sync_every_micro_step else 1
    buckets = ddp_bucket_sizes([FP32 * n for n in tensor_elements])
    return Traffic.of(("all_reduce", size, world_size) for _ in range(reductions) for size in buckets)


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: the elements one all-gather of it assembles (padding included), and those one
    reduce-scatter of its gradient carries: None for all of them, 0 for a unit with nothing to train."""

    name: str
    elements: int
    reshard_after_forward: bool = True
    regathers: bool = True  # under no_sync: freed after each micro-step's backward, gathered again
    reduced_elements: int | None = None

    @property
    def reduced(self) -> int:
        return self.elements if self.reduced_elements is None else self.reduced_elements


@dataclass(frozen=True)
class FsdpBehaviour:
    """What a script's FSDP calls decide, beyond the strategy.

    - ``root_reshards`` / ``last_block_reshards``: whether those units are freed after forward (and
      so gathered again for backward).
    - ``regather_each_micro_step``: under accumulation, whether units are freed after each
      micro-step's backward and gathered again in the next forward; ``last_block_regathers`` for
      the last Block (FSDP1's SHARD_GRAD_OP units keep their parameters between micro-steps).
    - ``sync_every_micro_step``: whether every micro-step reduces its gradients (no ``no_sync``).
    """

    blocks_reshard: bool = True
    root_reshards: bool = True
    last_block_reshards: bool = True
    regather_each_micro_step: bool = True
    sync_every_micro_step: bool = False
    last_block_regathers: bool = True


def fsdp_step(
    units: Sequence[Unit],
    shard_group: int,
    replicas: int = 1,
    gather_bytes: int = FP32,
    micro_steps: int = 1,
    regather_each_micro_step: bool = True,
    sync_every_micro_step: bool = False,
) -> Traffic:
    """FSDP: per micro-step and unit, an all-gather before forward unless the unit is still gathered,
    another before backward if it was freed after forward; a reduce-scatter of its gradient (and,
    with replicas, an all-reduce of the reduced shard across them) when the micro-step reduces."""
    return Traffic.of(
        fsdp_collectives(
            units, shard_group, replicas, gather_bytes, micro_steps, regather_each_micro_step, sync_every_micro_step
        )
    )


def fsdp_collectives(
    units: Sequence[Unit],
    shard_group: int,
    replicas: int = 1,
    gather_bytes: int = FP32,
    micro_steps: int = 1,
    regather_each_micro_step: bool = True,
    sync_every_micro_step: bool = False,
) -> list[tuple[str, int, int]]:
    """``fsdp_step``'s collectives one by one, in order: ``(kind, message bytes, group size)``."""
    collectives = []
    for micro_step in range(micro_steps):
        reduces = sync_every_micro_step or micro_step == micro_steps - 1
        for unit in units:
            # Units stay gathered into the next micro-step only if the last one did not reduce: FSDP
            # frees them after every backward that reduces.
            regathers = regather_each_micro_step and unit.regathers
            still_gathered = micro_step > 0 and not (regathers or sync_every_micro_step)
            if not still_gathered:
                collectives.append(("all_gather", gather_bytes * unit.elements, shard_group))
            if unit.reshard_after_forward:
                collectives.append(("all_gather", gather_bytes * unit.elements, shard_group))
            if reduces and unit.reduced:
                collectives.append(("reduce_scatter", REDUCE_BYTES * unit.reduced, shard_group))
                if replicas > 1:
                    collectives.append(("all_reduce", REDUCE_BYTES * unit.reduced // shard_group, replicas))
    return collectives


def script_scalars(strategy: str, tensors: int, world_size: int, shard_group: int, loss_check: bool) -> Traffic:
    """The small all-reduces a training script adds to a step: the ranks' agreement that the loss is
    finite (one int64, when the step checks it), and the gradient norm's partial sums: FSDP1 adds one
    fp32 across its shards, FSDP2's DTensor one fp32 per parameter tensor with a gradient; DDP and
    no_shard hold whole gradients and add nothing."""
    return Traffic.of(scalar_collectives(strategy, tensors, world_size, shard_group, loss_check))


def scalar_collectives(
    strategy: str, tensors: int, world_size: int, shard_group: int, loss_check: bool
) -> list[tuple[str, int, int]]:
    """``script_scalars`` one by one."""
    collectives = [("all_reduce", 8, world_size)] if loss_check else []
    if strategy in ("fsdp1_full_shard", "fsdp1_shard_grad_op", "fsdp1_hybrid_shard"):
        collectives.append(("all_reduce", FP32, shard_group))
    elif strategy in ("fsdp2", "fsdp2_hsdp"):
        collectives.append(("all_reduce", FP32 * tensors, shard_group))
    return collectives


# How each script's "strategy" (the final record's field) uses FSDP today. FSDP1 never frees the root
# unit after forward (its backward starts there); the FSDP2 script passes reshard_after_forward to the
# root and every Block alike.
def current_behaviour(
    strategy: str, reshard_after_forward: bool = True, precision: str = "fp32", transformer: bool = True
) -> FsdpBehaviour:
    """What the script behind ``strategy`` does (for FSDP2, its --[no-]reshard-after-forward).

    The transformer scripts keep the root and the last Block gathered from forward to backward (FSDP1
    makes the last Block a SHARD_GRAD_OP unit, which also keeps it between no_sync micro-steps); the
    MNIST script's size-based units keep only FSDP1's root. FSDP1 in low precision reduces every
    micro-step instead of accumulating under no_sync.
    """
    low_precision = precision != "fp32"
    if strategy in ("fsdp1_full_shard", "fsdp1_hybrid_shard"):
        return FsdpBehaviour(
            root_reshards=False,
            last_block_reshards=not transformer,
            last_block_regathers=not transformer,
            sync_every_micro_step=low_precision,
        )
    if strategy == "fsdp1_shard_grad_op":
        return FsdpBehaviour(False, False, False, regather_each_micro_step=False, sync_every_micro_step=low_precision)
    if strategy in ("fsdp2", "fsdp2_hsdp"):
        return FsdpBehaviour(blocks_reshard=reshard_after_forward, root_reshards=False, last_block_reshards=False)
    raise ValueError(f"no FSDP behaviour for strategy {strategy!r}")


def run_estimate(*args: Any, **kwargs: Any) -> Traffic:
    """``run_collectives``, summed: what one step of this repository's run sends, by kind."""
    return Traffic.of(run_collectives(*args, **kwargs))


def run_collectives(
    strategy: str,
    shapes: Mapping[str, Sequence[int]],
    world_size: int,
    shard_group: int,
    precision: str = "fp32",
    micro_steps: int = 1,
    *,
    behaviour: FsdpBehaviour | None = None,
    unit_prefixes: Sequence[str] | None = None,
    loss_check: bool = True,
    trainable: Collection[str] | None = None,
    tp: TensorParallel | None = None,
) -> list[tuple[str, int, int]]:
    """The collectives of one step of this repository's run, one by one as ``(kind, message bytes, group
    size)``: from its final record's strategy and sizes and the shapes of its model.pt, plus the script's
    own small all-reduces (``script_scalars``).

    ``behaviour`` defaults to what the script does today (``current_behaviour``); ``unit_prefixes``
    to the GPT's Blocks (the MNIST script wraps only ``fc1.``). ``trainable``: the names that train
    (--freeze, --lora-rank; None: all of them). A frozen parameter is all-gathered as before, but DDP
    buckets, and FSDP reduce-scatters, only the trainable ones: FSDP2 per parameter, FSDP1 per unit
    (its flat gradient covers the whole unit as soon as one of its parameters trains). FSDP1 makes each
    LoRA adapter a unit of its own. Frozen units are gathered for backward as before, even where no
    gradient passes through them (the first Blocks, with the embeddings frozen too): both FSDPs prefetch
    the next unit of backward whether it needs it or not (measured at 2 ranks, torch 2.14).
    ``tp``: for "fsdp2_tp" split into groups (world size / shard group ranks each), its micro-batch, whose
    hidden states the tensor-parallel all-reduces carry (tools.estimates.tensor_parallel).
    """
    trains = set(shapes) if trainable is None else set(trainable)
    degree = world_size // shard_group if strategy == "fsdp2_tp" else 1
    if degree > 1:
        return tensor_parallel_step(
            shapes, world_size, shard_group, precision, micro_steps, tp, behaviour, trains, loss_check
        )
    if strategy == "fsdp2_tp":  # a world of one trains the model unsplit: the FSDP2 script's step
        strategy = "fsdp2"
    tensors = sum(name in trains for name in shapes)
    scalars = scalar_collectives(strategy, tensors, world_size, shard_group, loss_check)
    return (
        sharded_collectives(
            strategy, shapes, world_size, shard_group, precision, micro_steps, behaviour, unit_prefixes, trains
        )
        + scalars
    )


def tensor_parallel_step(
    shapes: Mapping[str, Sequence[int]],
    world_size: int,
    dp: int,
    precision: str,
    micro_steps: int,
    tp: TensorParallel | None,
    behaviour: FsdpBehaviour | None,
    trains: set[str],
    loss_check: bool,
) -> list[tuple[str, int, int]]:
    """FSDP2 + TP: FSDP2's gathers and reduce-scatters of each rank's pieces over its ``dp`` ranks, the
    tensor-parallel gathers and scatters of the activations, the loss's and the LayerNorms' all-reduces, and the
    clipping's per-mesh all-reduces."""
    degree = world_size // dp
    if tp is None or tp.degree != degree:
        raise ValueError(f"fsdp2_tp at {world_size} ranks, shards of {dp}: give its micro-batch, as TensorParallel")
    pieces = fsdp_shapes(shapes, degree)
    fsdp = sharded_collectives("fsdp2", pieces, dp, dp, precision, micro_steps, behaviour, None, trains)
    inside_groups = group_collectives(shapes, tp, COMPUTE_BYTES.get(precision, 2), micro_steps, trains)
    agreement = [("all_reduce", 8, world_size)] if loss_check else []  # the finite-loss check, as every script's
    return fsdp + inside_groups + agreement + norm_collectives(shapes, degree, dp, trains)


def sharded_collectives(
    strategy: str,
    shapes: Mapping[str, Sequence[int]],
    world_size: int,
    shard_group: int,
    precision: str,
    micro_steps: int,
    behaviour: FsdpBehaviour | None,
    unit_prefixes: Sequence[str] | None,
    trains: set[str],
) -> list[tuple[str, int, int]]:
    """``run_collectives`` without the script's small all-reduces: DDP's buckets, FSDP's gathers and reductions."""
    if strategy == "ddp":
        buckets = ddp_bucket_sizes([FP32 * math.prod(s) for name, s in shapes.items() if name in trains])
        return [("all_reduce", size, world_size) for size in buckets]
    names = fsdp_unit_names(shapes, unit_prefixes, adapters_apart=strategy.startswith("fsdp1"))
    # On one rank there is nothing to shard: FSDP1 falls back to NO_SHARD, FSDP2 sends nothing.
    if strategy == "fsdp1_no_shard" or (strategy.startswith("fsdp1") and world_size == 1):
        # Every unit's flat gradient all-reduced, once per step (no_sync).
        return [
            ("all_reduce", FP32 * sum(math.prod(shapes[name]) for name in unit), world_size)
            for unit in names.values()
            if trains.intersection(unit)
        ]
    if world_size == 1:
        return []
    behaviour = behaviour or current_behaviour(strategy, precision=precision, transformer=unit_prefixes is None)
    compute = COMPUTE_BYTES.get(precision, 2)  # fp16 gathers 2 bytes, as bf16 does
    last_block = [name for name in names if not name.endswith(".adapter")][-1]
    sized = []
    for name, unit in names.items():
        unit_shapes = [shapes[member] for member in unit]
        if strategy.startswith("fsdp1"):
            elements = fsdp1_flat_elements([math.prod(s) for s in unit_shapes], shard_group, compute)
            reduced_elements = elements if trains.intersection(unit) else 0
        else:
            elements = fsdp2_padded_elements(unit_shapes, shard_group)
            trained = [shapes[member] for member in unit if member in trains]
            reduced_elements = fsdp2_padded_elements(trained, shard_group)
        reshards = {"root": behaviour.root_reshards, last_block: behaviour.last_block_reshards}.get(
            name, behaviour.blocks_reshard
        )
        regathers = name != last_block or behaviour.last_block_regathers
        sized.append(Unit(name, elements, reshards, regathers, reduced_elements))
    return fsdp_collectives(
        sized,
        shard_group,
        world_size // shard_group,
        compute,
        micro_steps,
        behaviour.regather_each_micro_step,
        behaviour.sync_every_micro_step,
    )


def model_collectives(
    strategy: str, params: float, layers: int, world_size: int, shard_group: int, precision: str, micro_steps: int
) -> list[tuple[str, int, int]]:
    """A model of ``params`` parameters in ``layers`` equal units (embeddings counted in them), every
    unit freed after forward but the last: the textbook step's collectives, ``(kind, message bytes,
    group size)``, for models that are not at hand."""
    count = round(params)
    if strategy == "ddp":
        return [("all_reduce", size, world_size) for size in even_ddp_buckets(FP32 * count)]
    group = shard_group if strategy == "hybrid_shard" else world_size
    unit = math.ceil(count / layers / group) * group
    reshards = strategy != "shard_grad_op"
    units = [Unit(f"unit{i}", unit, reshards and i < layers - 1) for i in range(layers)]
    return fsdp_collectives(
        units,
        group,
        world_size // group,
        COMPUTE_BYTES[precision],
        micro_steps,
        regather_each_micro_step=strategy != "shard_grad_op",
    )


def even_ddp_buckets(gradient_bytes: int) -> list[int]:
    """DDP's buckets when no shapes are at hand: 1 MiB, then 25 MiB each, the rest in the last.

    That is what gradients of many small tensors make. Real buckets overshoot the cap to the end of
    a parameter (``ddp_bucket_sizes``): in a large model about one weight matrix each. Larger
    messages reach a higher bandwidth, so times from these are on the long side.
    """
    first = min(gradient_bytes, DDP_FIRST_BUCKET_BYTES)
    full, rest = divmod(gradient_bytes - first, DDP_BUCKET_BYTES)
    return [first] * (first > 0) + [DDP_BUCKET_BYTES] * full + [rest] * (rest > 0)


def step_seconds(strategy: str, traffic: Traffic, fast: float, slow: float, spans_machines: bool) -> float:
    """Time for one step's collectives if nothing overlapped them, in bytes per second per link.

    A ring is as fast as its slowest link: a collective whose group spans machines runs at ``slow``.
    Hybrid sharding keeps its all-gathers and reduce-scatters inside a machine; only its all-reduce
    crosses machines.
    """
    if not spans_machines:
        return traffic.total_ring_bytes / fast
    inside = ("all_gather", "reduce_scatter") if strategy == "hybrid_shard" else ()
    fast_bytes = sum(traffic.ring_bytes.get(kind, 0.0) for kind in inside)
    return fast_bytes / fast + (traffic.total_ring_bytes - fast_bytes) / slow
