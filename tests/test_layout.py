"""The shape of the repository: common/ is what a copied script runs, tools/ the commands around it.

A command is a module of tools/ run with ``python -m tools.GROUP.NAME`` (it has a ``__main__`` block).
common/ never imports tools/, so a copied script's imports never pass through a command's flags and
tables; and every module of common/ is one that some script runs, so the copy step ("copy common/")
copies no command. How much a reader must read to follow one script is measured by following its
imports, at the top of a module or inside a function alike.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

from tests.harness.cases import is_command, is_program
from tests.harness.runs import REPO

SCRIPTS = sorted([*REPO.glob("ddp/train_*.py"), *REPO.glob("fsdp/train_*.py")])
MNIST_SCRIPTS = [script for script in SCRIPTS if "mnist" in script.name]
# What a copy of one script makes its reader carry, as a budget that grows only by what a feature is measured to cost:
# the transformer scripts needed 25 modules and 6,076 lines when issue 53 began, 18 and 5,411 when it left common/ to
# the scripts, 16 and 4,498 once common/ was condensed, 16 and 4,423 after a second pass module by module, which
# issue 69 kept while it gave Bookkeeping real methods. Then --tensorboard (issue 72: the flag, its check, the
# EventFile MetricsLog writes, the folder's name) cost 51 lines, and issue 75's fixes 52 (a resume naming each LoRA
# flag that differs, an OMP_NUM_THREADS OpenMP does not count, a family's own names in its files, only the config
# fields that differ): 4,526 (the MNIST scripts 4,309). Issue 73's --fused-adamw and --sdpa-backend (the flags, the
# check of the kernel a device lacks, the attention's kernel choice with its table of names) cost 36: 4,562. Then
# --async-checkpoint (issue 71) cost a module and 145 lines: common/async_checkpoint.py (87: the save group, the
# staging, the rename once written, the wait of a failed run's teardown), the waits and the pruning that spares a save
# in flight in checkpoint.py and run_dir.py (41, with pruning and the setting aside of newer checkpoints moved to
# run_dir.py so that checkpoint.py stays under 450), the flag and its check (13), the teardown's wait (4): 17 modules
# and 4,707 lines. Issue 70's hang report took a module of its own and 345 lines (common/hangs.py, 326: the Flight
# Recorder's switch, the watchdog, the ranks meeting in the store, reading the traces back into one report, which the
# job prints itself, so common/ must hold it; the two flags, their place among the settings a checkpoint does not
# record, and the heartbeat, 19; then 3 more to write its files through write_outputs): 18 modules, 5,055 lines.
# Staging a background save by cloning each tensor (a third of torch's stager's time a save) cost 14: 5,069. The
# watchdog thread ended and joined with training (a daemon thread left polling can abort a finished run): 5,088;
# a trace that is plain data but not a trace is one message, not a traceback: 5,107. The watch's clock held through
# evaluations and checkpoint saves, and stopped after the last step (a cluster's long save is no hang): 5,125.
MOST_MODULES_A_SCRIPT_NEEDS = 18
MOST_LINES_A_SCRIPT_NEEDS = 5_125
# The code that reads text and token files, which the MNIST scripts have no use for.
TOKEN_FILE_MODULES = {"common.tokens"}


def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


# Programs that a command starts and a user never does: each reads what its command wrote, not flags.
WORKERS = {"tools.benchmarks.bare_loop", "tools.benchmarks.timed_saves"}


SOURCES = {module_name(path): path for path in sorted([*REPO.glob("common/*.py"), *REPO.glob("tools/**/*.py")])}
MODULES = {name: parsed(path) for name, path in SOURCES.items()}
# The package itself too: ``from common import cli`` names it before the module.
LIBRARY = {name for name in MODULES if name == "common" or name.startswith("common.")}
COMMANDS = {name for name, module in MODULES.items() if is_command(module)}
PROGRAMS = {name for name, module in MODULES.items() if is_program(module)}


def imported_modules(module: ast.Module) -> set[str]:
    """The modules of common/ and tools/ that ``module`` imports, at its top or inside a function;
    ``from common import X`` counts as importing common.X when X is a module."""
    found = set()
    for node in ast.walk(module):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found & MODULES.keys()


def reached_from(names: set[str]) -> set[str]:
    """Every module ``names`` import, directly or through others, with ``names`` themselves."""
    reached, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += imported_modules(MODULES[name])
    return reached


# A package's __init__ (common's holds a docstring) is not counted, as issue 53's figures were measured.
PACKAGES = {name for name, path in SOURCES.items() if path.name == "__init__.py"}


# Modules beside the scripts that a script imports by its bare name (fsdp/tensor_parallel.py): a copy takes them along.
HELPERS = {path.stem: path for path in [*REPO.glob("ddp/*.py"), *REPO.glob("fsdp/*.py")] if path not in SCRIPTS}


def helpers_of(module: ast.Module) -> set[str]:
    found = {alias.name for node in ast.walk(module) if isinstance(node, ast.Import) for alias in node.names}
    found |= {node.module for node in ast.walk(module) if isinstance(node, ast.ImportFrom) and node.level == 0}
    return found & HELPERS.keys()


def needed_by(script: Path) -> set[str]:
    """The modules of common/ a copy of ``script`` runs, through the helpers beside it too."""
    tree = parsed(script)
    imported = imported_modules(tree).union(*(imported_modules(parsed(HELPERS[name])) for name in helpers_of(tree)))
    return reached_from(imported) - PACKAGES


def lines_of(names: set[str]) -> int:
    return sum(len(SOURCES[name].read_text().splitlines()) for name in names)


def test_the_library_never_imports_a_command_or_anything_else_of_tools() -> None:
    assert {"tools.estimates.estimate_memory", "tools.checks.preflight"} <= COMMANDS, "the rule must see the commands"
    assert "common.distributed" in LIBRARY, "the rule must see the library"
    offenders = {name: sorted(imported_modules(MODULES[name]) - LIBRARY) for name in LIBRARY}
    assert not {name: found for name, found in offenders.items() if found}


def test_common_holds_what_the_scripts_run_and_nothing_else() -> None:
    needed = set().union(*(needed_by(script) for script in SCRIPTS))
    assert len(SCRIPTS) == 6 and "common.checkpoint" in needed
    assert not needed - LIBRARY, "a script reaches a module outside common/"
    assert not LIBRARY - needed - {"common"}, "common/ holds modules no script runs: they belong in tools/"


def test_a_copy_of_any_script_carries_no_more_modules_and_lines_than_its_budget() -> None:
    for script in SCRIPTS:
        needed = needed_by(script)
        where = script.relative_to(REPO)
        assert len(needed) <= MOST_MODULES_A_SCRIPT_NEEDS, f"{where} needs {len(needed)} modules: {sorted(needed)}"
        assert lines_of(needed) <= MOST_LINES_A_SCRIPT_NEEDS, f"{where} needs {lines_of(needed):,} lines of common/"


# What a reader meets before a script's lesson starts (issue 53), and how long train() and the TP script may grow
# (issue 69: train() was 100 to 123 lines in the six scripts, the TP script 552 lines before its helpers moved out).
MOST_IMPORT_LINES = 30
MOST_LINES_OF_TRAIN = 80
MOST_LINES_OF_THE_TP_SCRIPT = 382  # issue 70: the hang watch, a line of main() and its import; issue 73: eager eval


def import_lines(module: ast.Module) -> int:
    """The lines a module's top-level import statements take as formatted."""
    imports = [node for node in module.body if isinstance(node, ast.Import | ast.ImportFrom)]
    return sum(node.end_lineno - node.lineno + 1 for node in imports)  # type: ignore[operator]


