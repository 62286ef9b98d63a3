"""The one table of the strategies the training scripts run, for every command that names one.

Each row is a strategy under the name a run's final record gives it (``"strategy"``), the script and
flags that run it, how it lays its state out across ranks, and which textbook schedule of gathers and
sends it follows. The estimators, the comparison and the benchmark read their rows and columns here, so
a strategy added to a script is added once.
"""

from __future__ import annotations

from dataclasses import dataclass

DDP_SCRIPT = "ddp/train_transformer.py"
FSDP1_SCRIPT = "fsdp/train_transformer.py"
FSDP2_SCRIPT = "fsdp/train_transformer_fsdp2.py"
FSDP2_TP_SCRIPT = "fsdp/train_transformer_fsdp2_tp.py"
TP_DEGREE = 2  # the TP script's default --tp-degree: the row's ranks per tensor-parallel group

# How a strategy gathers and sends during a step, as the estimators model it (tools.estimates.in_flight,
# modelled_collectives): FSDP2 gathers as FSDP1's full_shard does, HSDP as its hybrid_shard, no_shard as DDP.
TEXTBOOK = ("ddp", "full_shard", "shard_grad_op", "hybrid_shard")


@dataclass(frozen=True)
class Strategy:
    name: str  # as the script writes it in the final record's "strategy"
    script: str
    textbook: str  # one of TEXTBOOK
    # "replicated" (every rank holds it all), "flat" (FSDP1: each unit's parameters flattened and cut into
    # equal pieces), "dim0" (FSDP2: every parameter cut along its first dimension, the first ranks taking
    # the larger pieces) or "tp" (tensor parallelism inside groups of tp_degree ranks, then FSDP2's "dim0" cut
    # of each rank's piece across the groups: tools.estimates.tensor_parallel).
    layout: str
    flags: tuple[str, ...] = ()  # what selects it in its script
    hybrid: bool = False  # two copies of the sharded model, so an even world of 4 ranks or more
    tp_degree: int = 1  # ranks that split each Block between them

    def runs_at(self, world_size: int) -> bool:
        if self.tp_degree > 1:  # a world of one trains unsplit; any other needs whole groups
            return world_size == 1 or world_size % self.tp_degree == 0
        return not self.hybrid or (world_size >= 4 and world_size % 2 == 0)


STRATEGIES = (
    Strategy("ddp", DDP_SCRIPT, "ddp", "replicated"),
    Strategy("fsdp1_no_shard", FSDP1_SCRIPT, "ddp", "replicated", ("--sharding-strategy", "no_shard")),
    Strategy("fsdp1_full_shard", FSDP1_SCRIPT, "full_shard", "flat", ("--sharding-strategy", "full_shard")),
    Strategy("fsdp1_shard_grad_op", FSDP1_SCRIPT, "shard_grad_op", "flat", ("--sharding-strategy", "shard_grad_op")),
    Strategy(
        "fsdp1_hybrid_shard",
        FSDP1_SCRIPT,
        "hybrid_shard",
        "flat",
        ("--sharding-strategy", "hybrid_shard", "--replicate-degree", "2"),
        hybrid=True,
    ),
    Strategy("fsdp2", FSDP2_SCRIPT, "full_shard", "dim0"),
    Strategy("fsdp2_hsdp", FSDP2_SCRIPT, "hybrid_shard", "dim0", ("--replicate-degree", "2"), hybrid=True),
    # FSDP2 shards across the groups as it does across all ranks; the TP all-reduces come on top.
    Strategy("fsdp2_tp", FSDP2_TP_SCRIPT, "full_shard", "tp", ("--tp-degree", str(TP_DEGREE)), tp_degree=TP_DEGREE),
)
BY_NAME = {strategy.name: strategy for strategy in STRATEGIES}
assert {strategy.textbook for strategy in STRATEGIES} == set(TEXTBOOK)


def named(*names: str) -> list[Strategy]:
    """The rows of ``names``, in the table's order."""
    unknown = set(names) - BY_NAME.keys()
    if unknown:
        raise ValueError(f"no such strategy: {', '.join(sorted(unknown))}")
    return [strategy for strategy in STRATEGIES if strategy.name in names]
