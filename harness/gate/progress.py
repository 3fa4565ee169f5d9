"""Where a gate is: one line per phase and per finished case on stderr (the verdict alone goes to
stdout), and on a TTY a live bar per side (rich) above which those lines scroll.

The case lines come from the side's own `run` output (`[i/n] STATUS id  12.3s`, harness.cli),
read as the subprocess writes it (`follow`), so a side run in a thread beside the other is
reported as it goes. The gate's process forks no ranks, so the bar's refresh thread is safe here.
"""

from __future__ import annotations

import re
import sys
import threading
from typing import Any

#: a case line of `ckpt-harness run` (harness.cli._run's progress)
CASE_LINE = re.compile(r"^\[(\d+)/(\d+)\]\s+([A-Z-]+)\s+(\S+)\s+([\d.]+)s")

_lock = threading.Lock()
_bar: Any = None  # rich.progress.Progress while a side runs on a TTY
_tasks: dict[str, Any] = {}


def say(text: str) -> None:
    """One progress line on stderr (above the live bar when there is one)."""
    with _lock:
        if _bar is not None:
            _bar.console.print(f"gate: {text}", highlight=False, markup=False)
        else:
            print(f"gate: {text}", file=sys.stderr, flush=True)


def live() -> bool:
    return sys.stderr.isatty()


def start(side: str, total: int | None) -> None:
    """A bar for `side` (TTY only; elsewhere the per-case lines are the progress)."""
    global _bar
    if not live():
        return
    with _lock:
        if _bar is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            _bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=Console(stderr=True), transient=True)
            _bar.start()
        _tasks[side] = _bar.add_task(side, total=total)


def finish(side: str) -> None:
    global _bar
    with _lock:
        if _bar is None:
            return
        task = _tasks.pop(side, None)
        if task is not None:
            _bar.remove_task(task)
        if not _tasks:
            _bar.stop()
            _bar = None


def case_line(side: str, line: str) -> bool:
    """Report one line of a side's run output when it is a finished case; True when it was."""
    m = CASE_LINE.match(line.strip())
    if not m:
        return False
    i, n, status, case, secs = m.groups()
    say(f"{side} [{i}/{n}] {status:8} {case}  {float(secs):.1f}s")
    with _lock:
        if _bar is not None and side in _tasks:
            _bar.update(_tasks[side], completed=int(i), total=int(n))
    return True
