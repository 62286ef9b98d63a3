"""Mistakes in what outlives a step: checkpoints and resuming, stop signals, the run directory's lock,
restarts."""

from __future__ import annotations

from tests.zoo.mistake import Mistake

MISTAKES: list[Mistake] = []