def function(module: ast.Module, name: str) -> ast.FunctionDef:
    (found,) = [node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == name]
    return found


def test_every_script_imports_in_a_few_lines_and_its_train_stays_short() -> None:
    for script in SCRIPTS:
        where, tree = script.relative_to(REPO), parsed(script)
        lines = import_lines(tree)
        assert lines <= MOST_IMPORT_LINES, f"{where}: its imports take {lines} lines"
        train = function(tree, "train")
        length = train.end_lineno - train.lineno + 1  # type: ignore[operator]
        assert length <= MOST_LINES_OF_TRAIN, f"{where}: train() takes {length} lines"
    tp_script = REPO / "fsdp" / "train_transformer_fsdp2_tp.py"
    assert len(tp_script.read_text().splitlines()) <= MOST_LINES_OF_THE_TP_SCRIPT


# The training loop of train() calls into at most this many modules of common/ (issue 69: five before, to follow one
# step). An object counts for the module of the class it was built from; one of a class that extends torch's (the
# sampler: torch's DistributedSampler), or that a function returned (an LR scheduler), is used through torch's API,
# which torch's documentation teaches.
MOST_MODULES_IN_THE_LOOP = 2


def modules_the_loop_calls(script: Path) -> set[str]:
    tree = parsed(script)
    source_of = {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common")
        for alias in node.names
    }
    train = function(tree, "train")
    built_by: dict[str, str] = {}
    for node in ast.walk(train):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
            maker = node.value.func.id
            if maker in source_of and is_own_class(source_of[maker], maker):
                built_by |= {target.id: source_of[maker] for target in node.targets if isinstance(target, ast.Name)}
    (loop,) = [node for node in train.body if isinstance(node, ast.While | ast.For)]
    called = set()
    for node in ast.walk(loop):
        if isinstance(node, ast.Call):
            root = node.func
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name):
                called.add(root.id)
    return {source_of.get(name) or built_by[name] for name in called if name in source_of or name in built_by}


