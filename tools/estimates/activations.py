"""Activations: the bytes a training step holds beyond its weights, measured on the model a script trains.

``gpt_activations`` and ``mnist_activations`` build the scripts' model (a GPT, or the MNIST net), run one
training forward and the scripts' loss inside ``torch.autograd.graph.saved_tensors_hooks``, and add
up the storages autograd keeps for backward (``kept``):

- every tensor an operation saves for its backward, each storage once (q, k and v are views of one
  buffer; a layer norm's input is also the previous residual sum);
- not the parameters, nor their views or casts (``weight.t()``, autocast's bf16 copy of a weight):
  those are model state, which ``tools.estimates.estimate_memory`` counts in its own columns (DDP's cached
  bf16 weights and FSDP's gathered unit are its "in flight" term);
- the logits, which the scripts hold in a variable until backward, though no operation saves them;
- the input ids and targets, which the embedding and the loss save.

With ``--activation-checkpointing`` every Block runs under non-reentrant ``torch.utils.checkpoint``,
whose own hooks stand in for ours inside the Block; it saves the Block's input before they do, and
that is what reaches ours: what it keeps. In backward each Block's activations are rebuilt while
its gradient is computed: one Block's worth (``recomputed``), measured on one Block alone.

Then the backward of the same loss runs under ``BackwardBytes``, which follows every storage until it
is freed: how far above ``kept`` it rises at its most (``backward``): the activations' gradients (the
logits' above all), a checkpointed Block rebuilt, and with ``unit_gradients`` the parameters' gradients
until FSDP would reduce-scatter them, unit by unit (what is alive at each unit's end: ``unit_ends``).

bf16 follows the scripts. DDP runs under ``torch.autocast``: matmuls take bf16 copies of their
inputs, while layer norms, the residual stream and the loss stay fp32. FSDP1 and FSDP2 gather the
parameters in bf16 (``param_dtype``) without autocast, so every activation is bf16 but the loss,
which the scripts compute in fp32 (``logits.float()``).

The forward runs under ``FakeTensorMode``: tensors with shapes, dtypes and the CPU as device, but no
data. Autograd saves the same tensors, and the CPU's choice of attention kernel (flash attention,
which keeps no T x T scores) is made from the same shapes, so the bytes are those of a real CPU
forward and backward (tests/test_activations.py checks it) for about a second at GPT-2's size, where
building the model and a real forward take 13 s here.

Left out, and so not in the estimator's peak either: the caching allocator's rounding and
fragmentation, cuBLAS workspaces and NCCL buffers; what GPU kernels save otherwise than the CPU's
(small extras such as a random seed; a layer norm's statistics stay fp32 on CUDA under bf16
parameters; CUDA's dropout keeps a 1-byte mask where the CPU's keeps an fp32 one); and
``--compile``, whose generated kernels save other tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from common.distributed import local_part
from common.mnist import MnistNet
from common.models import GPT, GPTConfig, checkpoint_activations

# How a script applies --mixed-precision bf16: DDP's autocast, or FSDP's parameters gathered in bf16.
FORWARDS = ("fp32", "autocast", "param_dtype")
MNIST_IMAGE = (1, 28, 28)
MNIST_CLASSES = 10
# Autograd nodes that only view or cast their one input: a tensor made by a chain of them from a
# parameter is a copy of model state, not an activation.
VIEW_AND_CAST_NODES = {
    "ToCopyBackward0",
    "TBackward0",
    "ViewBackward0",
    "UnsafeViewBackward0",
    "TransposeBackward0",
    "PermuteBackward0",
    "ExpandBackward0",
    "AliasBackward0",
}


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes of activations on one rank for one micro-batch."""

    kept: int  # from the end of forward into backward
    recomputed: int = 0  # activation checkpointing: one Block rebuilt during its backward
    backward: int = 0  # the most the backward holds at once above ``kept`` and ``weight_copies`` (0: not measured)
    weight_copies: int = 0  # autocast's bf16 copies of the weights, which forward saves for backward: model state
    # With unit_gradients, per unit in the order backward finishes them, above ``kept`` and ``weight_copies``:
    # the most alive during its backward, and what is alive at its end, its gradients all there.
    unit_peaks: tuple[int, ...] = ()
    unit_ends: tuple[int, ...] = ()
    # The most alive at once during forward, above ``weight_copies``: ``kept`` as it grows, and what an operator
    # makes and frees at once (tensor parallelism gathers the sequence into one buffer, then lays it out in another).
    forward: int = 0

    @property
    def peak(self) -> int:
        """The most activations alive at once: in backward (``recomputed`` is within ``backward``), or where
        forward's passing buffers rise above that."""
        return max(self.kept + self.backward, self.forward)


def storage_key(tensor: torch.Tensor) -> int:
    """One number per storage: views share it. (``data_ptr`` would not do: fake tensors have none.)"""
    return tensor.untyped_storage()._cdata


