"""Training part of a model: ``--freeze`` keeps the parameters it names as they started; ``--lora-rank`` trains
low-rank adapters beside the linear layers instead. A frozen parameter gets no gradient, optimizer state or DDP
bucket. Freezing happens before the wrap: DDP builds its buckets, and FSDP its units, from the parameters that
need gradients when it is made."""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.distributed import FatalError, print0
from common.models import init_parameters, plain_name, tied_parameters, unwrapped


def freeze(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """Turn off the gradient of each parameter whose name matches one of ``patterns`` (shell-style globs over
    ``named_parameters()``: ``'blocks.0.*'``); returns the frozen names. A pattern that matches nothing (a typo)
    is refused, as is freezing everything. A tied parameter (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``)
    matches under either name and is frozen under both, and the message says so."""
    parameters = dict(model.named_parameters())
    tied = tied_parameters(model)
    for pattern in patterns:
        if not any(fnmatchcase(name, pattern) for name in [*parameters, *tied]):
            examples = ", ".join(list(parameters)[:4])
            raise FatalError(
                f"--freeze {pattern!r} matches no parameter of the model; its parameters are named like {examples}"
            )
    matched = {name for name in [*parameters, *tied] if any(fnmatchcase(name, pattern) for pattern in patterns)}
    frozen = [name for name in parameters if name in matched or any(tied[a] == name for a in matched & tied.keys())]
    if frozen and all(name in frozen or not parameters[name].requires_grad for name in parameters):
        raise FatalError(
            "--freeze matches every parameter left to train (with --lora-rank, every adapter): nothing would be trained"
        )
    for name in frozen:
        parameters[name].requires_grad_(False)
    if frozen:
        elements = sum(parameters[name].numel() for name in frozen)
        total = sum(parameter.numel() for parameter in parameters.values())
        print0(f"frozen: {len(frozen)} of {len(parameters)} parameters, {elements:,} of {total:,} values")
        for alias, name in tied.items():
            if name in frozen:
                print0(f"frozen: {alias} too, which is {name} (one tensor under two names)")
    return frozen


# --lora-targets when not given: every linear layer inside the Blocks (attention and MLP), not the head.
DEFAULT_LORA_TARGETS = ("blocks.*.attn.*", "blocks.*.mlp.*")


class LowRankUpdate(nn.Module):
    """The trainable half of a LoRA layer: ``x -> scale * (x A^T) B^T``, A (rank x in), B (out x rank). A module
    of its own, so FSDP1 can make it a unit: a unit mixing frozen and trained parameters keeps a gradient for all."""

    def __init__(self, in_features: int, out_features: int, rank: int, scale: float, device: torch.device) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(rank, in_features, device=device))
        self.b = nn.Parameter(torch.empty(out_features, rank, device=device))
        self.rank, self.scale = rank, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.a), self.b) * self.scale


