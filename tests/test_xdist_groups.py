"""--dist loadgroup really keeps an xdist_group on one worker (conftest.py mends what pytest-xdist
3.8.0 loses under pytest 9): the suite's shared fixtures and its one-cluster-at-a-time Slurm tests
rely on it. A real two-worker session in a subprocess, on a file of this test's own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GROUPED = '''
import os, pytest, time

def _log(request, worker_id):
    with open(os.environ["WHERE"], "a") as f:
        f.write(f"{worker_id} {request.node.nodeid}\\n")
    time.sleep(0.5)

@pytest.mark.xdist_group("g")
def test_a(request, worker_id): _log(request, worker_id)

@pytest.mark.xdist_group(name="g")
@pytest.mark.parametrize("x", [1, 2])
def test_b(request, worker_id, x): _log(request, worker_id)

def test_c(request, worker_id): _log(request, worker_id)

def test_d(request, worker_id): _log(request, worker_id)
'''


def test_a_group_runs_on_one_worker_and_the_rest_spreads(tmp_path):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    where = tmp_path / "where.txt"
    env = {**os.environ, "WHERE": str(where), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:harness.pytest_plugin",
                           "-p", "conftest", "-n", "2", "--dist", "loadgroup", "-q", "--rootdir", str(tmp_path),
                           "-c", os.devnull, str(tmp_path / "test_grouped.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = dict(reversed(line.split(" ", 1)) for line in where.read_text().splitlines())
    grouped = {n: w for n, w in ran.items() if "test_a" in n or "test_b" in n}
    assert sorted(grouped) == ["test_grouped.py::test_a@g", "test_grouped.py::test_b[1]@g", "test_grouped.py::test_b[2]@g"], ran
    assert len(set(grouped.values())) == 1, f"the group ran on several workers: {grouped}"
    assert len(ran) == 5 and set(ran.values()) == {"gw0", "gw1"}, f"the ungrouped tests did not spread: {ran}"