def is_parameter_copy(tensor: torch.Tensor, parameter_keys: set[int]) -> bool:
    """Whether ``tensor`` is a parameter, or a view or cast of one (autocast's bf16 weight, ``weight.t()``)."""
    if storage_key(tensor) in parameter_keys:
        return True
    node = tensor.grad_fn
    while node is not None and type(node).__name__ in VIEW_AND_CAST_NODES:
        node = next((fn for fn, _ in node.next_functions if fn is not None), None)
    variable = getattr(node, "variable", None)  # only AccumulateGrad, the node of a leaf, has one
    return variable is not None and storage_key(variable) in parameter_keys


class SavedBytes:
    """Counts the storages autograd saves for backward while it is active, each once, parameters left out."""

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self.parameter_keys = {storage_key(p) for p in parameters}
        self.sizes: dict[int, int] = {}
        # Holding every saved tensor keeps its storage alive, so no later tensor can reuse its key.
        self.held: list[torch.Tensor] = []
        self.parameter_copies: list[torch.Tensor] = []  # views of weights, and autocast's bf16 casts of them
        self.copy_sizes: dict[int, int] = {}  # the casts' own storages (a view has its weight's)

    def add(self, tensor: torch.Tensor) -> torch.Tensor:
        if is_parameter_copy(tensor, self.parameter_keys):
            self.parameter_copies.append(tensor)
            if storage_key(tensor) not in self.parameter_keys:
                self.copy_sizes[storage_key(tensor)] = tensor.untyped_storage().nbytes()
        else:
            self.held.append(tensor)
            self.sizes[storage_key(tensor)] = tensor.untyped_storage().nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.sizes.values())

    @contextmanager
    def counting(self) -> Iterator[SavedBytes]:
        with torch.autograd.graph.saved_tensors_hooks(self.add, lambda tensor: tensor):
            yield self


def forward_context(forward: str) -> torch.autocast | nullcontext:
    if forward not in FORWARDS:
        raise ValueError(f"unknown forward {forward!r}; expected one of {', '.join(FORWARDS)}")
    return torch.autocast("cpu", dtype=torch.bfloat16) if forward == "autocast" else nullcontext()


def gpt_activations(
    config: GPTConfig,
    batch_size: int,
    *,
    checkpointing: bool,
    forward: str,
    fake: bool = True,
    unit_gradients: bool = False,
    prepare: Callable[[GPT], None] | None = None,
    backward: bool = True,
) -> ActivationBytes:
    """A training forward and backward of the GPT with the transformer scripts' loss, as in their training loop.

    ``unit_gradients``: count each parameter's gradient until its Block's backward ends, as FSDP holds it
    unsharded until then (the root's, outside the Blocks, until the backward ends); without it, not at
    all, as under DDP, whose gradients are model state (its buckets). ``prepare`` changes the model before
    its forward, as fine-tuning does (``tools.model_shapes.fine_tune``). ``fake`` False runs on real
    tensors, as a check of the fake run (seconds, not milliseconds); ``backward`` False measures the
    forward alone (``backward`` and the units' figures 0).
    """
    with FakeTensorMode() if fake else nullcontext():
        with parameter_dtype(forward):
            model = GPT(config, seed=None).train()
            if prepare is not None:
                prepare(model)
        if checkpointing:
            checkpoint_activations(model, model.blocks)
        tokens = torch.randint(config.vocab_size, (batch_size, config.block_size))
        targets = torch.randint(config.vocab_size, (batch_size, config.block_size))
        counter = SavedBytes(model.parameters())
        forward_measure = BackwardBytes([], model.parameters())  # every storage forward makes, until freed
        with counter.counting(), forward_context(forward), forward_measure:
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
            counter.add(logits)  # the training loop holds it through backward
        recomputed = block_activations(model, batch_size, forward) if checkpointing else 0
        copies = sum(counter.copy_sizes.values())
        passing = forward_measure.peak - forward_measure.start - copies
        if not backward:
            return ActivationBytes(kept=counter.total, recomputed=recomputed, weight_copies=copies, forward=passing)
        units = [list(block.parameters()) for block in model.blocks] if unit_gradients else None
        measure = backward_bytes(model, loss, counter, units)
    return ActivationBytes(
        kept=counter.total,
        recomputed=recomputed,
        backward=measure.peak - measure.start,
        weight_copies=copies,
        unit_peaks=tuple(peak - measure.start for peak in measure.unit_peaks),
        unit_ends=tuple(end - measure.start for end in measure.unit_ends),
        forward=passing,
    )


