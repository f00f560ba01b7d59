"""Shared fixtures and the test split.

Markers: `cluster` tests start real ranks (mlx.launch, launch.sh, api.py); everything else
is a fast unit test. `./test.sh -m "not cluster"` runs the unit tests alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiny_models import write_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama (2 layers, 4 query / 2 KV heads) in MLX format; read-only."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "model")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
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
