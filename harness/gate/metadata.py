"""Package metadata for release sets (harness/gate/releases.py): the `packaging` loader, what a
candidate declares (`Metadata` from a wheel, a source tree or the package index), version logic
(`compatible`), and the project's pins (`read_pins`) and baseline venv (`baseline_requires`).

Stdlib only, like releases.py (envspec imports that, and scripts/ensure-env runs envspec with a
bare python3.12); version logic comes from `packaging` when importable, else pip's vendored copy.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import asdict, dataclass
from email.parser import HeaderParser
from pathlib import Path
from typing import Iterable


def _packaging():
    """`packaging` when importable, else pip's vendored copy, found through sysconfig's purelib when
    the interpreter runs with -S (envspec's own tests run it `python -I -S`)."""
    try:
        import packaging.requirements  # noqa: F401
        return "packaging"
    except ImportError:
        pass
    try:
        import pip._vendor.packaging.requirements  # noqa: F401
        return "pip._vendor.packaging"
    except ImportError:
        import sysconfig
        sys.path.append(sysconfig.get_paths()["purelib"])
        try:
            import pip._vendor.packaging.requirements  # noqa: F401
        finally:
            sys.path.remove(sysconfig.get_paths()["purelib"])
        return "pip._vendor.packaging"


_PKG = _packaging()
_m = {n: importlib.import_module(f"{_PKG}.{n}") for n in ("requirements", "specifiers", "utils", "version")}
InvalidRequirement, Requirement = _m["requirements"].InvalidRequirement, _m["requirements"].Requirement
SpecifierSet, canonicalize_name = _m["specifiers"].SpecifierSet, _m["utils"].canonicalize_name
InvalidVersion, Version = _m["version"].InvalidVersion, _m["version"].Version

BRIDGE, CORE = "megatron-bridge", "megatron-core"
PIN_FILES = ("requirements.txt", "constraints.txt", "requirements-verl.txt")  # pins a release set may move
NODEPS = "requirements-nodeps.txt"  # installed --no-deps: pins there are only moved by the user
# Markers are evaluated for the venv the harness builds: CPython 3.12 on Linux x86_64.
MARKER_ENV = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
              "platform_system": "Linux", "os_name": "posix", "platform_machine": "x86_64",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_PIN = re.compile(rf"^\s*({_NAME})\s*==\s*([^\s;#]+)")
_EXTRA = re.compile(r"\bextra\s*==")


def normalize(name: str) -> str:
    """PEP 503 (same as envspec.normalize)."""
    return canonicalize_name(name)


@dataclass(frozen=True)
class Metadata:
    """What a candidate declares: its version (when known) and its Requires-Dist lines."""

    name: str
    version: str | None
    requires: tuple[str, ...] = ()
    origin: str = ""  # where it was read (a wheel file name, pyproject.toml, ...)
    core_version: str | None = None  # a Bridge source tree's 3rdparty/Megatron-LM Core version
    note: str | None = None  # why something could not be read


# ---------------------------------------------------------------- metadata sources


def _requires_from_metadata(text: str) -> tuple[str | None, str | None, tuple[str, ...]]:
    msg = HeaderParser().parsestr(text)
    return msg.get("Name"), msg.get("Version"), tuple(msg.get_all("Requires-Dist") or ())


def read_wheel(path: Path) -> Metadata:
    """A wheel's *.dist-info/METADATA (no install, no build)."""
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if not names:
            raise ValueError(f"{path}: no .dist-info/METADATA in the wheel")
        name, version, requires = _requires_from_metadata(z.read(names[0]).decode("utf-8"))
    return Metadata(normalize(name or path.name.split("-")[0]), version, requires, origin=path.name)


def _package_info_version(path: Path) -> str | None:
    """MAJOR.MINOR.PATCH+PRE_RELEASE of a Megatron package_info.py, read as text (never executed)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    parts = {}
    for key in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE"):
        m = re.search(rf"^{key}\s*=\s*['\"]?([^'\"\n]*)['\"]?\s*$", text, re.M)
        parts[key] = m[1].strip() if m else ""
    if not (parts["MAJOR"] and parts["MINOR"]):
        return None
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH'] or 0}{parts['PRE_RELEASE']}"


def read_tree(path: Path) -> Metadata:
    """A source tree's pyproject.toml [project] (name, static version, dependencies); a Megatron tree's
    version from its package_info.py; a Bridge tree's 3rdparty/Megatron-LM Core version when checked out."""
    project = tomllib.loads((path / "pyproject.toml").read_text()).get("project", {})
    name = normalize(project.get("name", path.name))
    version = project.get("version")
    if not version and name in (BRIDGE, CORE):
        sub = "bridge" if name == BRIDGE else "core"
        for p in (path / "src" / "megatron" / sub / "package_info.py", path / "megatron" / sub / "package_info.py"):
            if version := _package_info_version(p):
                break
    core = _package_info_version(path / "3rdparty" / "Megatron-LM" / "megatron" / "core" / "package_info.py") if name == BRIDGE else None
    return Metadata(name, version, tuple(project.get("dependencies", ())), origin=f"{path}/pyproject.toml", core_version=core)


class MetadataSource:
    """Where a candidate's metadata comes from; tests replace `index` with fakes (no network)."""

    def index(self, requirement: str) -> Metadata:
        """The newest release matching `requirement` (NAME==V or a range) on the package index."""
        raise NotImplementedError

    def versions(self, name: str) -> list[str]:
        """The final releases of `name` on the index, newest first; [] when the source cannot list them
        (a dropped dependent is then left to pip, as before)."""
        return []

    def wheel(self, path: Path) -> Metadata:
        return read_wheel(path)

    def tree(self, path: Path) -> Metadata:
        return read_tree(path)


def default_cache() -> Path:
    return Path(os.environ.get("CKPT_HARNESS_HOME") or Path.home() / ".cache" / "ckpt-harness")


def python_with_pip() -> str:
    """This interpreter when it has pip, else the one its venv was made from: uv makes venvs without
    pip, and the index metadata, pip's index config and uv's own bootstrap all ask pip."""
    if importlib.util.find_spec("pip") is not None:
        return sys.executable
    return getattr(sys, "_base_executable", None) or sys.executable


class PipIndex(MetadataSource):
    """`pip download --no-deps --only-binary=:all: --python-version 3.12` (pip's own index config),
    METADATA read from the wheel, the parse cached as JSON under <cache>/metadata (exact pins only:
    the newest match of a range moves)."""

    def __init__(self, cache: Path | None = None, pip: list[str] | None = None):
        self.dir = (cache or default_cache()) / "metadata"
        self.pip = pip or [python_with_pip(), "-m", "pip"]

    def index(self, requirement: str) -> Metadata:
        req = Requirement(requirement)
        exact = [s.version for s in req.specifier if s.operator == "==" and "*" not in s.version]
        cached = self.dir / f"{normalize(req.name)}-{exact[0]}.json" if len(exact) == 1 else None
        if cached and cached.exists():
            doc = json.loads(cached.read_text())
            return Metadata(**{**doc, "requires": tuple(doc["requires"])})
        self.dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.dir) as tmp:
            cmd = [*self.pip, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "-d", tmp, requirement]
            r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
            wheels = sorted(Path(tmp).glob("*.whl"))
            if r.returncode != 0 or not wheels:
                tail = " / ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
                raise LookupError(f"cannot read the metadata of {requirement} from the package index: {tail}")
            meta = read_wheel(wheels[0])
        meta = Metadata(meta.name, meta.version, meta.requires, origin=f"index: {meta.origin}")
        if meta.version:
            (self.dir / f"{meta.name}-{meta.version}.json").write_text(json.dumps(asdict(meta), indent=1) + "\n")
        return meta

    def versions(self, name: str) -> list[str]:
        """`pip index versions` (pip's index config, Python 3.12 wheels); pre-releases left out."""
        cmd = [*self.pip, "index", "versions", name, "--python-version", "3.12", "--only-binary=:all:"]
        r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("Available versions:")), "")
        out = []
        for v in line.partition(":")[2].split(","):
            try:
                if v.strip() and not Version(v.strip()).is_prerelease:
                    out.append(v.strip())
            except InvalidVersion:
                continue
        return sorted(out, key=Version, reverse=True)


