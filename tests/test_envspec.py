"""Environments as data (harness/gate/envspec.py): every SPEC form, the resolved request (dropped pins,
no-deps), the baseline key == scripts/ensure-env's historical formula, and `ensure` with pip
replaced by a stub (a real build takes minutes)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.gate import envspec
from harness.gate.envspec import EnvBuildError, parse_spec, resolve

ROOT = Path(__file__).resolve().parent.parent
SHA = "0123456789abcdef0123456789abcdef01234567"


def test_baseline_key_is_the_bash_formula():
    """With no override the cached baseline venv (venv-<key>) must be found again."""
    files = ("requirements.txt", "requirements-nodeps.txt", "constraints.txt", "requirements-verl.txt", "requirements-cluster.txt")
    raw = b"".join((ROOT / f).read_bytes() for f in files)
    key = hashlib.sha256(raw).hexdigest()[:12]
    assert resolve(ROOT, []).key == key
    bash = subprocess.run(f"cat {' '.join(files)} | sha256sum | cut -c1-12",
                          shell=True, cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    assert bash == key


def test_cli_key_runs_stdlib_only_and_isolated():
    """scripts/ensure-env runs the file with `python -I` before any venv exists: no site-packages needed."""
    r = subprocess.run([sys.executable, "-I", "-S", str(ROOT / "harness" / "gate" / "envspec.py"), "key", "--exact", "megatron-core==0.18.1"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == resolve(ROOT, [parse_spec("megatron-core==0.18.1")]).key != resolve(ROOT, []).key


def test_version_spec():
    o = parse_spec("Megatron_Core==0.18.1")
    assert (o.kind, o.name, o.version, o.requirement) == ("version", "megatron-core", "0.18.1", "megatron-core==0.18.1")


def test_vcs_spec_at_a_commit():
    url = f"git+https://github.com/NVIDIA-NeMo/Megatron-Bridge@{SHA}"
    o = parse_spec(f"megatron-bridge @ {url}")
    assert (o.kind, o.name, o.url, o.commit, o.requirement) == ("vcs", "megatron-bridge", url, SHA, f"megatron-bridge @ {url}")
    assert parse_spec(f"megatron_bridge@{url}#egg=megatron-bridge").commit == SHA


@pytest.mark.parametrize("ref", ["@main", "@v0.6.2", ""])
def test_vcs_spec_without_a_commit_is_refused(ref):
    spec = f"megatron-bridge @ git+https://github.com/NVIDIA-NeMo/Megatron-Bridge{ref}"
    with pytest.raises(ValueError, match="must end in @<commit sha>") as e:
        parse_spec(spec)
    assert spec in str(e.value)


def make_tree(d: Path, name: str = "Megatron_Bridge") -> Path:
    (d / "src" / "pkg").mkdir(parents=True)
    (d / "pyproject.toml").write_text(f'[project]\nname = "{name}"\ndynamic = ["version"]\n')
    (d / "src" / "pkg" / "__init__.py").write_text("X = 1\n")
    return d


def test_local_tree_spec_without_git(tmp_path):
    tree = make_tree(tmp_path / "Megatron-Bridge")
    o = parse_spec("./Megatron-Bridge", cwd=tmp_path)
    assert (o.kind, o.name, o.path, o.commit) == ("tree", "megatron-bridge", str(tree), None)
    assert o.requirement == f"megatron-bridge @ {tree.as_uri()}" and parse_spec(str(tree)).digest == o.digest
    # What pip's in-tree build leaves behind is not part of the tree's identity...
    (tree / "build" / "lib").mkdir(parents=True)
    (tree / "build" / "lib" / "x.py").write_text("built")
    (tree / "src" / "megatron_bridge.egg-info").mkdir()
    (tree / "src" / "megatron_bridge.egg-info" / "PKG-INFO").write_text("x")
    assert parse_spec(str(tree)).digest == o.digest
    # ... an edit is: a new key, so a new venv.
    (tree / "src" / "pkg" / "__init__.py").write_text("X = 2\n")
    edited = parse_spec(str(tree))
    assert edited.digest != o.digest
    assert resolve(ROOT, [edited]).key != resolve(ROOT, [o]).key


def git(d: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(d), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_local_tree_spec_in_a_git_checkout(tmp_path):
    tree = make_tree(tmp_path / "mb")
    (tree / ".gitignore").write_text("ignored.txt\n")
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "init")
    o = parse_spec(str(tree))
    assert o.kind == "tree" and o.commit == git(tree, "rev-parse", "HEAD") and len(o.commit) == 40
    (tree / "ignored.txt").write_text("not part of the tree")
    (tree / "build").mkdir()  # pip's in-tree build output, even where .gitignore does not list it
    (tree / "build" / "x.py").write_text("built")
    (tree / "src" / "mb.egg-info").mkdir()
    (tree / "src" / "mb.egg-info" / "PKG-INFO").write_text("x")
    assert parse_spec(str(tree)).digest == o.digest
    (tree / "src" / "pkg" / "__init__.py").write_text("X = 3\n")  # uncommitted edit: same commit, new digest
    edited = parse_spec(str(tree))
    assert edited.commit == o.commit and edited.digest != o.digest
    (tree / "src" / "pkg" / "new.py").write_text("Y = 1\n")  # untracked, not ignored: it would be installed
    assert parse_spec(str(tree)).digest != edited.digest


def test_subdirectory_of_a_checkout_is_not_taken_for_its_commit(tmp_path):
    git(tmp_path, "init", "-q")
    make_tree(tmp_path / "inner")
    assert parse_spec(str(tmp_path / "inner")).commit is None


def test_wheel_spec(tmp_path):
    whl = tmp_path / "megatron_bridge-0.6.2-py3-none-any.whl"
    whl.write_bytes(b"not really a zip")
    o = parse_spec(str(whl))
    assert (o.kind, o.name, o.version, o.path) == ("wheel", "megatron-bridge", "0.6.2", str(whl))
    assert o.digest == hashlib.sha256(b"not really a zip").hexdigest()
    assert o.requirement == f"megatron-bridge @ {whl.as_uri()}"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("megatron-bridge>>1", "not a SPEC"),
        ("megatron-bridge>=0.6", "not a SPEC"),
        ("./does-not-exist", "no such directory"),
        ("/nowhere/megatron_bridge-0.6.2-py3-none-any.whl", "no such wheel file"),
        ("git+https://github.com/NVIDIA-NeMo/Megatron-Bridge@" + SHA, "name the package"),
        ("", "not a SPEC"),
        ("megatron-bridge @ file:///nowhere/Megatron-Bridge", "no such directory /nowhere/Megatron-Bridge"),
        ("megatron-bridge @ file:///nowhere/megatron%5Fbridge-0.6.2-py3-none-any.whl",
         "no such wheel file /nowhere/megatron_bridge-0.6.2-py3-none-any.whl"),
        ("megatron-bridge @ file://elsewhere/Megatron-Bridge", "not host 'elsewhere'"),
        ("megatron-bridge @ https://example.invalid/megatron_bridge-0.6.2.tar.gz", "must name a wheel"),
        ("megatron-bridge @ file:///my trees/Megatron-Bridge", "percent-encode them"),
    ],
)
def test_bad_spec_is_a_clear_value_error_naming_it(spec, message, tmp_path):
    with pytest.raises(ValueError, match=message) as e:
        parse_spec(spec, cwd=tmp_path)
    assert repr(spec) in str(e.value)


def make_wheel(d: Path, name: str = "megatron_bridge", version: str = "0.6.2") -> Path:
    """A small real wheel (METADATA and WHEEL only), as pip or the release set reads one."""
    import zipfile

    d.mkdir(parents=True, exist_ok=True)
    whl = d / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\n")
        z.writestr(f"{name}-{version}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n\n")
    return whl


def test_a_direct_reference_to_a_local_tree_or_wheel_is_that_override(tmp_path):
    """`NAME @ file:...` as a requirements file has it: the same override as the bare path (same
    requirement line, digest, key), percent-decoded, with localhost, and pip's relative forms."""
    tree = make_tree(tmp_path / "my trees" / "Megatron-Bridge")
    whl = make_wheel(tmp_path / "my wheels")
    assert "%20" in tree.as_uri()
    for bare, forms in (
        (tree, [f"megatron-bridge @ {tree.as_uri()}", f"Megatron_Bridge@{tree.as_uri()}", f"megatron-bridge @ file://localhost{tree.as_uri()[len('file://'):]}",
                "megatron-bridge @ file:my%20trees/Megatron-Bridge", "megatron-bridge @ file:./my%20trees/Megatron-Bridge"]),
        (whl, [f"megatron-bridge @ {whl.as_uri()}", f"megatron-bridge @ file:{whl.as_uri()[len('file://'):]}", f"megatron-bridge @ {whl.as_uri()}#egg=megatron-bridge"]),
    ):
        want = parse_spec(str(bare))
        for spec in forms:
            o = parse_spec(spec, cwd=tmp_path)
            assert (o.spec, o.kind, o.name, o.path, o.requirement, o.digest, o.version) == (
                spec, want.kind, "megatron-bridge", str(bare), want.requirement, want.digest, want.version), spec
            assert resolve(ROOT, [o]).key == resolve(ROOT, [want]).key
    # The release set reads the same tree / wheel (not a URL whose metadata cannot be read).
    from harness.gate import releases

    asked = releases.parse_asked(f"megatron-bridge @ {tree.as_uri()}", tmp_path)
    assert (asked.kind, asked.path, releases.read_tree(Path(asked.path)).name) == ("tree", str(tree), "megatron-bridge")
    asked = releases.parse_asked(f"megatron-bridge @ {whl.as_uri()}", tmp_path)
    assert (asked.kind, asked.path, releases.read_wheel(Path(asked.path)).name) == ("wheel", str(whl), "megatron-bridge")


