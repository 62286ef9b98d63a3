"""How much of a model the busiest rank holds under each way of cutting it, how FSDP groups and pads the
units it gathers, and how many bytes a gathered element takes in each compute precision: what both
estimators (memory and communication) build on.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from common.fine_tuning import is_adapter

COMPUTE_BYTES = {"fp32": 4, "bf16": 2}
FP32 = 4
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, both fp32
ADAM_STEP_BYTES = 4  # one float32 scalar per parameter tensor
FSDP1_ALIGNMENT_BYTES = 16  # FSDP1 with use_orig_params starts every parameter at this boundary


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


def fsdp1_starts(tensor_elements: Sequence[int], compute_bytes: int) -> list[int]:
    """Where each parameter starts in its FSDP1 unit's flat parameter: with use_orig_params, FSDP1 starts
    every parameter at a 16-byte boundary of the compute dtype."""
    align = FSDP1_ALIGNMENT_BYTES // compute_bytes
    starts, total = [], 0
    for numel in tensor_elements:
        start = math.ceil(total / align) * align
        starts.append(start)
        total = start + numel
    return starts


def fsdp1_flat_elements(tensor_elements: Sequence[int], shard_group: int, compute_bytes: int) -> int:
    """The elements of one FSDP1 unit's flat parameter, as its all-gather and reduce-scatter carry them:
    the parameters where ``fsdp1_starts`` puts them, the whole padded to a multiple of the group, so every
    rank's shard is the same size."""
    if not tensor_elements:
        return 0
    total = fsdp1_starts(tensor_elements, compute_bytes)[-1] + tensor_elements[-1]
    return math.ceil(total / shard_group) * shard_group


def fsdp1_rank_shares(
    tensors: Sequence[tuple[int, bool]], shard_group: int, compute_bytes: int
) -> list[tuple[int, int, int]]:
    """What each rank holds of one FSDP1 unit, whose parameters are ``(elements, trains)``: its elements,
    its trainable elements, and the trainable tensors with a part in its shard.

    FSDP1 cuts the flat parameter into equal pieces wherever the parameters start, so a parameter may
    fall into two ranks' pieces and one rank may hold more of the unit's trainable values than another.
    With use_orig_params a rank keeps gradients (and AdamW keeps state) for the trainable parts of its
    piece only: what the runs' local_state_bytes count.
    """
    numels = [numel for numel, _ in tensors]
    starts = fsdp1_starts(numels, compute_bytes)
    piece = fsdp1_flat_elements(numels, shard_group, compute_bytes) // shard_group
    shares = []
    for rank in range(shard_group):
        low, high = rank * piece, (rank + 1) * piece
        held = [max(0, min(start + numel, high) - max(start, low)) for start, numel in zip(starts, numels, strict=True)]
        trained = [part for part, (_, trains) in zip(held, tensors, strict=True) if trains]
        shares.append((sum(held), sum(trained), sum(1 for part in trained if part)))
    return shares


def dim0_rank_shares(tensors: Sequence[tuple[Sequence[int], bool]], shard_group: int) -> list[tuple[int, int, int]]:
    """``fsdp1_rank_shares`` for FSDP2, which cuts every parameter along dim 0 as torch.chunk does: pieces of
    ceil(rows / group) rows, the last ranks' smaller or empty. Every rank holds a (DTensor) gradient and AdamW
    state for every trainable parameter, if only an empty piece and its step count."""
    shares = []
    for rank in range(shard_group):
        held, trained = 0, 0
        for shape, trains in tensors:
            rows, row = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
            chunk = math.ceil(rows / shard_group)
            part = max(0, min(rows, (rank + 1) * chunk) - rank * chunk) * row
            held += part
            trained += part if trains else 0
        shares.append((held, trained, sum(1 for _, trains in tensors if trains)))
    return shares


