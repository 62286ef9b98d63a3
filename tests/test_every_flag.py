"""Every flag of every script and command, tried with the values that broke one before.

Generated from the parsers, not from a list: the scripts are ddp/train_*.py and fsdp/train_*.py, the commands
the tools/ modules with a ``__main__`` block (found as tests/test_layout.py finds them). Each has a
``parse_args(argv)`` that parses and runs the module's checks, and does no work. The test catches the
parser it builds, walks ``parser._actions``, and tries on each flag the hostile values of its kind,
which the flag's type declares (``common.flags``): for a number nan, inf, 0, -1, 1e999 and a word, and for
a whole number also integers past 64 bits (2**63, and a 401-digit one as a typo or a script makes), and for a
dimension of the model's tensors (``tools.command_flags.DIMENSION``) also sizes whose tensors torch cannot count; for
an input a missing path and the wrong kind of path; for an output a folder or a file where the other
goes, a place below a file (unwritable, even for root), and an input of the same command; two outputs of
one command get one path (a file and a file, or a file and a folder). A flag with choices gets a word that
is none of them. Each try must end in exactly one ``error:`` line naming the
flag, exit code 2 and no traceback, within seconds, all in this one process.

A flag whose type declares no kind fails the test, unless FREE_TEXT says why it takes any text; a
hostile value that a flag legitimately takes is declared in VALID with the reason, and must parse.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import itertools
import json
import os
import runpy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from common import flags
from tests.harness.cases import is_command
from tests.harness.runs import REPO, clean_env
from tools.command_flags import DIMENSION

SCRIPTS = sorted(str(path.relative_to(REPO)) for path in [*REPO.glob("ddp/train_*.py"), *REPO.glob("fsdp/train_*.py")])


COMMANDS = sorted(
    ".".join(path.relative_to(REPO).with_suffix("").parts)
    for path in (REPO / "tools").rglob("*.py")
    if is_command(ast.parse(path.read_text(), filename=str(path)))
)

# Values a flag of that kind must refuse; an output flag is also tried with an input of its command.
ANY_PATH = ["", "{too_long}"]  # an empty path; a name longer than a file system takes (ENAMETOOLONG)
NUMBERS = ["nan", "inf", "0", "-1", "1e999", "many"]
# Python reads any integer, torch and numpy no larger than 2**63 - 1: these once reached a tensor's shape
# (tools.estimates.simulate --batch-size, a traceback from torch.randint).
HUGE_INTEGERS = [str(2**63), str(10**400)]
# Within 64 bits, but a model's tensors of that size are more bytes than torch counts (2**63): a width of 10**9 made
# a q|k|v weight of 3 x 10**18 values ("Storage size calculation overflowed", tools.estimates.estimate_memory), 2**32
# squares to 2**64, and one dimension of 2**61 fp32 values alone is 2**63 bytes.
TENSOR_OVERFLOWS = [str(10**9), str(2**32), str(2**61)]
HOSTILE = {
    flags.NUMBER: NUMBERS,
    flags.INTEGER: [*NUMBERS, *HUGE_INTEGERS],
    DIMENSION: [*NUMBERS, *HUGE_INTEGERS, *TENSOR_OVERFLOWS],
    flags.EXISTING_FILE: ["{missing}", "{folder}", *ANY_PATH],
    flags.EXISTING_DIR: ["{missing}", "{file}", *ANY_PATH],
    flags.EXISTING_PATH: ["{missing}", "{below_file}", *ANY_PATH],
    flags.OUTPUT_FILE: ["{folder}", "{below_file}", *ANY_PATH],
    flags.OUTPUT_DIR: ["{file}", "{below_file}", *ANY_PATH],
    flags.OUTPUT_PATH: ["{below_file}", *ANY_PATH],
    flags.NAME_PATTERN: ["", " "],  # one that matches nothing is refused when the model exists
}
NOT_A_CHOICE = "no-such-choice"

# (flag, value): why a hostile value is a setting the flag means. Each must parse.
VALID = {
    ("--max-steps", "0"): "a run of 0 steps only evaluates the model",
    ("--profile", "0"): "0 steps of trace: no trace",
    ("--checkpoint-interval", "0"): "0: a checkpoint only when the run is asked to stop",
    ("--grad-clip", "0"): "0 turns clipping off",
    ("--seed", "0"): "seeds start at 0",
    ("--rank", "0"): "ranks start at 0 (tools.estimates.simulate's rank)",
    ("--warmup-steps", "0"): "no warm-up: the schedule starts at the peak",
    ("--min-lr-ratio", "0"): "the cosine schedule ends at 0",
    ("--weight-decay", "0"): "no weight decay",
    ("--dropout", "0"): "no dropout (what --deterministic needs)",
    ("--loss-rtol", "0"): "exact equality",
    ("--grad-norm-rtol", "0"): "exact equality",
    ("--param-atol", "0"): "exact equality",
}

# (program, flag or positional's dest): why it takes any text. Everything else needs a kind or choices.
FREE_TEXT = {
    ("tools.runs.sample", "--prompt"): "text, or ids; check_args refuses what the run's vocabulary cannot say",
    ("tools.checks.check_equivalence", "flags"): "the script's own flags, passed on to the script, which checks them",
    ("tools.checks.preflight", "flags"): "the script's own flags, passed on to the script, which checks them",
}


@dataclass(frozen=True)
class Places:
    """Paths a base command line or a hostile value names, made fresh for the test."""

    root: Path

    @property
    def values(self) -> dict[str, str]:
        return {
            "missing": str(self.root / "no-such-thing"),
            "folder": str(self.root / "a-folder"),
            "file": str(self.root / "a-file.txt"),
            "below_file": str(self.root / "a-file.txt" / "inside"),
            "too_long": str(self.root / ("x" * 300) / "out"),
            "shared": str(self.root / "one-path-for-two.png"),  # a name every output takes (.png for a picture)
            "text": str(self.root / "a-file.txt"),
            "out": str(self.root / "outputs" / "out.json"),
            "runs": str(self.root / "runs"),
            "run_a": str(self.root / "run-a"),
            "run_b": str(self.root / "run-b"),
            "finished_run": str(self.root / "finished-run"),
            "checkpoint": str(self.root / "old-run" / "checkpoints" / "step-2.pt"),
            "script": str(REPO / "ddp" / "train_mnist.py"),
        }

    def make(self) -> None:
        for folder in ("a-folder", "run-a", "run-b", "finished-run", "old-run/checkpoints"):
            (self.root / folder).mkdir(parents=True)
        (self.root / "a-file.txt").write_text("some text, as a user's file holds\n")
        (self.root / "old-run" / "checkpoints" / "step-2.pt").write_bytes(b"a checkpoint")
        config = {"vocab_size": 50, "block_size": 8, "n_layer": 1, "n_head": 1, "d_model": 8}
        final = {"event": "final", "model_config": config}  # what tools.runs.sample checks before it loads model.pt
        (self.root / "finished-run" / "metrics.jsonl").write_text(json.dumps(final) + "\n")
        (self.root / "finished-run" / "model.pt").write_bytes(b"weights")


# Each program's command line that parses: (options, positionals by dest). A hostile value replaces one.
SCRIPT_BASE = (["--device", "cpu", "--run-dir", "{runs}"], {})
BASE: dict[str, tuple[list[str], dict[str, list[str]]]] = {
    "tools.benchmarks.benchmark": (["--out", "{out}"], {}),
    "tools.checks.check_equivalence": (["--nproc", "2", "--runs-dir", "{runs}"], {"script": ["{script}"]}),
    "tools.checks.comm_check": (["--device", "cpu", "--out", "{out}"], {}),
    "tools.runs.compare_runs": ([], {"run_a": ["{run_a}"], "run_b": ["{run_b}"]}),
    "tools.benchmarks.compare_strategies": (["--device", "cpu", "--out-dir", "{runs}"], {}),
    # The GPT, not --params: its shape flags are then tried as its shape, where a size can overflow a tensor.
    "tools.estimates.estimate_communication": (["--model", "tiny", "--world-size", "8"], {}),
    "tools.estimates.estimate_memory": (["--model", "tiny", "--world-size", "8", "--gpu-memory", "80"], {}),
    "tools.runs.export_checkpoint": ([], {"checkpoint": ["{checkpoint}"], "output": ["{out}"]}),
    "tools.runs.plot": (["--out", "{out}.png"], {"run_dirs": ["{finished_run}"]}),
    "tools.checks.preflight": (["--nproc", "2"], {"script": ["{script}"]}),
    "tools.checks.hang_report": ([], {"run_dir": ["{finished_run}"]}),
    "tools.runs.prepare_tokens": (["--output", "{out}"], {"sources": ["{text}"]}),
    "tools.runs.sample": (["--prompt", "3 14 15"], {"run_dir": ["{finished_run}"]}),
    "tools.estimates.simulate": (["--world-size", "8", "--strategy", "fsdp2"], {}),
}


def entry_point(program: str) -> Callable[[list[str]], object]:
    if program.endswith(".py"):
        return runpy.run_path(str(REPO / program))["parse_args"]
    return importlib.import_module(program).parse_args


class Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def parser_of(parse_args: Callable[[list[str]], object]) -> argparse.ArgumentParser:
    """The parser ``parse_args`` builds, caught as it starts parsing."""

    def capture(parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise Captured(parser)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", capture)
        patch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
        try:
            parse_args([])
        except Captured as caught:
            return caught.parser
    raise AssertionError("parse_args returned without parsing")


def takes_values(action: argparse.Action) -> bool:
    return action.nargs != 0 and not isinstance(action, argparse._HelpAction)


def name_of(action: argparse.Action) -> str:
    return action.option_strings[-1] if action.option_strings else action.dest


@dataclass(frozen=True)
class Case:
    program: str
    flag: str
    value: str
    argv: list[str]
    must_fail: bool
    shown: str = ""  # how argparse names the flag in its message: the option, or a positional's metavar


def shown_as(action: argparse.Action) -> str:
    return action.option_strings[-1] if action.option_strings else str(action.metavar or action.dest)


def command_line(
    program: str, parser: argparse.ArgumentParser, replaced: dict[argparse.Action, str], places: dict[str, str]
) -> list[str]:
    """The base command line with ``replaced``'s flags set to the given values (paths filled in)."""
    options, positionals = SCRIPT_BASE if program.endswith(".py") else BASE[program]
    argv = [part.format(**places) for part in options]
    for action, value in replaced.items():
        if action.option_strings:
            argv += [action.option_strings[-1], value.format(**places)]
    for action in parser._actions:
        if not action.option_strings:
            given = [replaced[action]] if action in replaced else positionals.get(action.dest, [])
            argv += [part.format(**places) for part in given]
    return argv


