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
