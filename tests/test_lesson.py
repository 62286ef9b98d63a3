"""What a reader learns from a training script itself, without opening common/.

Each script shows the process group's life (``init_process_group`` .. ``destroy_process_group``)
and the sampler on lines marked DISTRIBUTED, and puts every choice of its strategy in one function,
``wrap_model``, so that the diff between the DDP and FSDP script of a pair is mostly that function.
The run directory's file names are spelled in one library module, which every other one asks.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

from tests.harness.runs import REPO

SCRIPTS = sorted([*REPO.glob("ddp/train_*.py"), *REPO.glob("fsdp/train_*.py")])
# What the seeds teach first; the repository's sampler is a subclass of torch's and named after it.
SHOWN_CALLS = ("init_process_group", "destroy_process_group", "DistributedSampler")
# The calls that make the strategy: they belong in wrap_model, not spread through train().
WRAP_CALLS = {"DDP", "FSDP", "fully_shard", "init_device_mesh", "checkpoint_activations", "compile_layers"}
# The acceptance of issue 38, as `diff A B` counts changed lines (218 and 93 before it), and of issue 69 for what
# tensor parallelism adds to FSDP2 (360 before its helpers moved beside the script).
MOST_CHANGED_LINES = {
    ("ddp/train_transformer.py", "fsdp/train_transformer.py"): 170,
    ("ddp/train_mnist.py", "fsdp/train_mnist.py"): 70,
    ("fsdp/train_transformer_fsdp2.py", "fsdp/train_transformer_fsdp2_tp.py"): 220,
}
MAX_MODULE_LINES = 450
RUN_DIR_NAMES = ("metrics.jsonl", "model.pt")


def called_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def innermost_statements(tree: ast.Module) -> dict[int, ast.stmt]:
    """For each call, by its id, the innermost statement that holds it."""
    holder: dict[int, ast.stmt] = {}

    def visit(node: ast.AST, statement: ast.stmt | None) -> None:
        if isinstance(node, ast.stmt):
            statement = node
        if isinstance(node, ast.Call) and statement is not None:
            holder[id(node)] = statement
        for child in ast.iter_child_nodes(node):
            visit(child, statement)

    visit(tree, None)
    return holder


def marked_distributed(lines: list[str], statement: ast.stmt) -> bool:
    """The statement's first line, or the comment block right above it, says DISTRIBUTED."""
    if "# DISTRIBUTED" in lines[statement.lineno - 1]:
        return True
    above = statement.lineno - 2
    while above >= 0 and lines[above].lstrip().startswith("#"):
        if "# DISTRIBUTED" in lines[above]:
            return True
        above -= 1
    return False


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: str(path.relative_to(REPO)))
def test_the_process_group_and_the_sampler_are_in_the_script_on_lines_marked_distributed(script: Path) -> None:
    source = script.read_text()
    tree = ast.parse(source)
    lines = source.splitlines()
    holders = innermost_statements(tree)
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    for name in SHOWN_CALLS:
        found = [call for call in calls if called_name(call).endswith(name)]
        assert found, f"{script.name} never calls {name}"
        unmarked = [call.lineno for call in found if not marked_distributed(lines, holders[id(call)])]
        assert not unmarked, f"{script.name}: {name} on lines {unmarked}, not marked DISTRIBUTED"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_choice_of_the_strategy_is_in_one_wrap_function_that_train_calls(script: Path) -> None:
    tree = ast.parse(script.read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert "wrap_model" in functions, f"{script.name} has no module-level wrap_model"
    wrap_calls = {called_name(node) for node in ast.walk(functions["wrap_model"]) if isinstance(node, ast.Call)}
    assert wrap_calls & {"DDP", "FSDP", "fully_shard"}, f"{script.name}: wrap_model wraps nothing"
    elsewhere = {
        (called_name(node), node.lineno)
        for name, function in functions.items()
        if name != "wrap_model"
        for node in ast.walk(function)
        if isinstance(node, ast.Call) and called_name(node) in WRAP_CALLS
    }
    assert not elsewhere, f"{script.name}: strategy calls outside wrap_model: {sorted(elsewhere)}"
    train_calls = [called_name(node) for node in ast.walk(functions["train"]) if isinstance(node, ast.Call)]
    assert train_calls.count("wrap_model") == 1, f"{script.name}: train() must call wrap_model once"


def changed_lines(pair: tuple[str, str]) -> int:
    """The lines ``diff A B`` marks as changed (``<`` and ``>``), as a reader running it counts them."""
    diff = subprocess.run(["diff", *pair], cwd=REPO, capture_output=True, text=True, check=False)
    assert diff.returncode == 1, diff.stderr  # 1: they differ; 2: diff failed
    return sum(1 for line in diff.stdout.splitlines() if line[:2] in ("< ", "> ") or line in ("<", ">"))


@pytest.mark.parametrize(("pair", "most"), MOST_CHANGED_LINES.items(), ids=lambda value: str(value))
def test_the_ddp_and_fsdp_script_of_a_pair_differ_mostly_in_the_wrap(pair: tuple[str, str], most: int) -> None:
    changed = changed_lines(pair)
    assert changed <= most, f"diff {' '.join(pair)} changes {changed} lines; at most {most}"


def test_the_readme_gives_the_true_size_of_each_diff() -> None:
    """It once said 165 where diff counted 169: the figures are read from the README and counted again."""
    text = " ".join((REPO / "README.md").read_text().split())
    transformer, mnist, _ = MOST_CHANGED_LINES
    said = f"`diff {' '.join(transformer)}` changes {changed_lines(transformer)} lines and `diff {' '.join(mnist)}` "
    assert f"{said}{changed_lines(mnist)}." in text, "README.md's figures for the two diffs"


def test_no_library_module_does_so_much_that_it_outgrows_450_lines() -> None:
    paths = [*(REPO / "common").glob("*.py"), *(REPO / "tools").rglob("*.py")]
    sizes = {str(path.relative_to(REPO)): len(path.read_text().splitlines()) for path in paths}
    assert len(sizes) > 30, "the rule must see common/ and tools/"
    assert not {name: size for name, size in sizes.items() if size > MAX_MODULE_LINES}


def test_the_run_directory_names_are_spelled_in_one_library_module() -> None:
    sources = sorted([*(REPO / "common").glob("*.py"), *(REPO / "tools").rglob("*.py"), *SCRIPTS])
    constants = {
        path: {node.value for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Constant)}
        for path in sources
    }
    for name in RUN_DIR_NAMES:
        spelled = [str(path.relative_to(REPO)) for path, values in constants.items() if name in values]
        assert spelled == ["common/run_dir.py"], f"{name!r} spelled in {spelled}"