def cases(program: str, parser: argparse.ArgumentParser, places: dict[str, str]) -> Iterator[Case]:
    inputs = [a for a in parser._actions if getattr(a.type, "kind", None) in (flags.EXISTING_FILE, flags.EXISTING_PATH)]
    for action in filter(takes_values, parser._actions):
        kind = getattr(action.type, "kind", None)
        values = HOSTILE.get(kind, [NOT_A_CHOICE] if action.choices else [])
        for value in values:
            argv = command_line(program, parser, {action: value}, places)
            must_fail = (name_of(action), value) not in VALID
            yield Case(program, name_of(action), value.format(**places), argv, must_fail, shown_as(action))
        if kind in (flags.OUTPUT_FILE, flags.OUTPUT_DIR, flags.OUTPUT_PATH):
            for source in inputs:
                _, positionals = SCRIPT_BASE if program.endswith(".py") else BASE[program]
                value = (positionals.get(source.dest) or ["{text}"])[0]
                argv = command_line(program, parser, {source: value, action: value}, places)
                yield Case(program, name_of(action), value.format(**places), argv, True, shown_as(action))


def shared_outputs(program: str, parser: argparse.ArgumentParser, places: dict[str, str]) -> Iterator[Case]:
    """Each two outputs of the command on one path; two folders may share one (a run's folder can hold its data)."""
    kinds = (flags.OUTPUT_FILE, flags.OUTPUT_DIR, flags.OUTPUT_PATH)
    outputs = [a for a in filter(takes_values, parser._actions) if getattr(a.type, "kind", None) in kinds]
    for first, second in itertools.combinations(outputs, 2):
        if first.type.kind == second.type.kind == flags.OUTPUT_DIR:
            continue
        argv = command_line(program, parser, {first: "{shared}", second: "{shared}"}, places)
        flag = f"{name_of(first)} and {name_of(second)}"
        yield Case(program, flag, places["shared"], argv, must_fail=True, shown=shown_as(second))


