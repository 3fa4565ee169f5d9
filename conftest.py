"""Repository-wide test settings. The matrix plugin itself is harness.pytest_plugin (an entry point)."""

import os
from pathlib import Path

import pytest

from harness.run.procs import live_children

# Test doubles live in tests/doubles.py and travel to ranks as "doubles:Name": every process this
# session starts (spawn, forkserver, torchrun ranks, `python -c` subprocesses) must find them too,
# not only this one (pytest puts tests/ on its own sys.path, not on a child's).
_TESTS = str(Path(__file__).resolve().parent / "tests")
if _TESTS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH")) if p)


@pytest.hookimpl(trylast=True)  # after xdist's own hook, which added the suffix where pytest does not read it
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Give each item marked xdist_group the "@group" node-id suffix --dist loadgroup schedules by.

    pytest-xdist 3.8.0 adds the suffix to `item._nodeid`, which pytest 9 no longer reads (its
    Node.nodeid is str(item._id)): every group was silently ignored, and the grouped tests spread
    over the workers (measured: tests/test_reuse.py's shared runs computed on both workers, 53 s
    each; the planted-candidate gates each building their own baseline; tests/test_slurm.py's
    clusters free to overlap). Probe: the effect itself, a grouped item without the suffix after
    xdist's hook; the day xdist sets the id pytest reads, nothing is found and nothing changes."""
    if not getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup only
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid and hasattr(item, "_id"):
            item._id = type(item._id).parse(f"{item.nodeid}@{'_'.join(names)}")


@pytest.fixture(autouse=True)
def _no_process_left_behind():
    """Every harness test must leave no child process behind (worlds, managers, grandchildren);
    multiprocessing's resource tracker and forkserver are the stdlib's, meant to stay."""
    yield
    left = live_children()
    assert not left, f"processes left behind: {[(p.pid, p.name()) for p in left]}"


@pytest.fixture
def matrix_error(tmp_path):
    """The MatrixError text of a one-entry matrix (asserting it names the entry), for tests of
    what a case's contract refuses at load time."""
    import textwrap

    from harness.orchestration.matrix import MatrixError, load_matrix

    def load(entry: str) -> str:
        path = tmp_path / "m.yaml"
        path.write_text(textwrap.dedent(f"entries:\n  - {entry}\n"))
        with pytest.raises(MatrixError) as exc:
            load_matrix(path)
        assert "entries[0]" in str(exc.value) and str(path) in str(exc.value), str(exc.value)
        return str(exc.value)

    return load


@pytest.fixture
def override():
    """A faulty backend double (a class of tests/doubles.py) under a test name, by import path (so
    any start method finds it); unregistered after the test."""
    from harness import backends

    names = []

    def use(cls):
        name = f"test_{cls.lower()}"
        backends.register(name, f"doubles:{cls}")
        names.append(name)
        return name

    yield use
    for n in names:
        backends.unregister(n)
