"""Where rank and case output goes, so that the console shows progress and the summary only.

Libraries print on every build, save and load: banners, progress bars, megatron's logs, gloo's and
NCCL's C-level lines, and warnings (peft warns about unmatched rank_pattern/alpha_pattern keys for
every MoE adapter it builds or loads, in the ranks and in the parent that judges the adapter).
Between `ckpt-harness run`'s progress lines they drown the results. So every rank's file
descriptors 1 and 2 go to a file (C-level output included), and, while it runs a case, so do the
parent's (a forked worker's under `--jobs`). A case's files sit in one directory,
`<root>/<case id>/`: `<phase>-rank<N>.log` per world phase and rank, `parent.log`, and
`<phase>-torchrun.log` under the torchrun launcher; the result names the non-empty ones.

CKPT_HARNESS_VERBOSE=1 (`ckpt-harness run -v`) redirects nothing: everything reaches the terminal.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

#: "1": rank and case output stays on the terminal (also read by harness.compat's noise filters)
VERBOSE_ENV = "CKPT_HARNESS_VERBOSE"
PARENT_LOG = "parent.log"


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def safe_name(text: str) -> str:
    """A file name for a case id or phase: alphanumerics and -_. kept, anything else `_`."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


@dataclass(frozen=True)
class LogFiles:
    """Where one world's output goes: `dir/<stem>-rank<N>.log` (`dir/rank<N>.log` without a stem).
    `kept`: a good world's files stay (a case's log directory); else they are removed with it (a
    world's scratch directory, where only a failure report quotes them)."""

    dir: str
    stem: str = ""
    kept: bool = False

    def rank(self, rank: int) -> Path:
        return Path(self.dir) / f"{self.stem + '-' if self.stem else ''}rank{rank}.log"

    def launcher(self) -> Path:
        return Path(self.dir) / f"{self.stem or 'world'}-torchrun.log"


def redirect_rank(path: Path) -> None:
    """In a rank, for good: fds 1 and 2 to `path` (appended; unless verbose), and fresh
    sys.stdout/sys.stderr on them either way (a forked child inherits the parent's stream objects,
    and a lock some parent thread held at fork time would block the child's first write). Warnings
    and logging write to those streams, C code to the fds. SIGUSR1 dumps every thread's stack
    there, which is how the parent shows where a hung rank sits."""
    import faulthandler

    if not verbose():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


@contextmanager
def captured(path: Path | None) -> Iterator[None]:
    """While it runs, this process's output goes to `path` (appended): fds 1 and 2 (what C code and
    the ranks started meanwhile inherit) and sys.stdout/sys.stderr (Python prints and warnings, also
    where a test framework replaced them). `path` None: nothing is redirected."""
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        _flush(stream)
    saved = os.dup(1), os.dup(2)
    try:
        with open(path, "a", buffering=1, encoding="utf-8", errors="replace") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                with redirect_stdout(log), redirect_stderr(log):
                    yield
            finally:
                for stream in (sys.__stdout__, sys.__stderr__):
                    _flush(stream)  # what was buffered meanwhile belongs to the log
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        os.close(saved[0])
        os.close(saved[1])


def _flush(stream) -> None:
    try:
        if stream is not None:
            stream.flush()
    except (OSError, ValueError):  # a closed or broken stream has nothing to give
        pass


def fatal_head(text: str, lines: int = 25) -> str:
    """Where a rank that died by a signal crashed: the "Fatal Python error" line and the crashing
    thread's frames as faulthandler writes them (most recent call first). They lead the dump, so the
    log's tail (the other threads, the bottom of the stack, the extension modules) leaves them out;
    "" when the text has no such error."""
    rows = text.splitlines()
    start = next((i for i, row in enumerate(rows) if row.startswith("Fatal Python error:")), None)
    if start is None:
        return ""
    head = [rows[start]]
    current = next((i for i in range(start + 1, len(rows)) if rows[i].startswith("Current thread ")), None)
    if current is not None:
        block = rows[current:]
        end = next((i for i, row in enumerate(block) if i and not row.startswith("  ")), len(block))
        head += block[:min(end, lines)]
    return "\n".join(head)


def tail(logs: LogFiles, ranks: list[int] | range, lines: int = 15) -> str:
    """The last `lines` lines of each rank's log, for a failure report (with where the whole file is
    when it is kept); a crash's fatal error and crashing thread (`fatal_head`) come first."""
    out = []
    for r in ranks:
        path = logs.rank(r)
        text = path.read_text(errors="replace").strip() if path.exists() else ""
        if text:
            where = f", all of it in {path}" if logs.kept else ""
            fatal = fatal_head(text)
            if fatal:
                out.append(f"\n--- rank {r} crashed ---\n{fatal}")
            out.append(f"\n--- rank {r} output (last {lines} lines{where}) ---\n" + "\n".join(text.splitlines()[-lines:]))
    return "".join(out)


@contextmanager
def case_logs(root: Path | None, case_id: str, names: list[str]) -> Iterator[Path | None]:
    """The log directory of one case under `root` (emptied first: a rerun into the same report
    does not append to the last run's files), with this process's output captured into its
    parent.log while the body runs; afterwards the non-empty files' paths are appended to `names`
    and empty files removed. `root` None or verbose: yields None and redirects nothing."""
    if root is None or verbose():
        yield None
        return
    directory = Path(root).absolute() / safe_name(case_id)
    shutil.rmtree(directory, ignore_errors=True)  # our own logs/<case> directory, nothing else
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with captured(directory / PARENT_LOG):
            yield directory
    finally:
        for path in sorted(directory.iterdir()):
            if path.is_file() and path.stat().st_size == 0:
                path.unlink()
            elif path.is_file():
                names.append(str(path))
        if not any(directory.iterdir()):
            directory.rmdir()


def run_root(report: Path | None, workdir: Path | None) -> tuple[Path | None, bool]:
    """(where a run's case logs go, whether that is a temporary directory): `report/logs`, else a
    fresh `ckpt-harness-logs-*` directory under `workdir` (the system temp dir when None), the
    harness's own; (None, False) when verbose."""
    if verbose():
        return None, False
    if report is not None:
        return Path(report) / "logs", False
    import tempfile

    if workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="ckpt-harness-logs-", dir=workdir)), True


def finish_run(root: Path | None, temporary: bool, keep: bool) -> Path | None:
    """After a run: the log root worth naming, or None. A temporary root is removed unless `keep`
    (a case failed, or --keep); an empty one is removed either way."""
    if root is None or not root.exists():
        return None
    if any(root.iterdir()) and (keep or not temporary):
        return root
    if temporary:
        shutil.rmtree(root, ignore_errors=True)  # our own mkdtemp
    else:
        root.rmdir()  # an empty report/logs
    return None