class LiveStorages:
    """The storages seen so far that something still refers to: each from when it is first seen until it is
    freed, at its size then (FSDP1 frees a flat parameter by shrinking its storage to nothing)."""

    def __init__(self) -> None:
        self._refs: dict[int, StorageWeakRef] = {}
        self.uncounted: set[int] = set()  # storage keys seen but not counted

    def see(self, tensors: Iterable[Any]) -> None:
        """Note the storages of the tensors among ``tensors`` (DTensors by their local shard; none of meta ones)."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                storage = local_part(tensor).untyped_storage()
                self._refs.setdefault(storage._cdata, StorageWeakRef(storage))

    def nbytes(self) -> int:
        total = 0
        for key, ref in list(self._refs.items()):
            if ref.expired():
                del self._refs[key]
            elif key not in self.uncounted:
                total += torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
        return total


class BackwardBytes(TorchDispatchMode):
    """The most bytes alive at once while it is active: each storage from the start (what forward kept) or
    from the first operator that shows it, until nothing refers to it.

    Never counted: model state (``state``: the parameters and their casts) and what ``stop_counting`` names
    (gradients once the rank holds them no longer, or holds them as model state).
    """

    def __init__(self, kept: Iterable[torch.Tensor], state: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self.state = list(state)  # held, so that no other storage takes one of their keys
        self.live = LiveStorages()
        self.live.uncounted.update(storage_key(t) for t in self.state)
        self.live.see(kept)
        self.start = self.peak = self.unit_peak = self.live.nbytes()
        self.unit_peaks: list[int] = []
        self.unit_ends: list[int] = []

    def unit_done(self, gradients: list[torch.Tensor]) -> None:
        """A unit's gradients are all there: FSDP reduce-scatters them now, and frees them."""
        end = self.live.nbytes()
        self.unit_peaks.append(max(self.unit_peak, end))
        self.unit_ends.append(end)
        self.unit_peak = 0
        self.stop_counting(gradients)

    def stop_counting(self, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            self.state.append(tensor)
            self.live.uncounted.add(storage_key(tensor))

    def __torch_dispatch__(self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        result = func(*args, **(kwargs or {}))
        self.live.see(tree_leaves((args, kwargs, result)))
        now = self.live.nbytes()
        self.peak, self.unit_peak = max(self.peak, now), max(self.unit_peak, now)
        return result


def backward_bytes(
    model: torch.nn.Module, loss: torch.Tensor, counter: SavedBytes, units: list[list[torch.Tensor]] | None
) -> BackwardBytes:
    """The backward of ``loss``, measured from what forward kept (``counter``: activations and weight copies):
    activations' gradients, a checkpointed Block rebuilt, and parameters' gradients until their unit in
    ``units`` is done (never, without units; the parameters in no unit, until the end)."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    measure = BackwardBytes([*counter.held, *counter.parameter_copies], model.parameters())
    # From here on the graph alone keeps what forward saved, and frees it as backward goes.
    counter.held, counter.parameter_copies = [], []
    unit_of = {id(p): unit for unit in units or [] for p in unit if p.requires_grad}

    def gradient_ready(parameter: torch.Tensor) -> None:
        if units is None:
            measure.stop_counting([parameter.grad])
            return
        unit = unit_of.get(id(parameter))
        if unit is not None and all(p.grad is not None for p in unit if p.requires_grad):
            measure.unit_done([p.grad for p in unit if p.requires_grad])

    hooks = [p.register_post_accumulate_grad_hook(gradient_ready) for p in parameters]
    with measure:
        loss.backward()
    for hook in hooks:
        hook.remove()
    return measure


def block_activations(model: GPT, batch_size: int, forward: str) -> int:
    """What one Block saves, its input aside (a checkpoint keeps that anyway): rebuilt in its backward."""
    block = model.blocks[0]
    block = getattr(block, "_checkpoint_wrapped_module", block)  # the Block itself, not its checkpoint
    dtype = next(block.parameters()).dtype if forward == "param_dtype" else torch.float32
    config = model.config
    hidden = torch.empty(batch_size, config.block_size, config.d_model, dtype=dtype, requires_grad=True)
    counter = SavedBytes([*block.parameters(), hidden])
    with counter.counting(), forward_context(forward):
        block(hidden)
    return counter.total


def mnist_activations(batch_size: int, *, fake: bool = True) -> ActivationBytes:
    """A training forward and backward of the MNIST net (its dropout masks included) and the MNIST scripts' loss."""
    with FakeTensorMode() if fake else nullcontext():
        model = MnistNet().train()
        images = torch.empty(batch_size, *MNIST_IMAGE)
        labels = torch.randint(MNIST_CLASSES, (batch_size,))
        counter = SavedBytes(model.parameters())
        with counter.counting():
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
            counter.add(logits)
        measure = backward_bytes(model, loss, counter, units=None)
    return ActivationBytes(kept=counter.total, backward=measure.peak - measure.start)


@contextmanager
def parameter_dtype(forward: str) -> Iterator[None]:
    """Build in bf16 where FSDP would gather the parameters in bf16 (a fake model cannot be cast after)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if forward == "param_dtype" else torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