def test_a_direct_reference_naming_another_package_is_refused_naming_both(tmp_path):
    tree = make_tree(tmp_path / "Megatron-Bridge")
    whl = make_wheel(tmp_path / "w")
    for spec, what in ((f"megatron-core @ {tree.as_uri()}", f"the source tree {tree}"), (f"Megatron_Core @ {whl.as_uri()}", f"the wheel {whl.name}")):
        with pytest.raises(ValueError) as e:
            parse_spec(spec)
        assert str(e.value) == f"{spec!r}: the spec names 'megatron-core' but {what}{' (its pyproject.toml [project].name)' if 'tree' in what else ''} is 'megatron-bridge'"


@pytest.fixture
def wheel_server(tmp_path, monkeypatch):
    """A local http server on 127.0.0.1 serving tmp_path/served (this machine reaches no other host):
    yields (base URL, the paths it was asked for); stopped at teardown."""
    import http.server
    import threading

    from harness.gate import directref

    served, asked = tmp_path / "served", []
    served.mkdir()

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(served), **kw)

        def do_GET(self):
            asked.append(self.path)
            super().do_GET()

        def log_message(self, *a):
            pass

    for var in ("no_proxy", "NO_PROXY"):  # a configured proxy must not be asked for 127.0.0.1
        monkeypatch.setenv(var, "*")
    monkeypatch.setattr(directref, "TIMEOUT_S", 10.0)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked, served
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_a_wheel_url_is_downloaded_once_into_the_cache_and_keyed_by_its_content(tmp_path, wheel_server):
    base, asked, served = wheel_server
    whl = make_wheel(served)
    sha = hashlib.sha256(whl.read_bytes()).hexdigest()
    cache = tmp_path / "cache"
    spec = f"megatron-bridge @ {base}/{whl.name}#sha256={sha}"
    o = parse_spec(spec, cache=cache)
    assert (o.spec, o.kind, o.name, o.version, o.url, o.digest) == (spec, "wheel", "megatron-bridge", "0.6.2", f"{base}/{whl.name}#sha256={sha}", sha)
    got = Path(o.path)
    assert got.is_relative_to(cache / "wheels") and got.name == whl.name and got.read_bytes() == whl.read_bytes()
    assert o.requirement == f"megatron-bridge @ {got.as_uri()}"  # pip installs the cached copy, offline
    assert json.loads((got.parent / "source.json").read_text()) == {"url": f"{base}/{whl.name}", "file": whl.name, "sha256": sha}
    assert asked == [f"/{whl.name}"]
    # Again (with or without the hash): the cached file, no second request; the same key.
    assert parse_spec(spec, cache=cache) == o
    assert parse_spec(f"megatron-bridge @ {base}/{whl.name}", cache=cache).path == o.path
    assert asked == [f"/{whl.name}"]
    assert resolve(ROOT, [parse_spec(spec, cache=cache)]).key == resolve(ROOT, [o]).key
    # The same content at another path is another wheel file: the digest (in the key) is the same.
    assert parse_spec(str(whl)).digest == o.digest
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_relative_to(cache) and not p.is_relative_to(served)]


