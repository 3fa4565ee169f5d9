"""The process tree of a world: what its ranks started (to kill with them) and what is still
running (leak checks)."""

from __future__ import annotations

import psutil

# multiprocessing's own per-process singletons (started by the first spawn/forkserver world, meant to
# live as long as the parent): not something a world left behind.
_STDLIB_HELPERS = ("from multiprocessing.resource_tracker import main", "from multiprocessing.forkserver import main")


def is_multiprocessing_helper(p: psutil.Process) -> bool:
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return False
    return any(h in cmd for h in _STDLIB_HELPERS)


def live_children() -> list[psutil.Process]:
    """This process's descendants still running, multiprocessing's own helpers excepted (leak checks)."""
    return [p for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and not is_multiprocessing_helper(p)]


def descendants(pids: list[int]) -> set[psutil.Process]:
    found: set[psutil.Process] = set()
    for pid in pids:
        try:
            found.update(psutil.Process(pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return found


def kill(procs: set[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(procs), timeout=5)
