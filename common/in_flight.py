"""What a rank holds gathered during a step, above its own shards: common.estimate_memory's "in flight" term.

A step peaks early in backward, in the last Block's, while every activation is still alive. FSDP then
holds gathered the root unit (embeddings, final norm, head) and the last Block, both kept from forward
into backward, and the Block before it, gathered ahead of its backward; under shard_grad_op every unit,
kept from forward. Each counts as its all-gather assembles it, padding included. DDP gathers nothing,
but under bf16 autocast forward saves a bf16 copy of each weight for backward. With a small batch the
peak moves to a unit's reduce-scatter, whose buffers ``reduce_scatter_bytes`` adds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from common.activations import ActivationBytes
from common.shard_sizes import COMPUTE_BYTES, fsdp1_flat_elements, fsdp2_padded_elements, fsdp_units

FP32 = 4
PREFETCHED_UNITS = 2  # the Block computing its backward and the one gathered ahead of it
STRATEGIES = ("ddp", "full_shard", "shard_grad_op", "hybrid_shard")


@dataclass(frozen=True)
class GatheredUnits:
    """Elements one all-gather assembles, padding included: the root unit (what no Block holds) and a Block."""

    root: float
    block: float
    blocks: int


def gathered_units(shapes: Mapping[str, Sequence[int]], layout: str, shard_group: int, precision: str) -> GatheredUnits:
    """The GPT's units as FSDP1 ("flat") or FSDP2 ("dim0") gathers them, from its parameters' shapes by name."""
    units = fsdp_units(shapes)
    compute = COMPUTE_BYTES[precision]

    def elements(unit_shapes: list) -> int:
        if layout == "flat":
            return fsdp1_flat_elements([math.prod(shape) for shape in unit_shapes], shard_group, compute)
        return fsdp2_padded_elements(unit_shapes, shard_group)

    blocks = [elements(unit_shapes) for name, unit_shapes in units.items() if name != "root"]
    return GatheredUnits(elements(units["root"]), max(blocks, default=0), len(blocks))


def in_flight_bytes(
    strategy: str, units: GatheredUnits, precision: str, *, weight_copies: float | None = None, gradients: bool = False
) -> float:
    """Bytes gathered during backward, where a step peaks, on top of the sharded state (the module docstring).

    ``weight_copies``: DDP's autocast copies as measured (default: every weight, 2 bytes each).
    ``gradients``: add one Block's fp32 gradients, unsharded until reduce-scatter, where no backward was
    measured to hold them.
    """
    compute = COMPUTE_BYTES[precision]
    model = units.root + units.blocks * units.block
    if strategy == "ddp":
        if precision == "fp32":
            return 0.0
        return compute * model if weight_copies is None else weight_copies
    unsharded_gradients = FP32 * units.block if gradients else 0.0
    if strategy in ("full_shard", "hybrid_shard"):
        return compute * (units.root + PREFETCHED_UNITS * units.block) + unsharded_gradients
    if strategy == "shard_grad_op":
        return compute * model + unsharded_gradients
    raise ValueError(f"unknown strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")


def reduce_scatter_bytes(
    layout: str, units: GatheredUnits, shard_group: int, precision: str, activations: ActivationBytes
) -> float:
    """What a unit's reduce-scatter adds where it, not the start of backward, is the step's peak (a small
    batch: the gathered units and their gradients outweigh the activations), on top of ``activations``.

    Measured against common.simulate's runs of the real wraps: FSDP1 ("flat") copies a unit's gradients into
    one flat gradient in the compute dtype (under bf16 the fp32 shard it reduces into comes while both are
    alive); FSDP2 ("dim0") keeps the last reduce-scatter's fp32 input, padded, until the next one. The
    shards reduced so far are the sharded gradients, which a step holds from then on.
    """
    shard = FP32 * units.block / shard_group
    if layout == "flat":
        extra = COMPUTE_BYTES[precision] * units.block + (shard if precision == "bf16" else 0)
        at = [end + extra + done * shard for done, end in enumerate(activations.unit_ends)]
    else:
        at = [peak + FP32 * units.block + done * shard for done, peak in enumerate(activations.unit_peaks) if done]
    return max(0.0, max(at, default=0.0) - activations.backward)