class LoRALinear(nn.Linear):
    """A linear layer plus a low-rank update: ``x W^T + b + scale * (x A^T) B^T`` (LoRA, Hu et al. 2021). It keeps
    ``weight`` and ``bias`` under their names, so the plain model's state dict fits it; the update is ``adapter``.
    B starts at zero, so the model computes exactly what it did before the adapters were added."""

    def __init__(self, base: nn.Linear, rank: int, scale: float) -> None:
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias  # the same tensors, not copies
        self.adapter = LowRankUpdate(base.in_features, base.out_features, rank, scale, base.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.adapter(x)


def add_adapters(model: nn.Module, rank: int | None, alpha: float | None, targets: Sequence[str], seed: int) -> None:
    """--lora-rank: a LoRALinear in place of each linear layer matching ``targets``, every other parameter frozen;
    ``alpha / rank`` scales the update. On the meta device the adapters are left for the sharded initialisation."""
    if rank is None:
        return
    chosen = choose_linear_layers(model, targets)
    refuse_rank_above_width(chosen, rank)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    scale = adapter_scale(rank, alpha)
    for name, linear in chosen:
        parent_name, _, child = name.rpartition(".")
        adapted = LoRALinear(linear, rank, scale)
        setattr(model.get_submodule(parent_name), child, adapted)
        if adapted.weight.device.type != "meta":
            init_parameters(adapted.adapter, seed, prefix=f"{name}.adapter")
    adapters = sum(p.numel() for m in model.modules() if isinstance(m, LowRankUpdate) for p in m.parameters())
    print0(f"LoRA: rank {rank}, scale {scale:g}, on {len(chosen)} linear layers: {adapters:,} values to train")


def choose_linear_layers(model: nn.Module, targets: Sequence[str]) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` layers whose names match ``targets``; FatalError where that is none, or where one's weight
    is tied to another parameter (an adapter merged into it would untie the two)."""
    matched = [(name, module) for name, module in model.named_modules() if any(fnmatchcase(name, t) for t in targets)]
    chosen = [(name, module) for name, module in matched if isinstance(module, nn.Linear)]
    if not chosen:
        others = [f"{name} (a {type(module).__name__})" for name, module in matched if not list(module.children())]
        seen = f": it matches {', '.join(others[:3])}, and adapters go beside torch.nn.Linear layers" if others else ""
        raise FatalError(f"--lora-targets {' '.join(targets)} matches no linear layer of the model{seen}")
    tied = tied_parameters(model)
    for name, _ in chosen:
        for alias, source in tied.items():
            if f"{name}.weight" in (alias, source):
                other = source if alias == f"{name}.weight" else alias
                raise FatalError(
                    f"--lora-targets matches {name}, whose weight is tied to {other} (one tensor): merged, its "
                    "adapter would change both. Leave it out of --lora-targets"
                )
    return chosen


def refuse_rank_above_width(chosen: list[tuple[str, nn.Linear]], rank: int) -> None:
    """FatalError where --lora-rank exceeds a chosen layer's narrower side: B A has no higher rank than that, so the
    adapter would only cost more (rank 100000 on the tiny preset's width of 64 ran 450 s in 10.9 GB)."""
    name, narrowest = min(chosen, key=lambda item: min(item[1].in_features, item[1].out_features))
    width = min(narrowest.in_features, narrowest.out_features)
    if rank > width:
        raise FatalError(
            f"--lora-rank {rank} is above the width of {name} ({narrowest.in_features} in, "
            f"{narrowest.out_features} out): an update B A of it has rank {width} at most. Give --lora-rank "
            f"{width} or less (LoRA's ranks are usually 4 to 64)"
        )


def adapter_scale(rank: int, alpha: float | None) -> float:
    return (alpha if alpha is not None else 2.0 * rank) / rank


def merge_adapters(state: dict[str, torch.Tensor], rank: int | None, alpha: float | None) -> dict[str, torch.Tensor]:
    """A plain model's state dict (what model.pt holds) from one with adapters: ``W + scale * B A`` under W's name."""
    return state if rank is None else merged_with_scale(state, adapter_scale(rank, alpha))


def merged_with_scale(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    merged = {name: value for name, value in state.items() if not is_adapter(name)}
    for name in state:
        if name.endswith(".adapter.a"):
            layer = name.removesuffix(".adapter.a")
            update = state[f"{layer}.adapter.b"].float() @ state[name].float()
            weight = state[f"{layer}.weight"]
            merged[f"{layer}.weight"] = (weight.float() + scale * update).to(weight.dtype)
    return merged


def is_adapter(name: str) -> bool:
    return name.endswith((".adapter.a", ".adapter.b"))


def adapter_identity(model: nn.Module) -> dict[str, Any] | None:
    """What a checkpoint records of the LoRA adapters (None without): a resume with others is refused saying so."""
    adapters = [module for module in model.modules() if isinstance(module, LowRankUpdate)]
    return {"rank": adapters[0].rank, "scale": adapters[0].scale, "layers": len(adapters)} if adapters else None


def trained_parameters(model: nn.Module) -> list[str] | None:
    """What a checkpoint records of --freeze and --lora-targets: the plain names of the parameters that train, None
    when all do. Other patterns over as many layers train others, and a resume failed in torch's optimizer state."""
    inner = unwrapped(model)
    names = [plain_name(name) for name, parameter in inner.named_parameters() if parameter.requires_grad]
    return None if len(names) == sum(1 for _ in inner.parameters()) else sorted(names)


def adapters_difference(there: dict[str, Any] | None, here: dict[str, Any], trained: list[list[str] | None]) -> str:
    """Each LoRA flag that differs between a checkpoint's adapters (``adapter_identity``) and this run's, with the
    layers one side adapts and the other does not where both recorded what trains (``trained``: there, here)."""
    there = there or {"rank": "unset", "scale": here["scale"], "layers": 0}
    parts = [f"--lora-rank {there['rank']} there, {here['rank']} here"] if there["rank"] != here["rank"] else []
    if there["scale"] != here["scale"]:
        parts.append(f"--lora-alpha: the update is scaled by {there['scale']:g} there, {here['scale']:g} here")
    layers = [
        {name.removesuffix(".adapter.a") for name in names or [] if name.endswith(".adapter.a")} for names in trained
    ]
    layers_named = named_differences(*layers, "is adapted", "are adapted")
    if there["layers"] != here["layers"] or layers_named:
        counts = f"adapters on {there['layers']} layers there, {here['layers']} here"
        parts.append("; ".join([f"--lora-targets differ: {counts}", *layers_named]))
    return "; ".join(parts)


def named_differences(there: set[str], here: set[str], one: str, many: str) -> list[str]:
    """``'first' and N more MANY there but not here`` (or ``'first' ONE``), and the other way round, where any."""
    parts = []
    for names, where in ((there - here, "there but not here"), (here - there, "here but not there")):
        if names:
            first, more = sorted(names)[0], len(names) - 1
            parts.append(f"{first!r} and {more} more {many} {where}" if more else f"{first!r} {one} {where}")
    return parts


def trained_difference(there: list[str] | None, here: list[str] | None) -> str:
    """The setting that changed between a checkpoint's trained parameters and this run's, and what it changed."""
    if there is None or here is None:
        # One side trains everything, so its set is the model's: what the other side holds is all that is known.
        known = here if there is None else there
        side = "this run" if there is None else "the checkpoint"
        return f"--freeze or --lora-targets differ: only {len(known or [])} parameters train in {side}"
    there_set, here_set = set(there), set(here)
    adapters = {is_adapter(name) for name in there_set ^ here_set}
    setting = "--freeze or --lora-targets"
    if len(adapters) == 1:
        setting = "--lora-targets" if adapters.pop() else "--freeze"
    return f"{setting} differ: {'; '.join(named_differences(there_set, here_set, 'trains', 'train'))}"
