"""What each FSDP script's wrap_model builds, seen through one forward and backward, in process.

A training run compares losses; some wrapping mistakes leave them alone at two CPU ranks yet cost a
cluster dearly: gradients summed in bf16, a unit per Linear layer instead of per Block, an HSDP mesh
that shards across machines, or the root left unsharded. These tests call a script's own
parse_args and wrap_model as rank 0 of a world of 8 fake ranks (torch's "fake" backend: every
collective returns at once, its values unset), run one forward and backward on that model, and
read what the collectives carried: their kind, dtype and group size. No process is started.
"""

from __future__ import annotations

import runpy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from common.collectives import CollectiveRecorder
from common.distributed import DistContext, teardown_distributed
from common.models import GPT, gpt_config
from common.run_dir import complete_checkpoints
from tests.harness.cases import NEEDS_FSDP2_ON_CPU
from tests.harness.runs import REPO, run_script

FSDP1 = "fsdp/train_transformer.py"
FSDP2 = "fsdp/train_transformer_fsdp2.py"
WORLD = 8
N_LAYER = 2
TINY = ["--n-layer", str(N_LAYER), "--n-head", "4", "--d-model", "64", "--block-size", "16"]
VOCAB = 16


@dataclass(frozen=True)
class Sent:
    kind: str
    dtypes: frozenset[torch.dtype]
    group_size: int


class DtypeRecorder(CollectiveRecorder):
    """The recorder of common.collectives, also noting the dtype of each collective's tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[Sent] = []

    def before_collective(
        self, func: torch._ops.OpOverload, kind: str, group: dist.ProcessGroup, args: tuple, kwargs: dict
    ) -> None:
        leaves = torch.utils._pytree.tree_leaves([args, kwargs])
        dtypes = frozenset(t.dtype for t in leaves if isinstance(t, torch.Tensor))
        self.sent.append(Sent(kind, dtypes, group.size()))


@pytest.fixture(scope="module")
def fake_world() -> Iterator[DistContext]:
    """Rank 0 of 8, four to a machine, as torchrun would describe it; a fake process group, shared by
    this file's tests (tearing one down takes half a second)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE": "4",
                            "MASTER_ADDR": "localhost", "MASTER_PORT": "1"}.items():  # fmt: skip
            monkeypatch.setenv(name, value)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
        try:
            yield DistContext(0, 0, WORLD, 4, torch.device("cpu"), "gloo")
        finally:
            teardown_distributed()


def wrapped(script: str, flags: list[str], ctx: DistContext) -> torch.nn.Module:
    """The model as ``script``'s wrap_model returns it for these flags."""
    namespace = runpy.run_path(str(REPO / script))
    args, _ = namespace["parse_args"](["--device", "cpu", *TINY, *flags])
    with torch.device("meta"):
        model = GPT(gpt_config(args, VOCAB), seed=None)
    return namespace["wrap_model"](model, args, ctx)


def one_step(model: torch.nn.Module) -> list[Sent]:
    """The collectives of one forward and backward."""
    tokens = torch.randint(0, VOCAB, (2, 16))
    with DtypeRecorder() as recorder:
        model(tokens).float().sum().backward()
    return recorder.sent


def gathers_in_forward(model: torch.nn.Module) -> int:
    with DtypeRecorder() as recorder, torch.no_grad():
        model(torch.randint(0, VOCAB, (2, 16)))
    return sum(sent.kind == "all_gather" for sent in recorder.sent)


FSDP_SCRIPTS = [FSDP1, pytest.param(FSDP2, marks=NEEDS_FSDP2_ON_CPU)]


