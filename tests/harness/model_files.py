"""Compare the model files runs write (model.pt, an exported checkpoint): bit for bit, not within a tolerance.

A stopped and resumed run, or a sharded checkpoint exported to one file, must be the very model the
uninterrupted run saved: any difference at all is a bug, not noise.
"""

from __future__ import annotations

from pathlib import Path

import torch


def assert_same_parameters(path_a: Path, path_b: Path) -> None:
    """Fail, naming the tensors that differ, unless the two state dicts hold the same names and values."""
    state_a = torch.load(path_a, weights_only=True)
    state_b = torch.load(path_b, weights_only=True)
    assert state_a.keys() == state_b.keys()
    different = [name for name in state_a if not torch.equal(state_a[name], state_b[name])]
    assert not different, f"parameters differ: {different}"
