"""What tests run: the short runs' flags, the FSDP2 skips, and ``cases()``, a case table's parameters.

A case table is a list of rows whose first item names the case (its pytest id). ``cases()`` turns it
into ``pytest.param``s, marking the rows the floor pass runs too (``pytest -m floor``, on the oldest
supported torch) and skipping the FSDP2 script's rows where FSDP2 cannot run on the CPU.
"""

from __future__ import annotations

import ast
from collections.abc import Collection

import pytest

from common.distributed import FSDP2_CPU_OFFLOAD, FSDP2_ON_CPU, torch_at_least

# A short MNIST run: 2 epochs of the 3000-image rendered-digit fixture.
MNIST_ARGS = ["--epochs", "2", "--batch-size", "32", "--log-interval", "10"]
# A short transformer run: 300 steps of 48 sequences of 32 tokens, the same
# global batch at 1, 2 and 3 processes. It ends about 0.11 nats/token above the
# floor. The 0.3 bound leaves room for noise, yet fails a model stuck on the
# ~2.4 plateau of one that has not learned to use its context.
CONVERGE_ARGS = [
    "--max-steps", "300", "--global-batch-size", "48", "--lr", "1e-2", "--warmup-steps", "10",
    "--block-size", "32", "--log-interval", "10", "--eval-interval", "300",
]  # fmt: skip
NEAR_FLOOR = 0.3

# Parts that stop by design on an older torch (test_torch_versions.py shows each stop) are skipped there.
FSDP2_SCRIPT = "fsdp/train_transformer_fsdp2.py"
NEEDS_FSDP2_ON_CPU = pytest.mark.skipif(
    not torch_at_least(FSDP2_ON_CPU), reason="FSDP2 on the CPU needs torch 2.9 (test_torch_versions.py)"
)
NEEDS_FSDP2_CPU_OFFLOAD = pytest.mark.skipif(
    not torch_at_least(FSDP2_CPU_OFFLOAD), reason="FSDP2 --cpu-offload needs torch 2.9 (test_torch_versions.py)"
)


def cases(rows: list[tuple], floor: Collection[str] = (), keep_id: bool = True) -> list:
    """``pytest.param`` per row of a case table whose first item is the case's id.

    Rows named in ``floor`` get the ``floor`` marker: the floor pass (the oldest
    supported torch, ``pytest -m floor``) runs them too. Rows that run the FSDP2
    script are skipped where FSDP2 cannot run on the CPU. ``keep_id=False``
    passes the row without its id to the test.
    """
    params = []
    for row in rows:
        marks = [pytest.mark.floor] if row[0] in floor else []
        if FSDP2_SCRIPT in row:
            marks.append(NEEDS_FSDP2_ON_CPU)
        params.append(pytest.param(*(row if keep_id else row[1:]), id=row[0], marks=marks))
    return params


def is_program(module: ast.Module) -> bool:
    """A module that runs as a program: an ``if __name__ == "__main__":`` at its top level."""
    return any(
        isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and "__name__" in ast.unparse(node.test)
        for node in module.body
    )


def is_command(module: ast.Module) -> bool:
    """A program a user runs: it parses flags (test_every_flag.py and test_bad_input.py try them). A worker that
    a command starts reads its command's file instead (test_layout.py names them)."""
    return is_program(module) and any(
        isinstance(node, ast.FunctionDef) and node.name == "parse_args" for node in module.body
    )
