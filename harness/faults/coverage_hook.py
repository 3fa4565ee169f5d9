"""Which lines of a mutation campaign's target modules each case runs (issue 41's selection).

A campaign's instrumented run sets CKPT_HARNESS_COVERAGE ({"dir": ..., "include": [files]}) for a
`run` of its slice. Every process that imports harness then measures the target files alone with
coverage.py (harness/__init__ calls `start_process`, before anything imports the targets): the CLI
parent, and spawned or torchrun ranks. Forked ranks restart the parent's measurement themselves
(coverage's `fork` patch) and save it when they leave through os._exit (its `_exit` patch). The
parent names each case as a coverage context when the case starts (`case`, from the runner), and
its children inherit the name; lines a module runs when it is imported are recorded under "" (every
case ran them). `lines(dir)` reads the result back: {file: {line: {case id or "", ...}}}.
Without the variable nothing here runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "CKPT_HARNESS_COVERAGE"
#: the case a process's lines belong to (set by the parent for the worlds it starts)
CONTEXT_ENV = "CKPT_HARNESS_COVERAGE_CONTEXT"
#: the context of lines run at import: every case of the run ran them
IMPORTED = ""


def start_process() -> None:
    """Measure the campaign's target files in this process (once; a forked child restarts it itself)."""
    raw = os.environ.get(ENV)
    if not raw:
        return
    import coverage

    if coverage.Coverage.current() is not None:
        return
    cfg = json.loads(raw)
    cov = coverage.Coverage(data_file=str(Path(cfg["dir"]) / ".coverage"), data_suffix=True,
                            include=list(cfg["include"]), config_file=False)
    cov.set_option("run:patch", ["fork", "_exit"])
    # sys.monitoring where this Python has it (3.12+): the same lines and contexts, a measured run 13% faster
    # (docs/measurements.md); coverage.py falls back to its C tracer by itself where it cannot
    cov.set_option("run:core", "sysmon")
    cov.set_option("run:disable_warnings", ["no-data-collected", "module-not-measured", "module-not-imported", "no-sysmon"])
    if os.environ.get(CONTEXT_ENV):
        cov.set_option("run:context", os.environ[CONTEXT_ENV])
    cov.start()
    import atexit

    atexit.register(_save, cov)


def _save(cov) -> None:
    cov.stop()
    cov.save()


def case(case_id: str) -> None:
    """The parent starts `case_id`: its lines, and those of every world it starts, are that case's."""
    if not os.environ.get(ENV):
        return
    import coverage

    cov = coverage.Coverage.current()
    if cov is None:
        return
    cov.switch_context(case_id)
    cov.set_option("run:context", case_id)  # what a forked child restarts with
    os.environ[CONTEXT_ENV] = case_id  # what a spawned or torchrun rank starts with


def lines(directory: Path) -> dict[str, dict[int, set[str]]]:
    """Every data file under `directory` merged: for each measured file, the contexts (case ids,
    or IMPORTED) that ran each of its lines. Each file is read on its own and merged here:
    coverage.py's own combine (7.17) lost the CLI parent's file among 3125 of a gate-wide clean run
    (peft's load, run in the parent, came back as its import lines only)."""
    import coverage

    out: dict[str, dict[int, set[str]]] = {}
    for f in sorted(Path(directory).glob(".coverage.*")):
        data = coverage.CoverageData(basename=str(f))
        data.read()
        for measured in data.measured_files():
            by = out.setdefault(measured, {})
            for line, contexts in data.contexts_by_lineno(measured).items():
                by.setdefault(line, set()).update(contexts)
    return out


def covering(by_line: dict[int, set[str]], first: int, last: int, cases: list[str], at_import: bool = False) -> list[str]:
    """The cases (of `cases`, in their order) that ran a line in [first, last] of a file (`by_line`: its
    lines' contexts). A span that runs at import (`at_import`) is run by every case that imported the
    module, which coverage files under the first of them only: every case that ran any line of the
    file. A line run before the first case (IMPORTED): every case."""
    ran = set().union(*(by_line.get(n, set()) for n in range(first, last + 1)))
    if at_import and ran:
        ran = set().union(*by_line.values())
    return list(cases) if IMPORTED in ran else [c for c in cases if c in ran]
