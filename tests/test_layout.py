"""The shape of common/: a library that the training scripts import, and commands that use it.

A command is a module run with ``python -m common.NAME`` (it has a ``__main__`` block). The library
never imports one, so a copied script's imports never pass through a command's flags and tables.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.harness.runs import REPO

SCRIPTS = sorted([*REPO.glob("ddp/*.py"), *REPO.glob("fsdp/*.py")])


def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def is_command(module: ast.Module) -> bool:
    return any(
        isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and "__name__" in ast.unparse(node.test)
        for node in module.body
    )


def common_imports(module: ast.Module) -> set[str]:
    """The common/ modules a module imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(module):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("common."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("common.")}
    return found


MODULES = {path.stem: parsed(path) for path in sorted((REPO / "common").glob("*.py")) if path.stem != "__init__"}
COMMANDS = {name for name, module in MODULES.items() if is_command(module)}


def reached_from(names: set[str]) -> set[str]:
    """Every common/ module ``names`` import, directly or through others."""
    reached, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += common_imports(MODULES[name])
    return reached


def test_the_library_never_imports_a_command() -> None:
    assert {"estimate_memory", "preflight", "check_equivalence"} <= COMMANDS, "the rule must see the commands"
    offenders = {
        name: sorted(common_imports(module) & COMMANDS) for name, module in MODULES.items() if name not in COMMANDS
    }
    assert not {name: found for name, found in offenders.items() if found}


def test_a_training_script_reaches_no_command() -> None:
    assert len(SCRIPTS) == 5
    for script in SCRIPTS:
        reached = reached_from(common_imports(parsed(script)))
        assert {"distributed", "communication"} <= reached, script
        assert not reached & COMMANDS, f"{script.relative_to(REPO)} reaches {sorted(reached & COMMANDS)}"


def test_every_command_is_on_the_front_page() -> None:
    listed = set(re.findall(r"python -m common\.(\w+)", (REPO / "README.md").read_text()))
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
    modules = {**{f"common/{name}.py": module for name, module in MODULES.items()}, **{
        str(script.relative_to(REPO)): parsed(script) for script in SCRIPTS
    }}  # fmt: skip
    assert "transformers" in imported_packages(parsed(REPO / "examples" / "hf_model.py")), "the rule must see it"
    assert not [path for path, module in modules.items() if "transformers" in imported_packages(module)]