def is_own_class(module_name: str, name: str) -> bool:
    """A class of common/ that extends none of torch's; what a function returns (a DataLoader, an LR scheduler)
    is torch's."""
    made = getattr(importlib.import_module(module_name), name)
    return isinstance(made, type) and not any(base.__module__.startswith("torch.") for base in made.__mro__[1:])


def test_the_training_loop_of_every_script_calls_into_at_most_two_modules_of_common() -> None:
    found = {str(script.relative_to(REPO)): modules_the_loop_calls(script) for script in SCRIPTS}
    assert {"common.bookkeeping", "common.checkpoint"} <= found["fsdp/train_transformer_fsdp2.py"], "rule sees them"
    assert not {where: modules for where, modules in found.items() if len(modules) > MOST_MODULES_IN_THE_LOOP}


def test_the_mnist_scripts_carry_no_token_file_code() -> None:
    assert needed_by(REPO / "fsdp" / "train_transformer.py") >= TOKEN_FILE_MODULES, "the rule must see the module"
    for script in MNIST_SCRIPTS:
        assert not needed_by(script) & TOKEN_FILE_MODULES, script.relative_to(REPO)


def cycle_through(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` as the modules on it, or [] if it has none."""
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> list[str]:
        state[name] = "open"
        for imported in sorted(graph[name]):
            if state.get(imported) == "open":
                return [*path[path.index(imported) :], imported]
            if imported not in state and (found := visit(imported, [*path, imported])):
                return found
        state[name] = "done"
        return []

    for name in sorted(graph):
        if name not in state and (found := visit(name, [name])):
            return found
    return []


def test_the_import_graph_has_no_cycles() -> None:
    graph = {name: imported_modules(module) - {name} for name, module in MODULES.items()}
    assert cycle_through({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"], "the rule must see a cycle"
    assert cycle_through(graph) == []


def test_every_program_is_a_command_or_a_named_worker() -> None:
    """A program without flags escapes the flag tests: only the workers named here may be one."""
    assert PROGRAMS - COMMANDS == WORKERS


def test_every_command_is_on_the_front_page() -> None:
    listed = set(re.findall(r"python -m (tools\.\w+\.\w+)", (REPO / "README.md").read_text()))
    assert not COMMANDS - listed, "commands README.md does not list"
    assert not listed - COMMANDS, "modules README.md runs that are no commands"


def imported_packages(module: ast.Module) -> set[str]:
    found = set()
    for node in ast.walk(module):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
    return found


def test_the_scripts_and_common_never_import_transformers() -> None:
    """A Hugging Face model comes in through a copy and examples/hf_model.py; the library needs safetensors only."""
    modules = {name: MODULES[name] for name in LIBRARY} | {
        str(script.relative_to(REPO)): parsed(script) for script in SCRIPTS
    }
    assert "transformers" in imported_packages(parsed(REPO / "examples" / "hf_model.py")), "the rule must see it"
    assert not [path for path, module in modules.items() if "transformers" in imported_packages(module)]


def test_a_command_strips_every_variable_by_which_torchrun_places_a_process() -> None:
    """tools/processes.py spells torchrun's variables itself (its process never imports torch); they must
    cover what the scripts read, or a command's ranks would join the job the command runs in."""
    from common.distributed import LAUNCH_VARIABLES
    from tools.processes import TORCHRUN_VARIABLES

    assert {*LAUNCH_VARIABLES, "MASTER_ADDR", "MASTER_PORT"} <= set(TORCHRUN_VARIABLES)


def test_the_bare_loop_takes_the_model_the_data_and_the_schedule_and_nothing_of_the_bookkeeping() -> None:
    """tools/benchmarks/bare_loop.py is what the harness's cost is measured against: a reader must see at
    its imports that it runs none of what it is compared with (stop checks, loss checks, logging)."""
    tree = ast.parse((REPO / "tools/benchmarks/bare_loop.py").read_text())
    imported = {
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in {"common", "tools"}
        for alias in node.names
    }
    plain = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert imported == {
        ("common.data", "CompactDistributedSampler"),
        ("common.data", "markov_data"),
        ("common.models", "GPT"),
        ("common.models", "GPTConfig"),
        ("common.training", "warmup_cosine"),
    }
    assert not [name for name in plain if name.split(".")[0] in {"common", "tools"}], plain


def namespace_parameters(function: ast.FunctionDef) -> set[str]:
    """The parameters of ``function`` that hold parsed flags: named ``args`` or annotated as a Namespace."""
    every = [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]
    annotated = {arg.arg for arg in every if arg.annotation and "Namespace" in ast.unparse(arg.annotation)}
    return annotated | {arg.arg for arg in every if arg.arg == "args"}


def writes_to(function: ast.FunctionDef, names: set[str]) -> list[str]:
    """Each place in ``function`` that changes an attribute of one of ``names``: ``args.x = ...`` in any form
    (augmented, unpacked, a loop's target, ``del``), ``setattr``/``delattr`` on it, or any use of its ``vars()`` or
    ``__dict__``, through which a write would go unseen."""
    found = []
    for node in ast.walk(function):
        target = None
        if isinstance(node, ast.Attribute) and (isinstance(node.ctx, ast.Store | ast.Del) or node.attr == "__dict__"):
            target = node.value
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("setattr", "delattr", "vars"):
            target = node.args[0] if node.args else None
        if isinstance(target, ast.Name) and target.id in names:
            found.append(f"line {node.lineno} writes {ast.unparse(node)}")
    return found


def check_functions() -> dict[str, ast.FunctionDef]:
    """Every function named check_* in common/ and in the scripts (the TP script keeps its own), by where it is."""
    paths = [*REPO.glob("common/*.py"), *SCRIPTS]
    return {
        f"{path.relative_to(REPO)}::{node.name}": node
        for path in paths
        for node in ast.walk(parsed(path))
        if isinstance(node, ast.FunctionDef) and node.name.startswith("check_")
    }


def test_a_flag_check_only_checks_and_fills_in_nothing() -> None:
    """A check that also filled in a value (the per-rank batch, the compute dtype, the preset's sizes) made the order
    of the checks matter and differ between the scripts: each value the flags leave open is filled in by
    common.flag_checks.resolve_flags, which every script calls once, in one order, before its checks."""
    (slip,) = ast.parse(
        "def check_x(parser, args):\n    if args.a:\n        args.b, n = 1, 2\n    setattr(args, 'c', 3)"
    ).body
    assert isinstance(slip, ast.FunctionDef) and len(writes_to(slip, {"args"})) == 2, "the rule must see a write"
    checks = check_functions()
    assert {"common/flag_checks.py::check_transformer_flags", "common/tokens.py::check_data_flags"} <= checks.keys()
    offenders = {where: writes_to(node, namespace_parameters(node)) for where, node in checks.items()}
    assert not {where: found for where, found in offenders.items() if found}
