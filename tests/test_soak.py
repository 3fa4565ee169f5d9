"""Soak: the smoke matrix run again and again in one parent leaves nothing behind.

A harness that leaks a process, a file descriptor, a shared-memory segment or a scratch dir per
case runs fine once and takes a nightly runner down after a week. Slow tier. Environment knobs:
CKPT_HARNESS_SOAK_RUNS (default 3), CKPT_HARNESS_SOAK_K (a `-k` selection, default: every case).
The first run warms imports and caches; the later runs must not grow anything.
"""

import gc
import os
import tempfile
from pathlib import Path

import psutil
import pytest

from harness.core.memory import MiB
from harness.orchestration.matrix import load_matrix
from harness.orchestration.runner import RunOptions, run_cases

ROOT = Path(__file__).resolve().parents[1]
RSS_SLACK_MIB = 64  # allocator and import-cache noise between identical runs; a per-case leak of the
# state a case holds (~1-10 MiB each, 91 cases) exceeds it in one run
FD_SLACK = 8


def _harness_tmp() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(("ckpt-harness", "pymp-"))}


def _shm() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir()} if shm.is_dir() else set()


def _snapshot() -> dict:
    gc.collect()
    me = psutil.Process()
    return {
        "children": [c for c in me.children(recursive=True) if c.is_running() and c.status() != psutil.STATUS_ZOMBIE],
        "fds": me.num_fds(),
        "rss_mib": me.memory_info().rss / MiB,
        "tmp": _harness_tmp(),
        "shm": _shm(),
    }


@pytest.mark.slow
def test_repeated_smoke_runs_leave_nothing_behind(tmp_path):
    runs = int(os.environ.get("CKPT_HARNESS_SOAK_RUNS", "3"))
    specs = load_matrix(ROOT / "matrices" / "smoke.yaml").select(os.environ.get("CKPT_HARNESS_SOAK_K"))
    assert specs, "the -k selection matches no case"
    workdir = tmp_path / "scratch"
    options = RunOptions(workdir=workdir)
    before = _snapshot()
    seen = []
    for i in range(runs):
        results = run_cases(specs, options)
        assert all(r.status in ("passed", "xfailed") for r in results), [r.failure_text() for r in results if r.status not in ("passed", "xfailed")]
        assert list(workdir.iterdir()) == [], f"run {i}: scratch dirs left: {sorted(p.name for p in workdir.iterdir())}"
        seen.append(_snapshot())
        now = seen[-1]
        assert now["children"] == [], f"run {i}: processes left: {[(p.pid, p.name()) for p in now['children']]}"
        assert now["tmp"] <= before["tmp"], f"run {i}: temp entries left: {sorted(now['tmp'] - before['tmp'])}"
        assert now["shm"] <= before["shm"], f"run {i}: shared memory left: {sorted(now['shm'] - before['shm'])}"
    first, last = seen[0], seen[-1]
    assert last["fds"] - first["fds"] <= FD_SLACK, f"open fds grew {first['fds']} -> {last['fds']} over {runs - 1} more runs"
    growth = last["rss_mib"] - first["rss_mib"]
    print(f"soak: {runs} runs x {len(specs)} cases; parent RSS {[round(s['rss_mib']) for s in seen]} MiB, fds {[s['fds'] for s in seen]}")
    assert growth <= RSS_SLACK_MIB, f"parent RSS grew {growth:.0f} MiB over {runs - 1} runs after the first: {[round(s['rss_mib']) for s in seen]}"


def _tagged(tag: str) -> list[psutil.Process]:
    """Processes still alive that carry the run's tag in their environment (orphans included)."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("CKPT_HARNESS_SOAK_TAG") == tag:
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.mark.slow
def test_repeated_smoke_runs_under_xdist_leave_nothing_behind(tmp_path):
    """The same under `pytest -n 2` (what CI runs): each run is a pytest with two xdist workers; after
    each, no process it started survives anywhere (found by an environment tag, orphans included),
    and no temp entry or shared-memory segment is left. (The parent's RSS and fds across runs are
    the in-process test above: an xdist run's parent ends with it.)"""
    import subprocess
    import sys
    import uuid

    runs = int(os.environ.get("CKPT_HARNESS_SOAK_RUNS", "3"))
    k = os.environ.get("CKPT_HARNESS_SOAK_K")
    before_tmp, before_shm = _harness_tmp(), _shm()
    for i in range(runs):
        tag = uuid.uuid4().hex
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "2", "matrices/smoke.yaml",
               "--ckpt-workdir", str(tmp_path / f"scratch{i}"), *(["-k", k] if k else [])]
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "CKPT_HARNESS_SOAK_TAG": tag}, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-3000:]
        left = _tagged(tag)
        assert left == [], f"run {i}: processes left: {[(p.pid, p.name()) for p in left]}"
        assert list((tmp_path / f"scratch{i}").iterdir()) == [], f"run {i}: scratch dirs left"
        assert _harness_tmp() <= before_tmp, f"run {i}: temp entries left: {sorted(_harness_tmp() - before_tmp)}"
        assert _shm() <= before_shm, f"run {i}: shared memory left: {sorted(_shm() - before_shm)}"
