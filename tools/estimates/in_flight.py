"""What a rank holds gathered during a step, above its own shards: tools.estimates.estimate_memory's "in flight" term.

A step peaks early in backward, in the last Block's, while every activation is still alive. FSDP then
holds gathered the root unit (embeddings, final norm, head) and the last Block, both kept from forward
into backward, and the Block before it, gathered ahead of its backward; under shard_grad_op every unit,
kept from forward. Each counts as its all-gather assembles it, padding included. DDP gathers nothing,
but under bf16 autocast forward saves a bf16 copy of each weight for backward. With a small batch the
peak moves to a unit's reduce-scatter, whose buffers ``reduce_scatter_bytes`` adds.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from tools.estimates.activations import ActivationBytes
from tools.estimates.shard_sizes import COMPUTE_BYTES, FP32, fsdp1_flat_elements, fsdp2_padded_elements, fsdp_unit_names
from tools.strategies import TEXTBOOK

PREFETCHED_UNITS = 2  # the Block computing its backward and the one gathered ahead of it
STRATEGIES = TEXTBOOK


@dataclass(frozen=True)
class GatheredUnits:
    """Elements one all-gather assembles, padding included: the root unit (what no Block holds) and a Block;
    and of a Block's gradient, what its reduce-scatter carries (padding included) and the values that train."""

    root: float
    block: float
    blocks: int
    reduced: float  # in full training, the Block as gathered
    trained: float  # in full training, the Block's values


def gathered_units(
    shapes: Mapping[str, Sequence[int]],
    layout: str,
    shard_group: int,
    precision: str,
    trainable: Collection[str] | None = None,
) -> GatheredUnits:
    """The GPT's units as FSDP2 ("dim0") or FSDP1 (any other layout: "flat", and "replicated" unpadded, a group
    of one) gathers them, from its parameters' shapes by name;
    ``trainable``: the names that train (None: all). FSDP1 reduces a unit's whole flat gradient once anything
    in it trains, FSDP2 the trainable parameters, each padded."""
    compute = COMPUTE_BYTES[precision]
    trains = set(shapes) if trainable is None else set(trainable)

    def elements(names: list[str]) -> int:
        if layout == "dim0":
            return fsdp2_padded_elements([shapes[name] for name in names], shard_group)
        return fsdp1_flat_elements([math.prod(shapes[name]) for name in names], shard_group, compute)

    def reduced(names: list[str]) -> int:
        if layout == "dim0":
            return elements([name for name in names if name in trains])
        return elements(names) if trains.intersection(names) else 0

    units = fsdp_unit_names(shapes)
    blocks = [names for unit, names in units.items() if unit != "root"]
    return GatheredUnits(
        root=elements(units["root"]),
        block=max(map(elements, blocks), default=0),
        blocks=len(blocks),
        reduced=max(map(reduced, blocks), default=0),
        trained=max((sum(math.prod(shapes[n]) for n in names if n in trains) for names in blocks), default=0),
    )


def in_flight_bytes(
    strategy: str,
    units: GatheredUnits,
    precision: str,
    *,
    weight_copies: float | None = None,
    gradients: bool = False,
    alone: str | None = None,
) -> float:
    """Bytes gathered during backward, where a step peaks, on top of the sharded state (the module docstring).

    ``weight_copies``: DDP's autocast copies as measured (default: every weight, 2 bytes each).
    ``gradients``: add one Block's fp32 gradients, unsharded until reduce-scatter, where no backward was
    measured to hold them. ``alone``: the layout ("dim0", "flat") of a shard group of one rank, where
    ``ahead_of_time`` says what is gathered.
    """
    compute = COMPUTE_BYTES[precision]
    model = units.root + units.blocks * units.block
    if strategy == "ddp":
        if precision == "fp32":
            return 0.0
        return compute * model if weight_copies is None else weight_copies
    unsharded_gradients = FP32 * units.block if gradients else 0.0
    if alone == "flat" and precision == "fp32":
        return unsharded_gradients  # torch runs FSDP1 at one rank as no_shard, whose units are the parameters
    if strategy in ("full_shard", "hybrid_shard"):
        blocks = PREFETCHED_UNITS if ahead_of_time(alone) else 1
        return compute * (units.root + blocks * units.block) + unsharded_gradients
    if strategy == "shard_grad_op":
        return compute * model + unsharded_gradients
    raise ValueError(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")


def ahead_of_time(alone: str | None) -> bool:
    """Whether the Block before the one computing its backward is gathered already: not in FSDP2's shard groups of
    one, whose "all-gather" (torch 2.14: ``FSDPParamGroup.unshard``) is a copy of the shard made only when the unit
    waits for it, to run; by then the Block after it has been freed."""
    return alone != "dim0"


def reduce_scatter_bytes(
    layout: str, units: GatheredUnits, shard_group: int, precision: str, activations: ActivationBytes
) -> float:
    """What a unit's reduce-scatter adds where it, not the start of backward, is the step's peak (a small
    batch: the gathered units and their gradients outweigh the activations), on top of ``activations``.

    Measured against tools.estimates.simulate's runs of the real wraps, unit by unit (``activations.unit_peaks``
    and ``unit_ends``, counted after ``done`` units were reduced, whose shards are the sharded gradients
    a step holds from then on):
    - FSDP1 ("flat") copies a unit's gradients into one flat gradient in the compute dtype; under bf16
      the fp32 shard it reduces into comes while both are alive.
    - FSDP2 ("dim0") keeps a reduce-scatter's fp32 input, padded, until the next one: through the next
      unit's backward, where the last unit has no next one gathered ahead; and right after the
      reduce-scatter, its gradients freed and the unit still gathered.
    """
    compute = COMPUTE_BYTES[precision]
    reduced = units.reduced
    shard = FP32 * reduced / shard_group
    if layout != "dim0":
        extra = compute * reduced + (shard if precision == "bf16" else 0)
        at = [end + extra + done * shard for done, end in enumerate(activations.unit_ends)]
    else:
        last = len(activations.unit_peaks) - 1
        at = [
            peak + FP32 * reduced + done * shard - (compute * units.block if done == last and shard_group > 1 else 0)
            for done, peak in enumerate(activations.unit_peaks)
            if done
        ]
        freed = compute * units.trained
        at += [end - freed + FP32 * reduced + (done + 1) * shard for done, end in enumerate(activations.unit_ends)]
    return max(0.0, max(at, default=0.0) - activations.backward)
