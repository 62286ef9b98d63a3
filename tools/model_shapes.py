"""A model's parameters as the estimators and the plot see them, without building it: shapes on the meta
device, after --lora-rank and --freeze as the scripts apply them, and where a step's tensors would
outgrow what torch counts. No script needs any of it: they build the model itself."""

from __future__ import annotations

import argparse
import contextlib
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from common.cli import add_fine_tuning_flags
from common.distributed import FatalError
from common.fine_tuning import DEFAULT_LORA_TARGETS, add_adapters, freeze
from common.models import GPT, GPTConfig


@dataclass(frozen=True)
class ParameterShapes:
    """A model's parameters as the estimators need them: every shape by name, in the model's order (its
    forward order, for the GPT), and the names that train."""

    shapes: dict[str, tuple[int, ...]]
    trainable: frozenset[str]

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes.values())

    @property
    def trainable_numel(self) -> int:
        return sum(math.prod(shape) for name, shape in self.shapes.items() if name in self.trainable)


def fine_tuned_shapes(
    config: GPTConfig,
    freeze_patterns: Sequence[str] = (),
    lora_rank: int | None = None,
    lora_targets: Sequence[str] | None = None,
) -> ParameterShapes:
    """The GPT's parameters after --lora-rank and --freeze, as the scripts apply them (the same calls, on a
    model on the meta device: nothing allocated). Raises FatalError as the scripts refuse a pattern."""
    with torch.device("meta"):
        model = GPT(config, seed=None)
    fine_tune(model, freeze_patterns, lora_rank, lora_targets)
    named = list(model.named_parameters())
    return ParameterShapes(
        {name: tuple(p.shape) for name, p in named}, frozenset(name for name, p in named if p.requires_grad)
    )


def fine_tune(
    model: nn.Module,
    freeze_patterns: Sequence[str] = (),
    lora_rank: int | None = None,
    lora_targets: Sequence[str] | None = None,
) -> None:
    """--lora-rank, then --freeze, as the scripts call them (``lora_targets`` None: the scripts' default),
    without their log lines: an estimator says what it wants in its own words."""
    with contextlib.redirect_stdout(io.StringIO()):
        add_adapters(model, lora_rank, None, lora_targets or DEFAULT_LORA_TARGETS, seed=0)
        freeze(model, freeze_patterns)


def add_estimator_flags(parser: argparse.ArgumentParser) -> None:
    """--freeze, --lora-rank and --lora-targets for the estimators (tools/estimates/),
    as the training scripts take them (--lora-alpha changes no byte, so the estimators do without it)."""
    add_fine_tuning_flags(
        parser, title="fine-tuning: train part of a GPT (needs --model with a GPT preset)", alpha=False
    )


def estimator_shapes(
    parser: argparse.ArgumentParser, args: argparse.Namespace, config: GPTConfig | None
) -> ParameterShapes | None:
    """What ``add_estimator_flags`` asked for, on the GPT of ``config`` (None: the estimate is of no GPT), or
    None without those flags. Refused with one message each: the flags without a GPT, --lora-targets without
    --lora-rank, and whatever the scripts refuse of the patterns (one that matches nothing, or leaves nothing
    to train)."""
    if not args.freeze and args.lora_rank is None and args.lora_targets is None:
        return None
    if config is None:
        parser.error(
            "--freeze, --lora-rank and --lora-targets name the parameters of a GPT: give --model with a GPT preset, "
            "not --params or the MNIST net"
        )
    if args.lora_rank is None and args.lora_targets is not None:
        parser.error("--lora-targets chooses the layers that --lora-rank adapts: give --lora-rank too")
    try:
        return fine_tuned_shapes(config, args.freeze, args.lora_rank, args.lora_targets)
    except FatalError as err:
        parser.error(str(err))


def gpt_parameter_count(config: GPTConfig) -> int:
    """Parameters of a GPT of ``config``, counted from its shapes on the meta device: nothing allocated."""
    return sum(math.prod(shape) for shape in gpt_parameter_shapes(config).values())


def gpt_parameter_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The shape of each parameter of a GPT of ``config``, by name in the model's order (the meta device)."""
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in GPT(config, seed=None).named_parameters()}


# torch counts a tensor's bytes in 64 bits, a fake or meta tensor's too: a larger shape fails inside torch.
TENSOR_BYTES_LIMIT = 2**63 - 1


def gpt_step_overflow(config: GPTConfig, batch_size: int, lora_rank: int | None = None) -> str | None:
    """Why a training step of this GPT cannot be built, where one of its tensors would take more bytes than torch
    counts; None where every one fits. Each value is counted at 8 bytes (the ids are int64; fp32 at twice its
    size, so that what torch derives from a shape, a flattened view or a gradient, stays within the count)."""
    b, t, v, d = batch_size, config.block_size, config.vocab_size, config.d_model
    tensors = [(f"token embedding ({v} x {d} values)", v * d), (f"position embedding ({t} x {d} values)", t * d)]
    if lora_rank is not None:
        tensors.append((f"a LoRA factor ({4 * d} x {lora_rank} values)", 4 * d * lora_rank))
    tensors += [
        (f"logits ({b} x {t} x {v} values)", b * t * v),
        (f"MLP's activations ({b} x {t} x {4 * d})", b * t * 4 * d),
    ]
    if lora_rank is not None:
        tensors.append((f"a LoRA layer's activations ({b} x {t} x {lora_rank} values)", b * t * lora_rank))
    return first_overflow(tensors)


def mnist_step_overflow(batch_size: int) -> str | None:
    """``gpt_step_overflow`` for the MNIST net: its largest activation is the second convolution's output."""
    return first_overflow([(f"second convolution's output ({batch_size} x 64 x 24 x 24 values)", batch_size * 36864)])


def first_overflow(tensors: list[tuple[str, int]]) -> str | None:
    too_large = next((what for what, values in tensors if 8 * values > TENSOR_BYTES_LIMIT), None)
    return None if too_large is None else f"the step's {too_large} would take more bytes than torch can count (2**63)"