def test_a_wheel_url_with_a_wrong_hash_or_none_there_is_refused(tmp_path, wheel_server):
    base, asked, served = wheel_server
    whl = make_wheel(served)
    cache, wrong = tmp_path / "cache", "0" * 64
    spec = f"megatron-bridge @ {base}/{whl.name}#sha256={wrong}"
    with pytest.raises(ValueError, match=f"the URL's #sha256= says {wrong}") as e:
        parse_spec(spec, cache=cache)
    assert repr(spec) in str(e.value) and hashlib.sha256(whl.read_bytes()).hexdigest() in str(e.value)
    assert not [p for p in (cache / "wheels").rglob("*") if p.is_file()]  # nothing kept of a refused download
    parse_spec(f"megatron-bridge @ {base}/{whl.name}", cache=cache)  # cached now: a wrong hash is still refused
    with pytest.raises(ValueError, match=f"the cached copy .* says {wrong}"):
        parse_spec(spec, cache=cache)
    with pytest.raises(ValueError, match=r"could not download .*/megatron_bridge-9\.9\.9-py3-none-any\.whl: HTTP Error 404"):
        parse_spec(f"megatron-bridge @ {base}/megatron_bridge-9.9.9-py3-none-any.whl", cache=cache)
    with pytest.raises(ValueError, match="the spec names 'megatron-core' but the wheel megatron_bridge-0.6.2-py3-none-any.whl"):
        parse_spec(f"megatron-core @ {base}/{whl.name}", cache=cache)


