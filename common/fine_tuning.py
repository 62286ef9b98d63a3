"""Training part of a model: the parameters ``--freeze`` names keep the values they started with.

A frozen parameter gets no gradient, so the optimizer keeps no state for it and, under DDP, no
bucket holds it and nothing is all-reduced for it. Freezing happens before the wrap: DDP builds its
buckets, and FSDP its units, from the parameters that need gradients when it is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase

import torch.nn as nn

from common.distributed import FatalError, print0


def freeze(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Turn off the gradient of each parameter whose name matches one of ``patterns`` (shell-style
    globs over names as ``model.named_parameters()`` gives them: ``'tok_emb.*'``, ``'blocks.0.*'``).
    Returns the frozen names. A pattern that matches nothing is a typo, not a choice: it is refused,
    as is freezing everything, which would leave the run nothing to train."""
    parameters = dict(model.named_parameters())
    for pattern in patterns:
        if not any(fnmatchcase(name, pattern) for name in parameters):
            examples = ", ".join(list(parameters)[:4])
            raise FatalError(
                f"--freeze {pattern!r} matches no parameter of the model; its parameters are named like {examples}"
            )
    frozen = [name for name in parameters if any(fnmatchcase(name, pattern) for pattern in patterns)]
    if frozen and len(frozen) == len(parameters):
        raise FatalError("--freeze matches every parameter of the model: nothing would be trained")
    for name in frozen:
        parameters[name].requires_grad_(False)
    if frozen:
        elements = sum(parameters[name].numel() for name in frozen)
        total = sum(parameter.numel() for parameter in parameters.values())
        print0(f"frozen: {len(frozen)} of {len(parameters)} parameters, {elements:,} of {total:,} values")
    return frozen
