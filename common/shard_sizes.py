"""How much of a model the busiest rank holds under each way of cutting it, and how many bytes a gathered
element takes in each compute precision: what both estimators (memory and communication) build on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

COMPUTE_BYTES = {"fp32": 4, "bf16": 2}


def largest_shard_numel(shapes: Iterable[Sequence[int]], shard_group: int, layout: str) -> int:
    """Parameter elements held by the rank that holds the most.

    FSDP1 pads each unit's flat parameter to a multiple of the group size; the
    padding (fewer than ``shard_group`` elements per unit) is not counted here,
    and it is not a parameter either, so the runs do not count it.
    """
    shapes = [tuple(shape) for shape in shapes]
    if layout == "replicated" or shard_group == 1:
        return sum(math.prod(shape) for shape in shapes)
    if layout == "flat":
        return math.ceil(sum(math.prod(shape) for shape in shapes) / shard_group)
    if layout == "dim0":
        # torch.chunk's rule: pieces of ceil(rows / group) rows, so rank 0's is never smaller.
        return sum(math.ceil(shape[0] / shard_group) * math.prod(shape[1:]) for shape in shapes if shape)
    raise ValueError(f"unknown layout {layout!r}; expected replicated, flat or dim0")
