"""pytest's hooks and the session's shared fixtures; how tests run scripts is in tests/harness/ (tests/README.md).

- ``pytest_xdist_make_scheduler``: all of test_slurm.py on one xdist worker, for its one cluster;
- ``pytest_collection_modifyitems``: the longest tests first, so that the workers finish together;
- fixtures made once a session: the rendered-digit MNIST data sets, and the noise-floor runs that
  the equivalence tests judge a run against.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.harness.mnist_fixture import write_fake_mnist
from tests.harness.noise_floor import NoiseRuns, shared_noise_runs


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``-n``, all of test_slurm.py runs on one worker: its tests share one Slurm cluster.

    Every other test is a unit of its own, as under xdist's default. (xdist's own ``xdist_group``
    mark does nothing with pytest 9: the group is added to a node id that pytest no longer reads.)
    """
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SlurmTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "slurm" if nodeid.startswith("tests/test_slurm.py::") else nodeid

    return SlurmTestsTogether(config, log)


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small rendered-digit MNIST: 3000 training images, 1999 test images.

    1999 is prime, so no world size above one divides the test set evenly.
    """
    return write_fake_mnist(tmp_path_factory.mktemp("mnist"), train_count=3000, test_count=1999)


@pytest.fixture(scope="session")
def tiny_mnist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """640 training and 200 test images: an epoch of 20 steps at a global batch of 32, for runs that need
    several epochs but not a good model."""
    return write_fake_mnist(tmp_path_factory.mktemp("tiny_mnist"), train_count=640, test_count=200)


@pytest.fixture(scope="session")
def transformer_noise(tmp_path_factory: pytest.TempPathFactory) -> NoiseRuns:
    return shared_noise_runs(tmp_path_factory, "transformer")


@pytest.fixture(scope="session")
def variable_length_noise(tmp_path_factory: pytest.TempPathFactory) -> NoiseRuns:
    return shared_noise_runs(tmp_path_factory, "variable-length")


@pytest.fixture(scope="session")
def mnist_noise(tmp_path_factory: pytest.TempPathFactory, tiny_mnist_dir: Path) -> NoiseRuns:
    # Each xdist worker writes its own copy of the fixture: the same files, from the same seed.
    return shared_noise_runs(tmp_path_factory, "mnist", ("--data-dir", str(tiny_mnist_dir)))


# The order in which pytest-xdist hands tests to its workers is the collection order. The
# longest tests go first, so that both workers stay busy to the end instead of one of them
# finishing a long test alone. Measured with `pytest -n auto --durations=0`; earlier wins.
LONGEST_FIRST = (
    "tests/test_start_from_a_copy.py",
    "tests/test_slurm.py",
    "tests/test_equivalence.py::test_check_equivalence_says_same",
    "tests/test_checkpoint.py",
    "tests/test_tensor_parallel.py::test_2x2",
    "tests/test_failures.py",
    "tests/test_hangs.py",
    "tests/test_async_checkpoint.py::test_fsdp",
    "tests/test_ddp.py",
    "tests/test_commands_end.py::test_a_command_stopped_mid_run_leaves_nothing",
    "tests/test_bad_input.py::test_bad_flag_is_reported_once_under_torchrun",
    "tests/test_untrusted_checkpoint.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def position(item: pytest.Item) -> int:
        prefixes = [index for index, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)]
        return prefixes[0] if prefixes else len(LONGEST_FIRST)

    items.sort(key=position)  # stable: the rest keep their order