def unchecked(program: str, parser: argparse.ArgumentParser) -> list[str]:
    """Flags that take a value nobody checks: no kind, no choices, and no reason in FREE_TEXT."""
    return [
        name_of(action)
        for action in filter(takes_values, parser._actions)
        if getattr(action.type, "kind", None) is None
        and not action.choices
        and (program, name_of(action)) not in FREE_TEXT
    ]


def outcome(parse_args: Callable[[list[str]], object], case: Case, capsys: pytest.CaptureFixture[str]) -> str | None:
    """What is wrong with how ``parse_args`` met ``case``; None if nothing."""
    started = time.perf_counter()
    try:
        parse_args(case.argv)
        code: object = 0
    except SystemExit as stop:
        code = stop.code
    except Exception as err:  # noqa: BLE001 - a traceback is what the test is looking for
        return f"raised {type(err).__name__}: {err}"
    elapsed = time.perf_counter() - started
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    if elapsed > 3:
        return f"took {elapsed:.1f} s"
    if not case.must_fail:
        return None if code == 0 else f"exit {code}, though VALID declares it: {captured.err}"
    if code != 2 or len(errors) != 1 or "Traceback" in captured.err:
        return f"exit {code}, {len(errors)} error line(s): {captured.err or captured.out}"
    if case.shown not in errors[0] and case.value not in errors[0]:
        return f"the error names neither the flag nor the value: {errors[0]}"
    return None