@pytest.mark.parametrize("script", FSDP_SCRIPTS)
def test_bf16_computes_in_bf16_and_reduces_gradients_in_fp32(script: str, fake_world: DistContext) -> None:
    """Summing N ranks' gradients in bf16 rounds each partial sum to 8 bits of mantissa; the scripts
    gather bf16 parameters but reduce fp32 gradients, and the optimizer sees fp32 gradients."""
    model = wrapped(script, ["--mixed-precision", "bf16"], fake_world)
    sent = one_step(model)
    gathered = {dtype for s in sent if s.kind == "all_gather" for dtype in s.dtypes}
    assert gathered == {torch.bfloat16}, f"parameters gathered in {gathered}, not bf16"
    reduced = {dtype for s in sent if s.kind in ("reduce_scatter", "all_reduce") for dtype in s.dtypes}
    assert reduced == {torch.float32}, f"gradients reduced in {sorted(map(str, reduced))}, not only fp32"
    # FSDP1 leaves None where none of a parameter falls in this rank's shard.
    grads = {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
    assert grads == {"torch.float32"}, f"the optimizer and the clip see gradients in {grads}, not fp32"


@pytest.mark.parametrize("script", FSDP_SCRIPTS)
def test_each_block_and_the_root_is_one_unit(script: str, fake_world: DistContext) -> None:
    """One all-gather per unit in forward: a unit per Linear layer would gather many small messages,
    each paying a collective's latency; one for the whole model would hold it all gathered at once."""
    model = wrapped(script, [], fake_world)
    gathers = gathers_in_forward(model)
    assert gathers == N_LAYER + 1, f"a forward gathers {gathers} units, not one per Block and the root"


@NEEDS_FSDP2_ON_CPU
def test_fsdp2_shards_every_parameter(fake_world: DistContext) -> None:
    """The root's fully_shard takes what no Block holds (embeddings, final norm, head): without it those
    stay whole plain tensors on every rank, and nothing reduces their gradients across ranks."""
    model = wrapped(FSDP2, [], fake_world)
    unsharded = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    assert not unsharded, f"not sharded: {unsharded}"


@pytest.mark.parametrize(
    ("script", "flags"),
    [
        pytest.param(FSDP1, ["--sharding-strategy", "hybrid_shard", "--replicate-degree", "2"], id="fsdp1"),
        pytest.param(FSDP2, ["--replicate-degree", "2"], id="fsdp2", marks=NEEDS_FSDP2_ON_CPU),
    ],
)
def test_hsdp_shards_within_a_replica_and_reduces_across_replicas(
    script: str, flags: list[str], fake_world: DistContext
) -> None:
    """8 ranks, 2 replicas: each 4 consecutive ranks (one machine) shard a copy, and the copies' gradients
    are all-reduced between the 2. The dims swapped would shard across 2 ranks and replicate 4 times."""
    sent = one_step(wrapped(script, flags, fake_world))
    groups = {kind: {s.group_size for s in sent if s.kind == kind} for kind in ("all_gather", "reduce_scatter")}
    assert groups == {"all_gather": {4}, "reduce_scatter": {4}}, f"sharded across groups of {groups}, not 4"
    replicas = {s.group_size for s in sent if s.kind == "all_reduce"}
    assert replicas == {2}, f"gradients all-reduced across groups of {replicas}, not the 2 replicas"


def test_fp16_scales_the_loss(tmp_path: Path) -> None:
    """fp16 has 5 exponent bits: gradients below 6e-8 flush to zero. The FSDP1 script scales the loss
    before backward and unscales before the clip (ShardedGradScaler), and saves the scale it reached."""
    flags = ["--mixed-precision", "fp16", "--max-steps", "2", "--train-sequences", "64", "--heldout-sequences", "8",
             "--block-size", "16", "--checkpoint-format", "full", "--checkpoint-interval", "2"]  # fmt: skip
    run_script(FSDP1, flags, tmp_path).check()
    (checkpoint,) = complete_checkpoints(tmp_path)
    scaler = torch.load(checkpoint, weights_only=True)["trainer"]["extra"]["scaler"]
    assert scaler.get("scale", 0.0) > 1.0, f"fp16 trained without a loss scale: the scaler saved {scaler}"
