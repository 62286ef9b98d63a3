"""CPU-seconds per test: each pytest worker, and every process it starts, in a cgroup of its own.

    python -m pytest -n auto -p tests.harness.cpu_per_test

The suite is CPU-bound on two cores, so a test's cost is the CPU that it and everything it started
used: its ranks, torchrun, a Slurm job's processes. Wall time hides that (a test waiting on Slurm's
clock costs little; four ranks on two cores cost double), and ``os.times()`` misses processes that a
fork server or slurmd reaps. A cgroup counts them all: a process stays in its parent's group whoever
reaps it. Each worker moves itself into a new group of the cgroup v1 ``cpuacct`` controller, reads
the group's usage before and after each test, and the run ends with the most expensive tests and the
total. Needs root and a mounted cpuacct hierarchy; where either is missing it says so and counts
nothing. Opt-in: the suite itself never loads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
SHOWN = 25
_group: Path | None = None


def records_dir(config: pytest.Config) -> Path:
    """Shared by the controller and its workers: the workers write, the controller sums."""
    folder = Path(config.rootpath) / ".pytest_cache" / "cpu_per_test"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def join_new_group() -> Path | None:
    group = CPUACCT / f"pytest-{os.getpid()}"
    try:
        group.mkdir()
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return None
    return group


def usage_s(group: Path) -> float:
    return int((group / "cpuacct.usage").read_text()) / 1e9


def pytest_configure(config: pytest.Config) -> None:
    global _group
    if not hasattr(config, "workerinput"):  # the controller, or a run without -n
        folder = records_dir(config)
        for old in folder.glob("*.jsonl"):
            old.unlink()
    _group = join_new_group()
    if _group is None and not hasattr(config, "workerinput"):
        print(f"cpu_per_test: no cgroup could be made under {CPUACCT} (it needs root and cgroup v1's cpuacct)")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Back to the parent group, and this one removed if nothing is left in it."""
    if _group is not None:
        with contextlib.suppress(OSError):
            (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
            _group.rmdir()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if _group is None:
        yield
        return
    before, began = usage_s(_group), time.monotonic()
    yield
    record = {"test": item.nodeid, "cpu_s": usage_s(_group) - before, "wall_s": time.monotonic() - began}
    with (records_dir(item.config) / f"{os.getpid()}.jsonl").open("a") as file:
        file.write(json.dumps(record) + "\n")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return
    records = [json.loads(line) for path in records_dir(config).glob("*.jsonl") for line in path.open()]
    if not records:
        return
    terminalreporter.section("CPU-seconds per test (each test and every process it started)")
    for record in sorted(records, key=lambda r: -r["cpu_s"])[:SHOWN]:
        terminalreporter.write_line(f"{record['cpu_s']:7.1f} CPU-s {record['wall_s']:7.1f} s  {record['test']}")
    total = sum(record["cpu_s"] for record in records)
    terminalreporter.write_line(f"{total:7.1f} CPU-s in {len(records)} tests")
