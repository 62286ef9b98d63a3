"""Rank r of a world of any size on one CPU: torch's fake process group, whose collectives return at once,
with what DDP, FSDP1 and FSDP2 need to wrap a model of fake tensors (tools.estimates.simulate's world).

What the fake world cannot do, these route around without changing the wrap: the device mesh
is built outside the fake tensors (it reads its own ranks), so is DDP's parameter check, on their shapes;
DDP's reducer gets its all-reduced bucket back from a hook (the fake group's futures carry nothing); FSDP1
tells a freed flat parameter by its storage's size (fake storages have no address). (FSDP1's model comes
as fake CPU tensors, not meta ones, which fake tensors cannot replace: tools.estimates.simulate builds it so.)
``StepRecorder`` measures a step there: its collectives and the peak of its live storages.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from common.collectives import CollectiveRecorder
from common.distributed import DistContext
from tools.estimates.activations import LiveStorages


def outside_fake(function: Callable) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return function(*args, **kwargs)

    return call


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = (getattr(t, "_local_tensor", t) for t in (a, b))
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


@contextlib.contextmanager
def fake_world(world_size: int, rank: int, script_globals: dict) -> Iterator[DistContext]:
    """Rank ``rank`` of a fake process group of ``world_size``, with what the wraps need to run on fake tensors."""
    import torch.distributed.fsdp._flat_param as flat_param
    import torch.nn.parallel.distributed as ddp_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # DTensor remembers the sharding of each operator's result, meshes included, and takes two meshes of
    # one shape for the same mesh: a simulation of another rank would get the last one's mesh, and its
    # rank's slices. Forgotten here, each simulation in a process is its own.
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # its C++ copy
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    with contextlib.ExitStack() as stack:
        # FSDP1's catch-all reshard, for a unit whose backward did not run (every unit's runs here), compares
        # a flat parameter's address with its shard's; fake ones have none, and torch warns of each read.
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        stack.callback(dist.destroy_process_group)
        if "init_device_mesh" in script_globals:
            stack.enter_context(
                mock.patch.dict(script_globals, init_device_mesh=outside_fake(script_globals["init_device_mesh"]))
            )
        # FSDP2 over a tensor-parallel mesh builds the (dp, tp) mesh of its sharded DTensors inside the wrap,
        # and a mesh finds its rank's coordinates with nonzero(), which fake tensors cannot run.
        stack.enter_context(mock.patch.object(DeviceMesh, "__init__", outside_fake(DeviceMesh.__init__)))
        verify = ddp_module._verify_param_shape_across_processes
        stack.enter_context(mock.patch.object(ddp_module, "_verify_param_shape_across_processes", outside_fake(verify)))
        stack.enter_context(
            mock.patch.object(flat_param, "_data_ptr_allocated", lambda t: t.untyped_storage().size() > 0)
        )
        stack.enter_context(mock.patch.object(flat_param, "_same_storage", _same_storage))
        yield DistContext(rank, rank % 8, world_size, min(world_size, 8), torch.device("cpu"), "fake")


def all_reduced_bucket(state, bucket):  # noqa: ANN001 - DDP refuses annotations it reads as text
    """DDP's own all-reduce of a bucket (the default hook's mean), with a future the fake group cannot give."""
    buffer = bucket.buffer()
    dist.all_reduce(buffer)
    buffer.div_(dist.get_world_size())
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(buffer)
    return done


class StepRecorder(CollectiveRecorder):
    """The collectives of a step, and the peak of the bytes of every storage alive during it: each from the
    first operator that shows it (or from the start, for the state held then) until it is freed."""

    def __init__(self, held: list[torch.Tensor]) -> None:
        super().__init__()
        self.live = LiveStorages()
        self.live.see(held)
        self.peak = self.live.nbytes()

    def __torch_dispatch__(self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops._c10d_functional.wait_tensor.default:
            # The real kernel hands back its input once the collective is done; the fake one (torch 2.14.1's
            # _wait_tensor_meta) a new tensor, which would count every DTensor collective's output twice.
            return args[0]
        result = super().__torch_dispatch__(func, types, args, kwargs)
        if result is not NotImplemented:
            self.live.see(tree_leaves((args, kwargs, result)))
            self.peak = max(self.peak, self.live.nbytes())
        return result


def held_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What a rank holds between steps: parameters, buffers, gradients and the optimizer's state."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors
