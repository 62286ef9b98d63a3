"""What the README shows must be what the code does."""

from __future__ import annotations

import re
import runpy

import torch

from common.metrics import progress_line
from common.training import warmup_cosine
from tests.conftest import REPO

EXAMPLE = re.compile(
    r"step (\d+)/(\d+) \| epoch +(\d+) \| loss +([\d.]+) \| grad norm +([\d.]+) \| lr ([\d.e+-]+) \| "
    r"+(\d+) tok/s \| +([\d.]+) ms/step"
)


def test_the_readme_progress_line_is_one_a_default_run_prints() -> None:
    """The format of the example line, and the learning rate the default schedule has at its step."""
    lines = [line for line in (REPO / "README.md").read_text().splitlines() if EXAMPLE.fullmatch(line)]
    assert len(lines) == 1, "the README shows one progress line"
    step, total, epoch, loss, norm, lr, rate, step_ms = EXAMPLE.fullmatch(lines[0]).groups()  # type: ignore[union-attr]
    printed = progress_line(
        int(step), int(total), int(epoch), float(loss), float(norm), float(lr), f"{int(rate):9d} tok/s", float(step_ms)
    )
    assert printed == lines[0]

    defaults = runpy.run_path(str(REPO / "ddp/train_transformer.py"))["parse_args"]([])
    assert int(total) == defaults.max_steps
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=defaults.lr)
    schedule = warmup_cosine(optimizer, defaults.warmup_steps, defaults.max_steps, defaults.min_lr_ratio)
    for _ in range(int(step)):
        optimizer.step()
        schedule.step()
    assert f"{schedule.get_last_lr()[0]:.3e}" == lr
