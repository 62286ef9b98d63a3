"""The shape of tests/: test files that import only the harness, and a conftest.py of hooks and fixtures.

What two test files share lives in tests/harness/, so that a reader of one test file, or of the
harness, never has to read another test file first; conftest.py is pytest's, not a library.
"""

from __future__ import annotations

import ast

from tests.harness import record_reads, wrappers
from tests.harness.runs import REPO

TESTS = REPO / "tests"
TEST_FILES = sorted(TESTS.glob("test_*.py"))
HARNESS_FILES = sorted((TESTS / "harness").glob("*.py"))
CONFTEST_MOST_LINES = 150


def imported_modules(source: str) -> set[str]:
    """The absolute names of the modules ``source`` imports, at its top or inside a function.

    ``from tests import test_x`` counts as ``tests.test_x``: the name may be a module. A relative
    import keeps its dots (``.test_x``), which no file here should need.
    """
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            found.add(module)
            found |= {
                f"{module.rstrip('.')}.{alias.name}" if node.module else module + alias.name for alias in node.names
            }
    return found


def forbidden_imports(source: str) -> set[str]:
    """The test modules and conftest ``source`` imports: the imports no test file may have."""

    def forbidden(name: str) -> bool:
        last = name.rsplit(".", 1)[-1]
        in_tests = name.startswith(("tests.", ".")) or "." not in name
        return in_tests and (last.startswith("test_") or last == "conftest")

    return {name for name in imported_modules(source) if forbidden(name)}


def test_no_test_file_imports_another_or_conftest() -> None:
    assert len(TEST_FILES) >= 17, "the rule must see the test files"
    offenders = {path.name: sorted(found) for path in TEST_FILES if (found := forbidden_imports(path.read_text()))}
    assert not offenders, f"move what they share into tests/harness/: {offenders}"


def test_the_harness_imports_no_test_file_nor_conftest() -> None:
    assert {"runs.py", "cases.py", "launcher.py"} <= {path.name for path in HARNESS_FILES}
    offenders = {path.name: sorted(found) for path in HARNESS_FILES if (found := forbidden_imports(path.read_text()))}
    assert not offenders


def test_the_import_rule_finds_each_way_to_import_a_test_file() -> None:
    source = (
        "import tests.test_ddp\nfrom tests.test_checkpoint import assert_same_parameters\n"
        "from tests import test_fsdp, harness\nfrom tests.conftest import REPO\nfrom . import test_data\n"
        "def later():\n    from .test_memory import x\n"
        "from tests.harness.runs import run_script\nimport pytest\nfrom common.data import eval_shard\n"
    )
    assert forbidden_imports(source) == {
        "tests.test_ddp",
        "tests.test_checkpoint",
        "tests.test_fsdp",
        "tests.conftest",
        ".test_data",
        ".test_memory",
    }


def test_conftest_holds_only_hooks_and_fixtures() -> None:
    source = (TESTS / "conftest.py").read_text()
    lines = len(source.splitlines())
    assert lines <= CONFTEST_MOST_LINES, (
        f"conftest.py has {lines} lines: move what is no hook or fixture to tests/harness/"
    )
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            fixture = any("fixture" in ast.unparse(decorator) for decorator in node.decorator_list)
            assert fixture or node.name.startswith("pytest_"), f"{node.name} is neither a hook nor a fixture"


def test_every_wrapper_path_is_a_file() -> None:
    paths = {name: value for name, value in vars(wrappers).items() if name.isupper() and value.endswith(".py")}
    assert len(paths) == 7
    assert not [path for path in paths.values() if not (REPO / path).is_file()]


def test_two_launches_on_one_port_are_two_generations_of_reads() -> None:
    """A stopped run and its resume, launched one after the other, may be given the same store port; their run
    ids differ, and the reads of each must count as their own (they resume at other steps)."""
    launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "0"}
    first = record_reads.generation_of({**launch, "TORCHELASTIC_RUN_ID": "a1"}, world_size=2, pid=1)
    second = record_reads.generation_of({**launch, "TORCHELASTIC_RUN_ID": "b2"}, world_size=2, pid=1)
    assert first != second
    assert record_reads.generation_of({}, world_size=1, pid=7) != record_reads.generation_of({}, world_size=1, pid=8)