def test_bad_wheel_name_and_tree_without_project_name(tmp_path):
    (tmp_path / "megatron_bridge.whl").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a wheel filename"):
        parse_spec(str(tmp_path / "megatron_bridge.whl"))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "pyproject.toml").write_text("[build-system]\n")
    with pytest.raises(ValueError, match=r"\[project\].name"):
        parse_spec(str(tmp_path / "t"))


def pins(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln and not ln.startswith("#")]


def test_overridden_pins_are_dropped_everywhere_and_the_override_added():
    base = resolve(ROOT, [])
    req = resolve(ROOT, [parse_spec("megatron-core==0.18.1"), parse_spec("absl_py==2.4.0")])
    assert "megatron-core==0.19.2" in pins(base.requirements) and "megatron-core==0.19.2" in pins(base.constraints)
    assert "megatron-core==0.18.1" in pins(req.requirements) and "absl-py==2.4.0" in pins(req.requirements)
    assert not any(p.startswith(("megatron-core==0.19", "absl-py==2.5")) for p in pins(req.requirements + req.constraints))
    # Every other pin stays, verbatim.
    assert set(pins(base.constraints)) - set(pins(req.constraints)) == {"megatron-core==0.19.2", "absl-py==2.5.1"}
    assert set(pins(base.requirements)) - set(pins(req.requirements)) == {"megatron-core==0.19.2"}
    assert req.nodeps == base.nodeps and req.key != base.key


