"""Repository-wide test settings. The matrix plugin itself is harness.pytest_plugin (an entry point)."""

import pytest

from harness.world import live_children


@pytest.fixture(autouse=True)
def _no_process_left_behind():
    """Every harness test must leave no child process behind (worlds, managers, grandchildren);
    multiprocessing's resource tracker and forkserver are the stdlib's, meant to stay."""
    yield
    left = live_children()
    assert not left, f"processes left behind: {[(p.pid, p.name()) for p in left]}"
