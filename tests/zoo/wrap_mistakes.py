"""Mistakes in the wrap and the step's numbers: precision, FSDP units and meshes, clipping, and
collectives that only some ranks call."""

from __future__ import annotations

from tests.zoo.mistake import Mistake

MISTAKES: list[Mistake] = []
