"""Repository-wide test settings. The matrix plugin itself is harness.pytest_plugin (an entry point)."""

import psutil
import pytest


@pytest.fixture(autouse=True)
def _no_process_left_behind():
    """Every harness test must leave no child process behind (worlds, managers, grandchildren)."""
    yield
    left = [p for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes left behind: {[(p.pid, p.name()) for p in left]}"
