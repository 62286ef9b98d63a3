"""Run the zoo: each mistake in a fresh copy of the repository, and the test that must catch it.

    python -m tests.zoo                 # every mistake
    python -m tests.zoo NAME [NAME...]  # some of them
    python -m tests.zoo --list          # their names, files and tests
    python -m tests.zoo --markdown      # docs/classic-mistakes.md, as it must read

First every named test runs once on an unpatched copy: a test that fails there catches nothing. A
mistake is caught when its named test fails in the patched copy and the failure's output matches
the mistake's reason; a failure for another reason, or another test failing, does not count. A patch
that no longer applies is a failure of the zoo. Exit status 0 only if every mistake run was caught.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.zoo.catalogue import MISTAKES
from tests.zoo.mistake import Mistake
from tools.processes import exit_code_of, run_tree

REPO = Path(__file__).resolve().parents[2]
TEST_TIMEOUT_S = 600


def repository_files() -> list[str]:
    """What a clean clone holds, plus files not committed yet that git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return [name for name in listed.stdout.splitlines() if (REPO / name).is_file()]


def fresh_copy(destination: Path) -> None:
    for name in repository_files():
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)


@dataclass(frozen=True)
class TestRun:
    returncode: int
    output: str
    timed_out: bool


def run_tests(copy: Path, tests: list[str], *options: str) -> TestRun:
    """pytest on ``tests`` in ``copy``; every process it starts ends with it, at the timeout or a Ctrl-C too."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYTHONPATH"] = str(copy)
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *options, *tests]
    with tempfile.TemporaryFile("w+", errors="replace") as output:
        ended = run_tree(command, output, env=env, cwd=copy, timeout=TEST_TIMEOUT_S)
        output.seek(0)
        return TestRun(ended.returncode, output.read(), ended.timed_out)


def failing_without_a_mistake(tests: list[str]) -> list[str]:
    """The tests among ``tests`` that fail on an unpatched copy: they cannot tell a mistake from none."""
    with tempfile.TemporaryDirectory(prefix="zoo-control-") as folder:
        copy = Path(folder)
        fresh_copy(copy)
        result = run_tests(copy, tests, "-n", "auto")
    output = result.output
    if result.returncode not in (0, 1):  # 2-5: interrupted, an internal error, a usage error, nothing collected
        return [f"{test} (pytest exit {result.returncode})" for test in tests]
    return [test for test in tests if f"FAILED {test}" in output or f"ERROR {test}" in output]


def verdict(mistake: Mistake, result: TestRun) -> str:
    output = result.output
    if result.timed_out:
        return f"SURVIVED: {mistake.test} ran past {TEST_TIMEOUT_S} s"
    if result.returncode == 0:
        return "SURVIVED: every test passed"
    if f"FAILED {mistake.test}" not in output:
        return f"SURVIVED: {mistake.test} did not fail (exit {result.returncode}; another test or an error)"
    if not mistake.matches_reason(output):
        return f"SURVIVED: {mistake.test} failed, but not for the reason /{mistake.reason}/"
    return "caught"


def run_one(mistake: Mistake) -> tuple[str, float, str]:
    """(verdict, seconds, output tail) for one mistake in a fresh copy."""
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"zoo-{mistake.name}-") as folder:
        copy = Path(folder)
        fresh_copy(copy)
        target = copy / mistake.path
        try:
            target.write_text(mistake.apply(target.read_text()))
        except (ValueError, FileNotFoundError) as err:
            return f"ZOO FAILURE: the patch does not apply ({err})", time.monotonic() - began, ""
        result = run_tests(copy, [mistake.test])
        return verdict(mistake, result), time.monotonic() - began, result.output[-3000:]


PAGE_HEAD = """# Classic mistakes, and the test that catches each

The mistakes people make when they write or change a data-parallel training script, each as it does
its damage: quietly, with a run that trains and a loss that falls. Every one of them is in this
repository's zoo (`tests/zoo/`): a small patch to one of its files, and the test that fails when the
patch is in. `python -m tests.zoo` puts each into a fresh copy of the repository and checks that its
test catches it, for the reason named here; `python -m tests.zoo NAME` runs one.

On a copy of a script in your own project, the mistakes that change training are the ones
`python -m tools.checks.check_equivalence --nproc 2 YOUR_SCRIPT.py` finds: it trains your script at 2
processes and at 1 and says DIFFERENT when they leave the noise band
([your-own-project.md](your-own-project.md)). The others need the test named, in a clone of this
repository with your change in its script.

This page is written by `python -m tests.zoo --markdown`; `tests/test_zoo.py` checks that it is current.
"""


def docs_page(mistakes: list[Mistake]) -> str:
    """The users' page: each mistake in two lines (its harm, how one notices), its test and the command."""
    sections = [PAGE_HEAD]
    for mistake in mistakes:
        marker = f"<!-- test: {mistake.test.split('[')[0]} -->"  # the test backs what the lines say
        sections.append(
            f"\n## {mistake.name}\n\n"
            f"In `{mistake.path}`. What it does: {mistake.harm}. {marker}\n"
            f"How you would notice: {mistake.notice}. {marker}\n\n"
            f"Caught by `{mistake.test}`:\n\n"
            f'```bash\npython -m pytest "{mistake.test}"   # fails with the mistake in\n'
            f"python -m tests.zoo {mistake.name}   # puts it in a fresh copy and checks the catch\n```\n"
        )
    return "".join(sections)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.zoo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("names", nargs="*", help="mistakes to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mistakes and exit")
    parser.add_argument("--markdown", action="store_true", help="print the docs page of the mistakes and exit")
    parser.add_argument(
        "--verbose", action="store_true", help="show the output of each test that did not catch its mistake"
    )
    args = parser.parse_args(argv)
    known = {mistake.name for mistake in MISTAKES}
    unknown = [name for name in args.names if name not in known]
    if unknown:
        parser.error(f"no such mistake: {', '.join(unknown)} (python -m tests.zoo --list names them)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = [mistake for mistake in MISTAKES if not args.names or mistake.name in args.names]
    if args.markdown:
        print(docs_page(chosen), end="")
        return 0
    if args.list:
        for mistake in chosen:
            print(f"{mistake.name:34} {mistake.path:34} {mistake.test}")
        return 0
    began = time.monotonic()
    control = failing_without_a_mistake(sorted({mistake.test for mistake in chosen}))
    print(f"control: {len(control)} of the named tests fail without any mistake {control or ''}", flush=True)
    caught = 0
    print("| mistake | file | caught by | verdict | seconds |\n| --- | --- | --- | --- | --- |", flush=True)
    for mistake in chosen:
        if mistake.test in control:
            result, seconds, output = "ZOO FAILURE: its test fails without the mistake", 0.0, ""
        else:
            result, seconds, output = run_one(mistake)
        caught += result == "caught"
        print(f"| {mistake.name} | `{mistake.path}` | `{mistake.test}` | {result} | {seconds:.0f} |", flush=True)
        if result != "caught" and args.verbose:
            print(output, flush=True)
    print(f"\n{caught} of {len(chosen)} caught in {time.monotonic() - began:.0f} s", flush=True)
    return 0 if caught == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(exit_code_of(main, "python -m tests.zoo"))
