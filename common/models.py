"""The small GPT the transformer scripts train, its presets, and how its weights are made and wrapped."""

from __future__ import annotations

import argparse
import zlib
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel

# --sdpa-backend: the kernel F.scaled_dot_product_attention must use; None lets torch choose at every call.
SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int  # longest context the model sees
    n_layer: int
    n_head: int
    d_model: int
    dropout: float = 0.0
    sdpa_backend: str | None = None  # a name of SDPA_BACKENDS

    def shape(self) -> dict[str, int]:
        """The fields that decide the parameters' shapes; a checkpoint must agree on all of them."""
        return {name: value for name, value in asdict(self).items() if name not in ("dropout", "sdpa_backend")}


# Sizes for --model. Dimensions can still be overridden one by one with flags.
GPT_PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_head": 4, "d_model": 64, "block_size": 64},
    "small": {"n_layer": 4, "n_head": 4, "d_model": 128, "block_size": 128},
    "medium": {"n_layer": 8, "n_head": 8, "d_model": 512, "block_size": 256},
    "gpt2": {"n_layer": 12, "n_head": 12, "d_model": 768, "block_size": 1024},
}


def gpt_config(args: argparse.Namespace, vocab_size: int) -> GPTConfig:
    """The GPT of the transformer flags (as check_transformer_flags fills them in), on the data's vocabulary."""
    shape = (vocab_size, args.block_size, args.n_layer, args.n_head, args.d_model)
    return GPTConfig(*shape, args.dropout, args.sdpa_backend)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.sdpa_backend = config.sdpa_backend
        # No bias: a bias on the keys adds the same amount to every score of a query, which softmax cancels. Its
        # gradient is pure rounding noise, and Adam, which divides by the gradient's size, turns noise into full steps.
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        # Thirds of the projection's output and heads of self.n_head, not of the width: under tensor
        # parallelism a rank computes only its own heads' q, k and v, and n_head counts those heads.
        q, k, v = self.qkv(x).chunk(3, dim=2)
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))  # (batch, heads, time, dim)
        dropout = self.dropout if self.training else 0.0
        # Inside the module, so that a compiled Block keeps the choice (torchtitan does the same).
        with sdpa_kernel(SDPA_BACKENDS[self.sdpa_backend]) if self.sdpa_backend else nullcontext():
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.proj = nn.Linear(4 * config.d_model, config.d_model)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-norm transformer layer: the unit FSDP shards and gathers as a whole."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer. Its head is not tied to the token embedding: a shared weight would live in two
    FSDP units at once, and every Block, the embeddings and the head should shard cleanly on their own.
    ``seed`` initialises the weights (``init_parameters``); None leaves them as built, for a model made on the meta
    device and initialised once sharded."""

    def __init__(self, config: GPTConfig, seed: int | None = 0) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if seed is not None:
            init_parameters(self, seed)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # logits, (batch, time, vocab)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def transformer_flops_per_token(model: nn.Module) -> float | None:
    """Training FLOPs per token of the GPT inside ``model`` (None if there is none): 6 per weight that multiplies
    (2 forward, 4 backward), plus attention's 12 x layers x width x sequence length (the PaLM paper's estimate);
    embedding lookups multiply nothing."""
    config = next((module.config for module in model.modules() if isinstance(module, GPT)), None)
    if config is None:
        return None
    # Sharded models hold only part of each weight: count a copy that takes no memory.
    with torch.device("meta"):
        whole = GPT(config)
    lookups = whole.tok_emb.weight.numel() + whole.pos_emb.weight.numel()
    weights = sum(p.numel() for p in whole.parameters()) - lookups
    return 6 * weights + 12 * config.n_layer * config.d_model * config.block_size


def plain_name(name: str) -> str:
    """A parameter's name in the model as built, whatever wraps it (FSDP1, activation checkpointing, compile)."""
    for wrapper in ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    return name


def unwrapped(model: nn.Module) -> nn.Module:
    """The model DDP wraps (its parameter names without ``module.``); FSDP keeps the model itself."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def tied_parameters(model: nn.Module) -> dict[str, str]:
    """Names that are another parameter under a second name, each with its first name: GPT-2's
    ``{"lm_head.weight": "transformer.wte.weight"}``, its head tied to its token embedding. One tensor, so one
    gradient and optimizer state; a weights file holds it once, under the first name (as a Hugging Face folder
    does). ``model`` may be wrapped (DDP, FSDP1, FSDP2)."""
    first: dict[int, str] = {}
    tied = {}
    for name, parameter in unwrapped(model).named_parameters(remove_duplicate=False):
        name = plain_name(name)
        if id(parameter) in first:
            tied[name] = first[id(parameter)]
        else:
            first[id(parameter)] = name
    return tied


def initial_value(owner: nn.Module, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """GPT-2's initial value of the parameter ``name`` (of module ``owner``): a whole fp32 tensor on the CPU, from a
    generator of its own seeded by the run's seed and its name. So it depends on nothing else (which process makes
    it, what was made before), and a sharded model initialised shard by shard holds exactly one process's weights."""
    if name.endswith("bias") or name.endswith(".adapter.b"):  # a LoRA adapter starts as no change at all
        return torch.zeros(shape)
    if isinstance(owner, nn.LayerNorm):
        return torch.ones(shape)
    # One 32-bit number from both: the CPU generator keeps only the low 32 bits of its seed.
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
    # An adapter's down-projection (rank, in): unit variance per output, so its up-projection learns at any width.
    std = shape[-1] ** -0.5 if name.endswith(".adapter.a") else 0.02
    return torch.empty(shape).normal_(mean=0.0, std=std, generator=generator)


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, prefix: str = "", recurse: bool = True) -> None:
    """Set ``module``'s parameters to their initial values where they are. ``prefix`` is the module's name inside
    the GPT; ``recurse`` False sets only its own parameters (FSDP1's ``param_init_fn`` gets one module at a time).
    A sharded parameter (an FSDP2 DTensor) keeps its own slice of the whole: no rank holds the whole model."""
    modules = module.named_modules(prefix=prefix) if recurse else [(prefix, module)]
    for module_name, owner in modules:
        for local_name, parameter in owner.named_parameters(recurse=False):
            name = plain_name(f"{module_name}.{local_name}" if module_name else local_name)
            value = initial_value(owner, name, parameter.shape, seed).to(parameter.device)
            if isinstance(parameter, DTensor):
                # src_data_rank None: take this rank's slice of its own copy, with no communication.
                value = distribute_tensor(value, parameter.device_mesh, parameter.placements, src_data_rank=None)
                parameter.to_local().copy_(value.to_local())
            else:
                parameter.copy_(value)


# Precision names the scripts accept, and the dtype the matrix multiplications then use.
COMPUTE_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def checkpoint_activations(model: nn.Module, layers: Iterable[nn.Module]) -> None:
    """Keep only each of ``layers``' input in forward and recompute the rest in backward: each layer is wrapped
    where it sits in ``model``, by torch's checkpoint_wrapper, non-reentrant (the supported kind) by default."""
    wrapped = set(layers)
    apply_activation_checkpointing(model, check_fn=lambda module: module in wrapped)


def compile_layers(layers: Iterable[nn.Module]) -> None:
    """torch.compile each layer in place, so the parameter names (and state dicts) do not change."""
    for layer in layers:
        layer.compile()
