"""pytest plugin: every case of matrices/*.yaml is a test item, marked `reshard`.

    pytest -m reshard                 # every matrix case
    pytest -m "reshard and smoke" -n 2
    pytest matrices/smoke.yaml -k "tp2pp1dp1cp1->tp1pp2"

xdist-safe: each item runs its own worlds with their own scratch dir; rendezvous goes through a
FileStore in that dir, so two workers never race for a port. A session shares one source store
(harness.run.reuse: a source world several items share runs once) across its xdist workers: the
controller makes it and names it in CKPT_HARNESS_SOURCES, which the workers it starts inherit,
and removes it when the session ends; `--ckpt-no-reuse` turns it off.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from harness.core.result import CaseResult
from harness.core.spec import MARKERS, CaseSpec
from harness.orchestration import tiers
from harness.orchestration.matrix import MatrixError, load_matrix


class CaseFailure(Exception):
    def __init__(self, result: CaseResult):
        super().__init__(result.failure_text())
        self.result = result


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ckpt-harness")
    group.addoption("--ckpt-dist-backend", default="auto", choices=("auto", "gloo", "nccl"))
    group.addoption("--ckpt-workdir", default=None, help="parent of per-case scratch dirs")
    group.addoption("--ckpt-keep", action="store_true", help="keep checkpoints of each case")
    group.addoption("--ckpt-report", default=None, help="write case results as JSON lines to DIR")
    group.addoption("--ckpt-start-method", default="auto", choices=("auto", "fork", "spawn", "forkserver"),
                    help="how ranks start (auto: fork for gloo, spawn for NCCL)")
    group.addoption("--ckpt-max-world", type=int, default=None, metavar="N",
                    help="cut every matrix topology above N ranks to fit (harness/core/cut.py): ckpt-harness run --max-world")
    group.addoption("--ckpt-rank-hook", action="append", default=[], metavar="MODULE:FUNCTION",
                    help="run this function in every rank before the case (repeatable)")
    group.addoption("--ckpt-no-reuse", action="store_true",
                    help="every item runs its own source worlds (no save once, load many: harness/run/reuse.py)")


_SOURCES_ENV = "CKPT_HARNESS_SOURCES"


def pytest_configure(config: pytest.Config) -> None:
    for name, help_text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {help_text}")
    if hasattr(config, "workerinput"):  # an xdist worker: its share of the cores for in-process judging (as run --jobs)
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(config.workerinput.get("workercount", 1))))
    if not hasattr(config, "workerinput") and not config.getoption("--ckpt-no-reuse"):  # the controller (or a plain session)
        parent = config.getoption("--ckpt-workdir")
        if parent:
            Path(parent).mkdir(parents=True, exist_ok=True)
        config._ckpt_sources = tempfile.mkdtemp(prefix="ckpt-harness-sources-", dir=parent)
        config._ckpt_sources_env = os.environ.get(_SOURCES_ENV)
        os.environ[_SOURCES_ENV] = config._ckpt_sources  # for the xdist workers this session starts


def pytest_unconfigure(config: pytest.Config) -> None:
    sources = getattr(config, "_ckpt_sources", None)
    if sources is None:
        return
    if config._ckpt_sources_env is None:
        os.environ.pop(_SOURCES_ENV, None)
    else:
        os.environ[_SOURCES_ENV] = config._ckpt_sources_env
    if not config.getoption("--ckpt-keep"):
        shutil.rmtree(sources, ignore_errors=True)  # our own mkdtemp


def _sources(config: pytest.Config) -> Path | None:
    """This session's source store: the controller's (a worker reads it from the environment)."""
    if config.getoption("--ckpt-no-reuse"):
        return None
    own = getattr(config, "_ckpt_sources", None)
    found = own or os.environ.get(_SOURCES_ENV)
    return Path(found) if found else None


def pytest_collect_file(parent: pytest.Collector, file_path: Path):
    if file_path.suffix in (".yaml", ".yml") and file_path.parent.name == "matrices" and file_path.name != tiers.FILE:
        return MatrixFile.from_parent(parent, path=file_path)
    return None


class MatrixFile(pytest.File):
    def collect(self):
        try:
            matrix = load_matrix(self.path, self.config.getoption("--ckpt-max-world"))
            tiered = tiers.load(self.path.parent)
        except (MatrixError, tiers.TiersError) as exc:
            raise self.CollectError(str(exc)) from None
        for spec in matrix.own():  # an included file's cases are collected from that file
            item = CaseItem.from_parent(self, name=spec.id, spec=spec)
            # matrices/tiers.yaml: the main job's files, and the rest of each block in the slow tier
            for marker in ("reshard", *spec.markers, *tiered.markers(spec, self.path.name)):
                item.add_marker(marker)
            yield item


class CaseItem(pytest.Item):
    def __init__(self, *, spec: CaseSpec, **kwargs):
        super().__init__(**kwargs)
        self.spec = spec

    def runtest(self) -> None:
        from harness.orchestration.runner import RunOptions, run_case

        cfg = self.config
        report_dir = cfg.getoption("--ckpt-report")
        options = RunOptions(
            dist_backend=cfg.getoption("--ckpt-dist-backend"),
            workdir=cfg.getoption("--ckpt-workdir"),
            keep=cfg.getoption("--ckpt-keep"),
            start_method=cfg.getoption("--ckpt-start-method"),
            rank_hooks=tuple(cfg.getoption("--ckpt-rank-hook")),
            reuse=_sources(cfg) is not None, sources=_sources(cfg),
            # with a report, each case's rank and parent output is kept in DIR/logs/<case>/ (named in a
            # failure); without, pytest captures the parent's and a failing world quotes its ranks'
            log_dir=Path(report_dir) / "logs" if report_dir else None,
        )
        result = run_case(self.spec, options)
        self.user_properties.append(("ckpt_status", result.status))
        if report_dir:
            worker = getattr(cfg, "workerinput", {}).get("workerid", "main")
            Path(report_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(report_dir) / f"results-{worker}.jsonl", "a") as f:
                f.write(json.dumps(result.to_dict(), default=str) + "\n")
        if result.status == "not-run":
            pytest.skip(f"not run: {result.not_run_reason}")
        if result.status == "not-applicable":
            pytest.skip(f"not applicable: {result.not_applicable_reason}")
        if result.status == "xfailed":
            pytest.xfail(f"{result.xfail_reason}")
        if result.status != "passed":
            raise CaseFailure(result)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, CaseFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return self.path, None, self.spec.id