def test_verl_pins_are_part_of_the_key_and_of_the_request():
    """requirements-verl.txt (the verl_manager backend's deps) is hashed and installed; an override
    of one of its packages drops its pin there too; verl itself is --no-deps."""
    base = resolve(ROOT, [])
    assert "ray==2.60.0" in pins(base.verl) and "verl==0.9.1" in pins(base.nodeps) and "tensordict==0.10.0" in pins(base.nodeps)
    req = resolve(ROOT, [parse_spec("ray==2.61.0")])
    assert "ray==2.60.0" not in pins(req.verl) and "ray==2.61.0" in pins(req.requirements) and req.key != base.key
    over = pins(resolve(ROOT, [parse_spec("verl==0.9.2")]).nodeps)
    assert over[-1] == "verl==0.9.2" and set(over) == set(pins(base.nodeps)) - {"verl==0.9.1"} | {"verl==0.9.2"}


def test_the_cluster_extra_is_part_of_the_key_and_of_the_request_and_is_what_pyproject_offers():
    """requirements-cluster.txt (the `cluster` extra) is hashed and installed, so the suite runs the
    cluster tests; pyproject's extra reads the same file (one list of pins, not two to keep equal)."""
    import tomllib

    base = resolve(ROOT, [])
    assert pins(base.cluster) == ["submitit==1.5.4"] and base.cluster == (ROOT / "requirements-cluster.txt").read_text()
    req = resolve(ROOT, [parse_spec("submitit==1.5.3")])
    assert pins(req.cluster) == [] and "submitit==1.5.3" in pins(req.requirements) and req.key != base.key
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["dynamic"]
    assert setuptools["optional-dependencies"] == {"cluster": {"file": ["requirements-cluster.txt"]}}


@pytest.mark.parametrize("spec", ["megatron-bridge==0.6.0", f"megatron-bridge @ git+https://github.com/NVIDIA-NeMo/Megatron-Bridge@{SHA}"])
def test_a_no_deps_package_override_replaces_its_line_there(spec):
    o = parse_spec(spec)
    req = resolve(ROOT, [o])
    assert pins(req.nodeps) == [p for p in pins(resolve(ROOT, []).nodeps) if not p.startswith("megatron-bridge")] + [o.requirement]
    assert not any("megatron-bridge" in p for p in pins(req.requirements + req.constraints))
    assert req.requirements == resolve(ROOT, []).requirements


def test_a_package_overridden_twice_is_refused():
    with pytest.raises(ValueError, match="megatron-core: overridden more than once"):
        resolve(ROOT, [parse_spec("megatron-core==0.18.1"), parse_spec("megatron_core==0.18.0")])


