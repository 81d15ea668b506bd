"""Shared fixtures: the tiny test model and the built llama.cpp binaries.

The binaries are built by the test command before pytest runs (``just test`` / README). A test that needs
them fails with the command to run rather than skipping, so a broken build can never look like a pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from meshllm.errors import BuildError
from meshllm.llama.build import Binaries, find_binaries
from meshllm.llama.processes import Child
from meshllm.models.tiny import tiny_model_path


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return tiny_model_path()


def _bins(stock: bool) -> Binaries:
    try:
        return find_binaries(stock=stock)
    except BuildError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def patched_bins() -> Binaries:
    return _bins(stock=False)


@pytest.fixture(scope="session")
def stock_bins() -> Binaries:
    return _bins(stock=True)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    """Append every Child a test starts; all are stopped (by process group) when the test ends."""
    started: list[Child] = []
    yield started
    for c in reversed(started):
        c.stop()
