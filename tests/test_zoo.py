"""The zoo of mistakes stays runnable: each patch applies to today's code, each names a test that exists,
and the users' page says what the catalogue holds. (Running the zoo itself is ``python -m tests.zoo``,
its own CI job: it takes minutes, not the suite's seconds.)"""

from __future__ import annotations

import ast

from tests.harness.runs import REPO
from tests.zoo.__main__ import docs_page
from tests.zoo.catalogue import MISTAKES

PAGE = REPO / "docs" / "classic-mistakes.md"


def test_every_mistake_has_a_name_of_its_own() -> None:
    names = [mistake.name for mistake in MISTAKES]
    assert len(names) == len(set(names)), sorted(name for name in names if names.count(name) > 1)


def test_every_patch_applies_once_to_todays_code() -> None:
    """A patch whose text moved is a failure of the zoo, found here in seconds, not in the zoo's run."""
    refused = []
    for mistake in MISTAKES:
        try:
            changed = mistake.apply((REPO / mistake.path).read_text())
        except (ValueError, FileNotFoundError) as err:
            refused.append(str(err))
            continue
        if mistake.path.endswith(".py"):
            ast.parse(changed, filename=f"{mistake.name}: {mistake.path}")  # a mistake, not a syntax error
    assert not refused, "\n".join(refused)


def test_every_mistake_names_a_test_that_exists() -> None:
    missing = []
    for mistake in MISTAKES:
        file, _, name = mistake.test.partition("::")
        path = REPO / file
        function = name.split("[")[0].split("::")[-1]
        tree = ast.parse(path.read_text()) if path.is_file() else ast.Module(body=[], type_ignores=[])
        defined = any(isinstance(item, ast.FunctionDef) and item.name == function for item in ast.walk(tree))
        if not defined:
            missing.append(f"{mistake.name}: {mistake.test}")
    assert not missing, missing


def test_the_users_page_lists_the_catalogue_as_it_is() -> None:
    assert PAGE.read_text() == docs_page(MISTAKES), "python -m tests.zoo --markdown > docs/classic-mistakes.md"
