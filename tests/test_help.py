"""Every flag of every script and command says in --help what it does and what its default is."""

from __future__ import annotations

import argparse
import runpy
from collections.abc import Callable

import pytest

from tests.harness.runs import REPO
from tools.benchmarks import benchmark, compare_strategies
from tools.checks import check_equivalence, comm_check
from tools.estimates import estimate_communication, estimate_memory
from tools.runs import compare_runs, export_checkpoint

SCRIPTS = ["ddp/train_mnist.py", "ddp/train_transformer.py", "fsdp/train_mnist.py", "fsdp/train_transformer.py"]
SCRIPTS += ["fsdp/train_transformer_fsdp2.py", "fsdp/train_transformer_fsdp2_tp.py"]
COMMANDS: dict[str, Callable[[list[str]], object]] = {
    "tools.benchmarks.benchmark": benchmark.main,
    "tools.checks.check_equivalence": check_equivalence.main,
    "tools.checks.comm_check": comm_check.main,
    "tools.runs.compare_runs": compare_runs.main,
    "tools.benchmarks.compare_strategies": compare_strategies.main,
    "tools.estimates.estimate_communication": estimate_communication.main,
    "tools.estimates.estimate_memory": estimate_memory.main,
    "tools.runs.export_checkpoint": export_checkpoint.main,
    "tools.estimates.simulate": __import__("tools.estimates.simulate", fromlist=["main"]).main,
    "tools.runs.plot": __import__("tools.runs.plot", fromlist=["main"]).main,
}


class Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def parser_of(entry_point: Callable[[list[str]], object], monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser that ``entry_point`` builds, caught when it starts parsing."""

    def capture(parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise Captured(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    with pytest.raises(Captured) as caught:
        entry_point([])
    return caught.value.parser


def undocumented(parser: argparse.ArgumentParser) -> list[str]:
    """Flags whose --help entry lacks a text, or lacks the default the flag has."""
    formatter = parser._get_formatter()
    missing = []
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        entry = formatter._format_action(action)
        has_default = action.default not in (None, False, argparse.SUPPRESS)
        if not action.help or (has_default and "default" not in entry):
            missing.append(action.option_strings[-1])
    return missing


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_of_a_script_has_help_and_shows_its_default(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parse_args = runpy.run_path(str(REPO / script))["parse_args"]
    assert undocumented(parser_of(parse_args, monkeypatch)) == []


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_of_a_command_has_help_and_shows_its_default(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert undocumented(parser_of(COMMANDS[command], monkeypatch)) == []


def test_a_default_computed_later_is_written_in_the_help_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    """--batch-size has no argparse default (--global-batch-size may decide it), yet shows the script's."""
    parser = parser_of(runpy.run_path(str(REPO / "ddp/train_mnist.py"))["parse_args"], monkeypatch)
    entry = next(action for action in parser._actions if "--batch-size" in action.option_strings)
    assert entry.default is None and "(default: 64)" in parser._get_formatter()._format_action(entry)


def test_the_global_batch_is_divided_over_the_data_parallel_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks of a tensor-parallel group share one batch: the help said N / (world size x ...) to the TP script."""
    parse_args = runpy.run_path(str(REPO / "fsdp/train_transformer_fsdp2_tp.py"))["parse_args"]
    entry = next(a for a in parser_of(parse_args, monkeypatch)._actions if "--global-batch-size" in a.option_strings)
    assert "N / (world size [/ --tp-degree under tensor parallelism] x --grad-accum-steps)" in entry.help, entry.help


def test_every_script_is_checked() -> None:
    present = sorted(
        str(path.relative_to(REPO)) for folder in ("ddp", "fsdp") for path in (REPO / folder).glob("train_*.py")
    )
    assert sorted(SCRIPTS) == present