def rank_shares(
    shapes: Mapping[str, Sequence[int]],
    shard_group: int,
    layout: str,
    trainable: Collection[str] | None = None,
    precision: str = "fp32",
) -> list[tuple[int, int, int]]:
    """Per rank of a shard group, summed over the model: elements held, trainable elements held, and
    trainable tensors with a part held (each one AdamW step count), for the scripts' GPT with ``layout``
    ("replicated", "flat" for FSDP1, "dim0" for FSDP2; see tools.estimates.estimate_memory.LAYOUTS)."""
    trains = set(shapes) if trainable is None else set(trainable)
    if layout == "replicated" or shard_group == 1:
        tensors = [(math.prod(shape), name in trains) for name, shape in shapes.items()]
        return [(sum(n for n, _ in tensors), sum(n for n, t in tensors if t), sum(t for _, t in tensors))]
    if layout == "dim0":
        return dim0_rank_shares([(shape, name in trains) for name, shape in shapes.items()], shard_group)
    if layout != "flat":
        raise ValueError(f"unknown layout {layout!r}; expected replicated, flat or dim0")
    compute = COMPUTE_BYTES.get(precision, 2)
    totals = [[0, 0, 0] for _ in range(shard_group)]
    for names in fsdp_unit_names(shapes, adapters_apart=True).values():
        unit = [(math.prod(shapes[name]), name in trains) for name in names]
        for total, share in zip(totals, fsdp1_rank_shares(unit, shard_group, compute), strict=True):
            for kind, value in enumerate(share):
                total[kind] += value
    return [(held, trained, tensors) for held, trained, tensors in totals]


def fsdp2_padded_elements(shapes: Sequence[Sequence[int]], shard_group: int) -> int:
    """FSDP2 cuts each parameter along dim 0 into equal, padded pieces: the group times the largest."""
    return shard_group * largest_shard_numel(shapes, shard_group, "dim0")


def fsdp_units(
    shapes: Mapping[str, Sequence[int]], prefixes: Sequence[str] | None = None, *, adapters_apart: bool = False
) -> dict[str, list]:
    """Parameter shapes per FSDP unit: one unit per name prefix, the rest in the root unit.

    ``shapes`` maps state-dict names (model.pt's) to shapes, in the model's order. The default
    prefixes are the GPT's Blocks (``blocks.0.``, ...), as the transformer scripts wrap them.
    """
    names = fsdp_unit_names(shapes, prefixes, adapters_apart=adapters_apart)
    return {unit: [tuple(shapes[name]) for name in members] for unit, members in names.items()}


def fsdp_unit_names(
    shapes: Mapping[str, Sequence[int]], prefixes: Sequence[str] | None = None, *, adapters_apart: bool = False
) -> dict[str, list[str]]:
    """``fsdp_units`` by parameter name. ``adapters_apart``: each LoRA adapter a unit of its own inside its
    Block's, as the FSDP1 script wraps them (a parameter belongs to the longest prefix it starts with)."""
    if prefixes is None:
        prefixes = sorted({".".join(n.split(".")[:2]) + "." for n in shapes if n.startswith("blocks.")})
    if adapters_apart:
        prefixes = [*prefixes, *sorted({n.rsplit(".", 1)[0] + "." for n in shapes if is_adapter(n)})]
    units: dict[str, list[str]] = {"root": []}
    for name in shapes:
        owner = max((p for p in prefixes if name.startswith(p)), key=len, default="root.")
        units.setdefault(owner.rstrip("."), []).append(name)
    return units


@dataclass(frozen=True)
class StateBytes:
    """Bytes of model state one rank holds, by kind."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer}


def between_steps(
    shapes: Iterable[Sequence[int]] | Mapping[str, Sequence[int]],
    shard_group: int,
    layout: str,
    trainable: Collection[str] | None = None,
    precision: str = "fp32",
) -> StateBytes:
    """AdamW model state a rank holds between two steps: fp32 weights of its shard, gradients and moments of
    what trains in it. Shapes by name count each rank's shard as the scripts cut the GPT (FSDP1's units and
    padding, LoRA adapters: ``rank_shares``), ``trainable`` the names that train (None: all); a
    list of shapes, all training, counts FSDP1's units as one flat tensor."""
    if isinstance(shapes, Mapping):
        shares = rank_shares(shapes, shard_group, layout, trainable, precision)
        return StateBytes(
            params=FP32 * max(held for held, _, _ in shares),
            grads=FP32 * max(trained for _, trained, _ in shares),
            optimizer=max(ADAM_MOMENTS * FP32 * trained + ADAM_STEP_BYTES * tensors for _, trained, tensors in shares),
        )
    shapes = list(shapes)
    numel = largest_shard_numel(shapes, shard_group, layout)
    return StateBytes(
        params=FP32 * numel,
        grads=FP32 * numel,
        optimizer=ADAM_MOMENTS * FP32 * numel + ADAM_STEP_BYTES * len(shapes),
    )