# ---------------------------------------------------------------- version logic


def _probes(specs: Iterable[SpecifierSet]) -> list[Version]:
    """Versions around every bound the specifiers name: enough to find a common version of the
    specifier sets that occur in practice (a found probe proves the sets intersect)."""
    out = {Version("0"), Version("0.0.1")}
    for ss in specs:
        for s in ss:
            try:
                v = Version(s.version.rstrip(".*"))
            except InvalidVersion:
                continue
            r = v.release
            out |= {v, Version(v.base_version), Version(".".join(map(str, (*r, 1)))), Version(".".join(map(str, (*r, 0, 1))))}
            for i in range(len(r)):
                out.add(Version(".".join(map(str, (*r[:i], r[i] + 1)))))
                if r[i] > 0:
                    out.add(Version(".".join(map(str, (*r[:i], r[i] - 1, 999)))))
    return sorted(out)


def compatible(*specs: SpecifierSet) -> bool:
    """Whether some version satisfies every specifier set (probe-based; pre-releases allowed)."""
    if all(len(s) == 0 for s in specs):
        return True
    return any(all(s.contains(v, prereleases=True) for s in specs) for v in _probes(specs))


def _satisfies(version: str, spec: SpecifierSet) -> bool:
    try:
        return spec.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def _applies(req: Requirement) -> bool:
    """A Requires-Dist line that is installed: no `extra ==` marker, platform markers true for linux/3.12."""
    if req.marker is None:
        return True
    if _EXTRA.search(str(req.marker)):
        return False
    return bool(req.marker.evaluate(MARKER_ENV))


def _parse_requires(lines: Iterable[str]) -> list[Requirement]:
    out = []
    for ln in lines:
        try:
            req = Requirement(ln)
        except InvalidRequirement:
            continue
        if _applies(req):
            out.append(req)
    return out


# ---------------------------------------------------------------- the project's pins and the baseline venv


def read_pins(root: Path) -> tuple[dict[str, str], dict[str, list[str]]]:
    """name -> pinned version, and name -> the files pinning it (requirements-nodeps.txt included)."""
    versions: dict[str, str] = {}
    files: dict[str, list[str]] = {}
    for fname in (*PIN_FILES, NODEPS):
        p = root / fname
        if not p.exists():
            continue
        for ln in p.read_text().splitlines():
            if m := _PIN.match(ln):
                name = normalize(m[1])
                versions.setdefault(name, m[2])
                files.setdefault(name, []).append(fname)
    return versions, files


def baseline_requires(venv: Path | None) -> dict[str, list[Requirement]]:
    """Each installed distribution's applicable Requires-Dist in the baseline venv (who depends on whom)."""
    if venv is None:
        return {}
    out: dict[str, list[Requirement]] = {}
    for md in sorted(venv.glob("lib/python3.12/site-packages/*.dist-info/METADATA")):
        name, _, requires = _requires_from_metadata(md.read_text(errors="replace"))
        if name:
            out[normalize(name)] = _parse_requires(requires)
    return out
