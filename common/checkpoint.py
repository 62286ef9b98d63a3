"""Saving files so that a crash mid-write never leaves a half-written one behind."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename it into place.

    The rename is atomic on POSIX file systems: readers see the old file or the
    complete new one, never a truncated mix, even if the job dies mid-save.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("wb") as file:
        torch.save(obj, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)