def stub(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "pip-stub"
    p.write_text(f"#!/bin/sh\n{body}\n")
    p.chmod(0o755)
    return p


def test_ensure_failing_install_raises_with_the_pip_log_tail(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_HARNESS_PIP", str(stub(tmp_path, 'echo "ERROR: No matching distribution found for megatron-bridge==9.9.9"; exit 1')))
    cache = tmp_path / "cache"
    with pytest.raises(EnvBuildError) as e:
        envspec.ensure(["megatron-bridge==9.9.9"], cache, ROOT, python=sys.executable, companions=False)
    key = resolve(ROOT, [parse_spec("megatron-bridge==9.9.9")]).key
    msg = str(e.value)
    assert "ERROR: No matching distribution found for megatron-bridge==9.9.9" in msg
    assert f"full log: {cache / f'install-{key}.log'}" in msg and (cache / f"install-{key}.log").exists()
    assert not (cache / f"venv-{key}" / ".complete").exists()
    # The CLI: exit 2 and the same text, no traceback.
    r = subprocess.run([sys.executable, "-I", str(ROOT / "harness" / "gate" / "envspec.py"), "ensure", "--exact", "--cache", str(cache), "megatron-bridge==9.9.9"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 2 and "No matching distribution" in r.stderr and "Traceback" not in r.stderr and r.stdout == ""


def test_ensure_builds_once_records_provenance_and_reuses(tmp_path, monkeypatch):
    calls = tmp_path / "calls"
    monkeypatch.setenv("CKPT_HARNESS_PIP", str(stub(
        tmp_path, f'echo "$*" >> {calls}\n[ "$1" = freeze ] && printf "megatron-core==0.18.1\\ntorch==2.14.1\\n"\nexit 0')))
    cache = tmp_path / "cache"
    venv = envspec.ensure(["megatron-core==0.18.1"], cache, ROOT, python=sys.executable, companions=False)
    key = resolve(ROOT, [parse_spec("megatron-core==0.18.1")]).key
    assert venv == cache / f"venv-{key}" and (venv / ".complete").exists() and (venv / "bin" / "python").exists()
    log = calls.read_text().splitlines()
    files = venv / envspec.REQUEST_DIR
    assert log[:4] == [
        "install --upgrade pip",
        f"install -r {files / 'requirements.txt'} -r {files / 'requirements-verl.txt'} -r {files / 'requirements-cluster.txt'} "
        f"-c {files / 'constraints.txt'}",
        f"install --no-deps -r {files / 'requirements-nodeps.txt'}",
        "freeze",
    ]
    assert log[4] == f"install -q --no-deps --no-build-isolation -e {ROOT}"  # the harness, editable
    assert "megatron-core==0.18.1" in pins((files / "requirements.txt").read_text())
    assert "megatron-core==0.19.2" not in (files / "constraints.txt").read_text()
    env = json.loads((venv / envspec.ENV_JSON).read_text())
    assert env["specs"] == ["megatron-core==0.18.1"] and env["key"] == key
    assert env["pip_freeze"] == ["megatron-core==0.18.1", "torch==2.14.1"]
    [o] = env["overrides"]
    assert (o["kind"], o["name"], o["version"], o["installed"]) == ("version", "megatron-core", "0.18.1", "megatron-core==0.18.1")
    # Reuse: no second install of anything but the (still unsatisfied, stubbed) editable harness.
    assert envspec.ensure(["megatron_core==0.18.1"], cache, ROOT, python=sys.executable, companions=False) == venv
    assert [ln for ln in calls.read_text().splitlines()[5:] if "-e" not in ln.split()] == []


def test_check_import_passes_and_fails_with_the_stderr_tail():
    venv = Path(sys.prefix)
    envspec.check_import(venv, ("json", "harness.gate.envspec"))
    with pytest.raises(EnvBuildError, match="ModuleNotFoundError: No module named 'no_such_module_xyz'") as e:
        envspec.check_import(venv, ("json", "no_such_module_xyz"))
    assert f"do not import in {venv}" in str(e.value)
    with pytest.raises(ValueError):
        envspec.check_import(venv, ("os; import shutil",))


@pytest.mark.slow
def test_check_import_of_megatron_in_this_venv():
    """The real check a candidate gets (~15 s: torch, megatron-core, Megatron-Bridge through the TE stub)."""
    envspec.check_import(Path(sys.prefix))


class _FakeReleaseSet:
    """What resolve() reads of a harness.gate.releases.ReleaseSet."""

    def drop_names(self):
        return {"numpy", "contourpy", "megatron-bridge"}  # a --no-deps pin is only moved by the user

    def extra_specs(self):
        return ["numpy<2.0.0"]


def named(text: str) -> set[str]:
    return {ln.split("==")[0].split(" ")[0] for ln in pins(text)}


def test_a_release_set_moves_its_companions_and_their_dependents():
    base = resolve(ROOT, [parse_spec("megatron-core==0.15.3")])
    req = resolve(ROOT, [parse_spec("megatron-core==0.15.3")], _FakeReleaseSet())
    assert "numpy" in named(base.constraints) and "contourpy" in named(base.constraints)
    assert "numpy" not in named(req.constraints) and "contourpy" not in named(req.constraints)
    assert "numpy<2.0.0" in req.requirements.splitlines() and "numpy==2.5.5" not in pins(req.requirements)
    assert "megatron-bridge" in named(req.nodeps)  # not the user's to move: kept
    assert req.key != base.key


def test_an_unknown_release_is_refused_before_any_build(tmp_path):
    """The release set reads the candidate's metadata first: a version the index lacks ends at once."""
    r = subprocess.run([sys.executable, "-I", str(ROOT / "harness" / "gate" / "envspec.py"), "key", "--cache", str(tmp_path),
                        "megatron-bridge==9.9.9"], capture_output=True, text=True, check=False)
    assert r.returncode == 2 and "megatron-bridge==9.9.9" in r.stderr and "Traceback" not in r.stderr
