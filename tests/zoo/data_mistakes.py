"""Mistakes in what each rank trains on and how a step adds it up: the sampler, gradient accumulation,
the evaluation, the learning-rate schedule."""

from __future__ import annotations

from tests.zoo.mistake import Mistake

MISTAKES: list[Mistake] = []
