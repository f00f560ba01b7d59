"""Shared fixtures and the test split.

Markers: `cluster` tests start real ranks (mlx.launch, launch.sh, api.py); everything else
is a fast unit test. `./test.sh -m "not cluster"` runs the unit tests alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.host import describe
from tests.support.tiny_models import write_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama (2 layers, 4 query / 2 KV heads) in MLX format; read-only."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "model")


def pytest_report_header() -> str:
    return describe()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A `host_dependent` test's reason travels with its report (also from xdist workers)."""
    marker = item.get_closest_marker("host_dependent")
    if marker is not None:
        item.user_properties.append(("host_dependent", marker.args[0]))


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """The tests run here whose outcome depends on the host, each with its reason and
    outcome, beside the host they ran on."""
    seen: dict[str, str] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for name, reason in getattr(report, "user_properties", []):
                if name == "host_dependent" and report.when in ("call", "setup"):
                    seen[report.nodeid] = f"{report.outcome}: {reason}"
    if seen:
        terminalreporter.section("host-dependent tests")
        terminalreporter.write_line(describe())
        for nodeid, line in sorted(seen.items()):
            terminalreporter.write_line(f"{nodeid} {line}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    _cluster_marks(items)


def _cluster_marks(items: list[pytest.Item]) -> None:
    """A test module that can start ranks (it holds a cluster starter: a local Cluster, an
    mlx.launch Job, or launch.sh's Project) must mark its tests `cluster`, or
    `-m "not cluster"` would start ranks."""
    for item in items:
        module = getattr(item, "module", None)
        starts_ranks = any(hasattr(module, name) for name in ("Cluster", "Job", "Project"))
        if starts_ranks and item.get_closest_marker("cluster") is None:
            raise pytest.UsageError(f"{item.nodeid} can start ranks but is not marked `cluster`")


@pytest.fixture(scope="session")
def endless_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama (4 layers: pipeline parallel over 3 ranks works) whose greedy
    answers always run to max_tokens; read-only."""
    directory = tmp_path_factory.mktemp("endless-llama") / "model"
    return write_tiny_model(directory, num_hidden_layers=4, never_stops=True)