@pytest.fixture(autouse=True)
def single_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No launcher's variables, as for a plain ``python script.py``."""
    for name in os.environ.keys() - clean_env().keys():
        monkeypatch.delenv(name, raising=False)


def test_every_program_is_found() -> None:
    """The discovery sees what test_layout.py and README.md count: 6 scripts, 11 commands."""
    assert len(SCRIPTS) == 6, SCRIPTS
    assert {"tools.runs.sample", "tools.checks.preflight", "tools.checks.comm_check"} <= set(COMMANDS) and len(
        COMMANDS
    ) >= 11
    assert set(COMMANDS) == set(BASE), "give a new command its base command line in BASE"


def test_every_flag_refuses_what_broke_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Prints how many flags and values it tried (shown without -n: pytest tests/test_every_flag.py)."""
    places = Places(tmp_path)
    places.make()
    failures, tried, flags_seen, declared_valid = [], 0, 0, 0
    for program in [*SCRIPTS, *COMMANDS]:
        parse_args = entry_point(program)
        parser = parser_of(parse_args)
        failures += [f"{program} {name}: no kind, no choices" for name in unchecked(program, parser)]
        base = command_line(program, parser, {}, places.values)
        problem = outcome(parse_args, Case(program, "(base)", "", base, must_fail=False), capsys)
        if problem is not None:
            failures.append(f"{program} {' '.join(base)}: the base command line fails: {problem}")
            continue
        flags_seen += sum(1 for _ in filter(takes_values, parser._actions))
        for case in [*cases(program, parser, places.values), *shared_outputs(program, parser, places.values)]:
            tried += 1
            declared_valid += not case.must_fail
            problem = outcome(parse_args, case, capsys)
            if problem is not None:
                failures.append(f"{program} {case.flag} {case.value}: {problem}")
    with capsys.disabled():
        programs = len(SCRIPTS) + len(COMMANDS)
        print(f"\n{flags_seen} flags of {programs} programs: {tried} values tried, {declared_valid} of them VALID")
    assert not failures, "\n".join(failures)


# The dests of the flags that size the GPT's tensors in a command (the estimators, tools.estimates.simulate).
MODEL_DIMENSIONS = {"n_layer", "n_head", "d_model", "block_size", "vocab_size", "batch_size"}


def test_every_flag_that_sizes_a_commands_model_is_tried_as_a_dimension() -> None:
    """A shape flag typed as a plain whole number would be tried with 64-bit overflows only, which --d-model 10**9
    passed on its way to a traceback."""
    plain = [
        f"{program} {name_of(action)}"
        for program in COMMANDS
        for action in parser_of(entry_point(program))._actions
        if action.dest in MODEL_DIMENSIONS and getattr(action.type, "kind", None) != DIMENSION
    ]
    assert not plain, plain


@pytest.mark.parametrize("program", COMMANDS)
def test_a_command_names_itself_as_the_user_typed_it(program: str) -> None:
    """An error line starts with what the user typed, ``python -m tools.GROUP.NAME``, not the module's file name."""
    assert parser_of(entry_point(program)).prog == f"python -m {program}"
