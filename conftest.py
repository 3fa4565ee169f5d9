"""Repository-wide test settings. The matrix plugin itself is harness.pytest_plugin (an entry point)."""

import psutil
import pytest

# multiprocessing's own per-process singletons, started by spawn/forkserver worlds and meant to
# live as long as the parent: not something a world left behind.
_STDLIB_HELPERS = ("from multiprocessing.resource_tracker import main", "from multiprocessing.forkserver import main")


def _is_stdlib_helper(p: psutil.Process) -> bool:
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return False
    return any(h in cmd for h in _STDLIB_HELPERS)


@pytest.fixture(autouse=True)
def _no_process_left_behind():
    """Every harness test must leave no child process behind (worlds, managers, grandchildren)."""
    yield
    left = [
        p for p in psutil.Process().children(recursive=True)
        if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and not _is_stdlib_helper(p)
    ]
    assert not left, f"processes left behind: {[(p.pid, p.name()) for p in left]}"
