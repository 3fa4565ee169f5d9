"""The uv installer writes what pip would: an env whose modules are byte-compiled at install, so a
candidate env's first run is not slower than a warm baseline's for that reason alone."""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path

import pytest

from harness.gate import installers

UV = Path(os.environ.get("CKPT_HARNESS_HOME", Path.home() / ".cache" / "ckpt-harness")) / "tools"


def _uv() -> Path:
    found = sorted(UV.glob("uv-*/bin/uv"))
    if not found:
        pytest.skip(f"no uv under {UV}: scripts/test's env build puts it there (requirements-tools.txt)")
    return found[-1]


def _wheel(tmp_path: Path) -> Path:
    """A one-module wheel, so the test needs no index."""
    whl = tmp_path / "tinypkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("tinypkg/__init__.py", "VALUE = 1\n")
        z.writestr("tinypkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n")
        z.writestr("tinypkg-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("tinypkg-1.0.dist-info/RECORD", "")
    return whl


def test_uv_install_byte_compiles_like_pip(tmp_path):
    uv = installers.Uv(_uv(), tmp_path / "store", ("--no-index",), ())
    venv, log = tmp_path / "venv", tmp_path / "log"
    uv.venv(sys.executable, venv, log)
    uv.install(venv, [str(_wheel(tmp_path))], log)
    pkg = next(venv.glob("lib/python*/site-packages/tinypkg"))
    assert list((pkg / "__pycache__").glob("__init__.*.pyc")), log.read_text()[-2000:]


def test_uv_ignores_the_config_of_the_directory_it_runs_in(tmp_path, monkeypatch):
    """A bisect step runs in a Megatron-Bridge checkout whose pyproject names its own uv index
    (pypi.nvidia.com): the env must be built with pip's index configuration alone. Planted here as
    a uv version requirement no uv meets, which fails any install that reads it."""
    work = tmp_path / "checkout"
    work.mkdir()
    (work / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "0"\n\n[tool.uv]\nrequired-version = "==0.0.1"\n')
    monkeypatch.chdir(work)
    uv = installers.Uv(_uv(), tmp_path / "store", ("--no-index",), ())
    venv, log = tmp_path / "venv", tmp_path / "log"
    uv.venv(sys.executable, venv, log)
    uv.install(venv, [str(_wheel(tmp_path))], log)
    assert next(venv.glob("lib/python*/site-packages/tinypkg")).is_dir()



def test_from_a_venv_without_pip_the_index_and_the_builds_use_a_python_that_has_it(tmp_path):
    """uv makes venvs without pip (the pins' env is one): a sweep or gate run from it must still read
    release metadata (`pip download`) and pip's index config through an interpreter that has pip."""
    import subprocess

    base = getattr(sys, "_base_executable", sys.executable)
    venv = tmp_path / "nopip"
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    # what the pins' env holds that matters here: `packaging`, and no pip
    import shutil

    import packaging

    shutil.copytree(Path(packaging.__file__).parent, tmp_path / "lib" / "packaging")
    next(venv.glob("lib/python*/site-packages")).joinpath("lib.pth").write_text(str(tmp_path / "lib") + "\n")
    root = Path(__file__).resolve().parents[1]
    code = ("from harness.gate.metadata import PipIndex, python_with_pip; from harness.gate.envspec import _python; "
            "print(python_with_pip()); print(PipIndex().pip[0]); print(_python(None))")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                       env={"PYTHONPATH": str(root), "PATH": os.environ.get("PATH", "")}, check=True)
    chosen = r.stdout.split()
    assert len(chosen) == 3
    for python in chosen:
        assert subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode == 0, python


def test_a_source_tree_is_built_afresh_for_every_env(tmp_path, monkeypatch):
    """A bisect moves one worktree path through many commits; uv keyed its build of a local directory by
    path and pyproject.toml, so a later commit's env got an earlier commit's build (the first bisect over
    Megatron-Bridge blamed the wrong commit). Two envs from one path, a source edit between them."""
    from harness.gate import envspec
    from harness.gate.metadata import python_with_pip

    tree = tmp_path / "tinytree"
    (tree / "tinytree").mkdir(parents=True)
    (tree / "pyproject.toml").write_text('[build-system]\nrequires = ["flit_core>=3.4,<4"]\nbuild-backend = "flit_core.buildapi"\n\n'
                                         '[project]\nname = "tinytree"\nversion = "1.0"\ndescription = "x"\n')
    init = tree / "tinytree" / "__init__.py"
    py = python_with_pip()
    args, env = installers.uv_index_args(installers._pip_config(py))
    uv = installers.Uv(_uv(), tmp_path / "store", tuple(args), tuple(sorted(env.items())))
    monkeypatch.setattr(envspec, "Uv", type("U", (), {"configured": staticmethod(lambda *a, **k: uv)}))
    seen = {}
    for n in (1, 2):
        init.write_text(f'"""x"""\nX = {n}\n')
        o = envspec.parse_spec(str(tree))
        req = envspec.Request(f"{o.requirement}\n", "", "", overrides=(o,))
        venv = tmp_path / f"venv{n}"
        envspec._build(venv, req, [str(tree)], tmp_path, py, Path(envspec.__file__).resolve().parents[2])
        site = next(venv.glob("lib/python*/site-packages/tinytree/__init__.py"))
        seen[n] = site.read_text().strip().splitlines()[-1]
    assert seen == {1: "X = 1", 2: "X = 2"}, seen


def test_an_orphaned_install_child_keeps_the_build_lock(tmp_path, monkeypatch):
    """A gate killed mid-build leaves its uv child running; the next build must wait for it, not clear
    the venv under it. The lock's fd goes to every install child, so the child holds the flock."""
    import fcntl
    import time

    lock_path = tmp_path / ".lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        monkeypatch.setattr(installers, "HELD_LOCKS", [lock.fileno()])
        # the "install" forks a writer that outlives it (as uv does when its parent is killed)
        installers.run_logged(["sh", "-c", "sleep 3 >/dev/null 2>&1 &"], tmp_path / "log")
    # this process let go of the lock; the orphan still holds it
    with open(lock_path, "w") as again:
        with pytest.raises(BlockingIOError):
            fcntl.flock(again, fcntl.LOCK_EX | fcntl.LOCK_NB)
        deadline = time.monotonic() + 30
        while True:  # and once the orphan is gone, the next build gets it
            try:
                fcntl.flock(again, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, "the lock was never released"
                time.sleep(0.2)
