"""The wheel: one top-level package, `harness`, plus its dist-info. The clone's
top-level cases/ and matrices/ go in as harness/cases and harness/matrices; tests/ and benchmarks/
(and the tests' probes) stay out; installed outside the clone, `ckpt-harness list` still finds every
case of a packaged matrix.

The wheel is built from a copy of the tree (setuptools' PEP 517 backend, in-process, offline: the
clone gets no build/ or egg-info) and installed by unpacking it into a bare venv, the way pip would,
with this venv's site-packages on a .pth line for the dependencies (a .pth line adds the directory,
not the .pth files in it: this venv's editable install does not come along).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: What the build reads (pyproject's dynamic fields, setup.py's package list) and what must stay out.
SOURCES = ("setup.py", "pyproject.toml", "README.md", "requirements.txt", "requirements-cluster.txt",
           "harness", "cases", "matrices", "tests", "benchmarks")
#: The tests' own rank functions: tests/probes.py, never the wheel.
TEST_PROBES = ("def raise_on_rank", "def mark_hook", "def leave_temp_file")


def wheel_problems(wheel: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with `wheel`'s contents: a top-level name other than harness and one dist-info,
    test code or probes inside, or a package / case / matrix of the clone it lacks."""
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        probes = z.read("harness/run/probes.py").decode() if "harness/run/probes.py" in names else ""
    tops = {n.split("/", 1)[0] for n in names}
    infos = {t for t in tops if t.endswith(".dist-info")}
    bad = [f"top-level {t!r}: the wheel holds harness and its dist-info only" for t in sorted(tops - {"harness"} - infos)]
    if len(infos) != 1:
        bad.append(f"dist-info: {sorted(infos)}")
    bad += [f"test code in the wheel: {n}" for n in sorted(names) if n.startswith(("harness/tests/", "harness/benchmarks/"))]
    bad += [f"a test probe in harness/run/probes.py: {p}" for p in TEST_PROBES if p in probes]
    want = [f"harness/{p.relative_to(root / 'harness').as_posix()}" for p in (root / "harness").rglob("__init__.py")]
    want += [f"harness/cases/{p.relative_to(root / 'cases').as_posix()}" for p in (root / "cases").rglob("*.py")]
    want += [f"harness/matrices/{p.name}" for p in (root / "matrices").glob("*.yaml")]
    bad += [f"missing from the wheel: {w}" for w in sorted(want) if w not in names]
    return bad


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools in this venv")
    tmp = tmp_path_factory.mktemp("wheel")
    src, out = tmp / "src", tmp / "dist"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=skip)
        elif (ROOT / name).exists():
            src.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    r = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; print(b.build_wheel(sys.argv[1]))",
                        str(out)], cwd=src, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out / r.stdout.strip().splitlines()[-1]


def test_the_wheel_holds_harness_alone(wheel):
    assert wheel_problems(wheel) == []
    with zipfile.ZipFile(wheel) as z:
        assert {n.split("/", 1)[0] for n in z.namelist()} == {"harness", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
        assert z.read(next(n for n in z.namelist() if n.endswith("top_level.txt"))).decode().split() == ["harness"]


def test_the_wheel_check_can_fail(tmp_path, wheel):
    """A planted wheel with the old layout (a top-level cases/ and benchmarks/, the probes in harness,
    one case and one matrix short) is reported on every count."""
    planted = tmp_path / "ckpt_harness-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(planted, "w") as z:
        for n in src.namelist():
            if n not in ("harness/cases/resume.py", "harness/matrices/smoke.yaml", "harness/run/probes.py"):
                z.writestr(n, src.read(n))
        z.writestr("harness/run/probes.py", (ROOT / "tests" / "probes.py").read_text())
        z.writestr("cases/__init__.py", "")
        z.writestr("benchmarks/world_start.py", "")
    bad = wheel_problems(planted)
    assert [b for b in bad if b.startswith("top-level")] == [
        "top-level 'benchmarks': the wheel holds harness and its dist-info only",
        "top-level 'cases': the wheel holds harness and its dist-info only"]
    assert {b for b in bad if not b.startswith("top-level")} == {
        *(f"a test probe in harness/run/probes.py: {p}" for p in TEST_PROBES),
        "missing from the wheel: harness/cases/resume.py", "missing from the wheel: harness/matrices/smoke.yaml"}


@pytest.mark.slow  # a bare venv plus one CLI start that imports torch and megatron-core: ~15 s on 2 cores
def test_the_installed_wheel_lists_a_matrix_outside_the_clone(tmp_path, wheel):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    script = venv / "bin" / "ckpt-harness"  # what pip writes for [project.scripts]
    script.write_text(f"#!{py}\nimport sys\nfrom harness.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([str(py), "-c", "import importlib.util as u, harness.cases as c; print(c.__file__); "
                            "print([n for n in ('cases', 'benchmarks', 'probes', 'doubles') if u.find_spec(n)])"],
                           cwd=away, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr[-3000:]
    assert where.stdout.split("\n")[:2] == [str(site / "harness" / "cases" / "__init__.py"), "[]"]
    listed = subprocess.run([str(script), "list", str(site / "harness" / "matrices" / "smoke.yaml")],
                            cwd=away, env=env, capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stdout[-2000:] + listed.stderr[-3000:]
    from harness.orchestration.matrix import load_matrix

    ids = [line.split("  #", 1)[0] for line in listed.stdout.splitlines() if line.strip()]
    assert ids == [s.id for s in load_matrix(ROOT / "matrices" / "smoke.yaml").cases] and len(ids) > 10
