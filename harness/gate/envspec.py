"""Environments as data: the pinned baseline, or a candidate = the baseline plus overrides.

Stdlib only: scripts/ensure-env runs this file with a bare Python 3.12 before any venv exists.

    python3.12 harness/gate/envspec.py ensure [--cache DIR] [--check-import] [SPEC ...]   # prints the venv path
    python3.12 harness/gate/envspec.py key [SPEC ...]                                      # prints the env key

A SPEC overrides one package (names are PEP 503-normalised):

    megatron-bridge==0.6.0                                            a released version
    megatron-bridge @ git+https://github.com/NVIDIA-NeMo/Megatron-Bridge@<sha>   a VCS URL at a commit
    ./Megatron-Bridge  or  /abs/path/Megatron-Bridge                  a local source tree (pyproject.toml)
    /path/megatron_bridge-0.6.2-py3-none-any.whl                      a wheel file
    megatron-bridge @ file:///abs/path/Megatron-Bridge                a source tree, as a requirements file has it
    megatron-bridge @ file:///abs/path/megatron_bridge-0.6.2-py3-none-any.whl   a wheel file, likewise
    megatron-bridge @ https://host/.../megatron_bridge-0.6.2-py3-none-any.whl[#sha256=HEX]   a wheel,
                                                                      downloaded once into <cache>/wheels

A direct reference (NAME @ file:... / http(s)://..., harness/gate/directref.py) is the tree or
wheel form: the NAME must be the tree's [project].name / the wheel's (normalised), and a
downloaded wheel is keyed by its content like a local one.

The resolved request is requirements.txt, requirements-nodeps.txt, constraints.txt,
requirements-verl.txt (the verl_manager backend's deps) and requirements-cluster.txt (the `cluster`
extra, harness.orchestration.schedulers.cluster; both installed with requirements.txt) with every
overridden package's pin dropped and the overrides added (to requirements-nodeps.txt when the
package is installed --no-deps there, e.g. megatron-bridge, whose declared deps are CUDA-only).
Its sha256 (12 hex) keys the venv, `cache/venv-<key>`: with no override the request is the five
files verbatim (`cat requirements.txt requirements-nodeps.txt constraints.txt requirements-verl.txt
requirements-cluster.txt | sha256sum`), so a fresh clone finds the cached baseline venv again. A source tree's and a wheel's content hash is part of the request, so an
edited tree gets a new venv instead of a stale one.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if not __package__:  # run as a file (scripts/ensure-env: python3.12 -I): the checkout's harness is importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.gate import directref  # noqa: E402
from harness.gate.installers import (  # noqa: E402
    HELD_LOCKS,
    UV_JSON,
    EnvBuildError,
    Uv,
    freeze_command,
    installer,
    pip_command,
    run_logged,
    tail,
)
from harness.gate.releases import UnsolvableReleaseSet  # noqa: E402
from harness.gate.source_digest import _file_sha256, _git, tree_digest  # noqa: E402,F401  (tree_digest: callers import it here)

REQUIREMENTS, NODEPS, CONSTRAINTS = "requirements.txt", "requirements-nodeps.txt", "constraints.txt"
VERL = "requirements-verl.txt"  # the verl_manager backend's deps: installed with REQUIREMENTS, part of the key
CLUSTER = "requirements-cluster.txt"  # the `cluster` extra (pyproject reads it): the test suite runs it, so the venv has it
ENV_JSON = "ckpt-env.json"
REQUEST_DIR = ".ckpt-request"  # inside the venv: the exact files pip was given
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_VERSION = re.compile(rf"^({_NAME})\s*==\s*([A-Za-z0-9][A-Za-z0-9.+!_-]*)$")
_VCS = re.compile(rf"^({_NAME})\s*@\s*(git\+(?:https?|ssh|file)://\S+)$")
_LINE_NAME = re.compile(rf"^\s*({_NAME})")
_COMMIT = re.compile(r"^[0-9a-fA-F]{7,40}$")
FORMS = ("NAME==VERSION, NAME @ git+URL@COMMIT, a source directory (./path or /path), a .whl file, "
         "NAME @ file:///path (a source directory or .whl) or NAME @ https://.../NAME-VERSION-....whl")


def normalize(name: str) -> str:
    """PEP 503: `Megatron_Bridge` and `megatron-bridge` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Override:
    spec: str  # as given
    kind: str  # version | vcs | tree | wheel
    name: str  # normalised
    requirement: str  # the line pip gets
    version: str | None = None
    url: str | None = None
    commit: str | None = None
    path: str | None = None
    digest: str | None = None  # sha256 of a wheel file / of a tree's files


def _vcs_commit(url: str, spec: str) -> str:
    rest = url.split("#", 1)[0].split("://", 1)[1]
    path = rest.split("/", 1)[1] if "/" in rest else ""
    ref = path.rsplit("@", 1)[1] if "@" in path else ""
    if not _COMMIT.match(ref):
        raise ValueError(f"{spec!r}: a VCS URL must end in @<commit sha> (got {ref or 'no ref'!r}): "
                         "a branch or tag moves, and the venv keyed on the URL would go stale")
    return ref


def _same_name(spec: str, named: str | None, name: str, what: str) -> None:
    """A direct reference's NAME must be the package it points at (pip refuses the install otherwise)."""
    if named is not None and normalize(named) != name:
        raise ValueError(f"{spec!r}: the spec names {normalize(named)!r} but {what} is {name!r}")


def _wheel(spec: str, p: Path, named: str | None = None, url: str | None = None) -> Override:
    if not p.is_file():
        raise ValueError(f"{spec!r}: no such wheel file {p}")
    parts = p.name[: -len(".whl")].split("-")
    if len(parts) not in (5, 6) or not all(parts):
        raise ValueError(f"{spec!r}: not a wheel filename (NAME-VERSION[-BUILD]-PY-ABI-PLATFORM.whl)")
    name = normalize(parts[0])
    _same_name(spec, named, name, f"the wheel {p.name}")
    return Override(spec, "wheel", name, f"{name} @ {p.as_uri()}", version=parts[1], url=url, path=str(p), digest=_file_sha256(p))


def _tree(spec: str, d: Path, named: str | None = None) -> Override:
    if not d.is_dir():
        raise ValueError(f"{spec!r}: no such directory {d} (a SPEC is {FORMS})")
    try:
        name = tomllib.loads((d / "pyproject.toml").read_text())["project"]["name"]
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{spec!r}: {d} has no readable pyproject.toml with [project].name ({exc!r})") from exc
    name = normalize(name)
    _same_name(spec, named, name, f"the source tree {d} (its pyproject.toml [project].name)")
    top = _git(d, "rev-parse", "--show-toplevel")
    git = top is not None and Path(top.strip()).resolve() == d
    commit = ((_git(d, "rev-parse", "HEAD") or "").strip() or None) if git else None
    return Override(spec, "tree", name, f"{name} @ {d.as_uri()}", commit=commit, path=str(d), digest=tree_digest(d, git))


def _direct(spec: str, named: str, url: str, cwd: Path | None, cache: Path | None) -> Override:
    """NAME @ file:... (a tree or a wheel file) or NAME @ http(s)://....whl (downloaded once into the cache)."""
    if directref.is_file_url(url):
        p = directref.file_path(spec, url, cwd or Path.cwd())
        return _wheel(spec, p, named) if p.name.endswith(".whl") else _tree(spec, p, named)
    return _wheel(spec, directref.fetch_wheel(spec, url, cache or _default_cache()), named, url=url)


def parse_spec(spec: str, cwd: Path | None = None, cache: Path | None = None) -> Override:
    """One SPEC -> Override; ValueError naming the spec when it is none of the forms. A wheel URL
    is downloaded (once) into `cache` (default: _default_cache())."""
    s = spec.strip()
    if direct := directref.match(s):
        return _direct(spec, *direct, cwd, cache)
    if directref.STARTS.match(s):
        raise ValueError(f"{spec!r}: a URL holds no spaces: percent-encode them (%20)")
    if m := _VCS.match(s):
        name, url = normalize(m[1]), m[2]
        return Override(spec, "vcs", name, f"{name} @ {url}", url=url, commit=_vcs_commit(url, spec))
    if m := _VERSION.match(s):
        name = normalize(m[1])
        return Override(spec, "version", name, f"{name}=={m[2]}", version=m[2])
    if s.startswith("git+"):
        raise ValueError(f"{spec!r}: name the package: NAME @ git+URL@COMMIT")
    if s and (s.endswith(".whl") or "/" in s or s.startswith((".", "~"))):
        p = Path(s).expanduser()
        p = (p if p.is_absolute() else (cwd or Path.cwd()) / p).resolve()
        return _wheel(spec, p) if s.endswith(".whl") else _tree(spec, p)
    raise ValueError(f"{spec!r}: not a SPEC: expected {FORMS}")


def _names(text: str) -> set[str]:
    return {normalize(m[1]) for line in text.splitlines() if (m := _LINE_NAME.match(line))}


def _drop(text: str, names: set[str]) -> str:
    """The file without the lines pinning `names` (comments, options and other pins kept verbatim)."""
    return "".join(ln for ln in text.splitlines(keepends=True) if not ((m := _LINE_NAME.match(ln)) and normalize(m[1]) in names))


def _append(text: str, lines: list[str]) -> str:
    if not lines:
        return text
    sep = "" if not text or text.endswith("\n") else "\n"
    return text + sep + "# candidate overrides (harness/gate/envspec.py)\n" + "".join(f"{ln}\n" for ln in lines)


@dataclass(frozen=True)
class Request:
    """What pip is asked for: the five files' resolved texts, plus the overrides they came from."""

    requirements: str
    nodeps: str
    constraints: str
    overrides: tuple[Override, ...] = ()
    verl: str = ""
    cluster: str = ""

    @property
    def text(self) -> str:
        body = self.requirements + self.nodeps + self.constraints + self.verl + self.cluster
        if not self.overrides:
            return body  # == `cat requirements.txt requirements-nodeps.txt constraints.txt requirements-verl.txt requirements-cluster.txt`
        return body + "".join(f"# {o.kind} {o.name}: commit={o.commit} sha256={o.digest}\n" for o in self.overrides)

    @property
    def key(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:12]


def _read(root: Path, name: str) -> str:
    return (root / name).read_bytes().decode("utf-8")  # bytes as `cat` sees them (no newline translation)


def resolve(root: Path, overrides: list[Override], release_set: Any = None) -> Request:
    """The four files with every overridden pin dropped and the overrides added; with a
    `release_set` (harness.gate.releases) also the pins its companions move (and their dependents)
    dropped and the companions' ranges added, so pip re-resolves them instead of keeping them."""
    names = [o.name for o in overrides]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"{', '.join(dup)}: overridden more than once")
    req, nodeps, cons = _read(root, REQUIREMENTS), _read(root, NODEPS), _read(root, CONSTRAINTS)
    verl = _read(root, VERL) if (root / VERL).exists() else ""
    cluster = _read(root, CLUSTER) if (root / CLUSTER).exists() else ""
    if not overrides:
        return Request(req, nodeps, cons, verl=verl, cluster=cluster)
    dropped, no_deps = set(names), _names(nodeps)
    moved = (release_set.drop_names() - no_deps) if release_set is not None else set()
    extra = list(release_set.extra_specs()) if release_set is not None else []
    return Request(
        _append(_drop(req, dropped | moved), [o.requirement for o in overrides if o.name not in no_deps] + extra),
        _append(_drop(nodeps, dropped), [o.requirement for o in overrides if o.name in no_deps]),
        _drop(cons, dropped | moved),
        tuple(overrides),
        verl=_drop(verl, dropped | moved),
        cluster=_drop(cluster, dropped | moved),
    )


def release_set(specs: list[str], root: Path, cache: Path) -> Any:
    """What else must move with these overrides (harness.gate.releases): companions from the
    candidates' own metadata and the Bridge -> Core pairing, printed before anything is built.
    Raises releases.UnsolvableReleaseSet (one line per conflict) or LookupError."""
    from harness.gate import releases

    baseline = cache / f"venv-{resolve(root, []).key}"
    rs = releases.resolve_release_set(specs, root, baseline if (baseline / ".complete").exists() else None, cache=cache)
    print(rs.text(), file=sys.stderr)
    return rs


def _has_requirements(text: str) -> bool:
    return any(_LINE_NAME.match(ln) for ln in text.splitlines())


def _write_env_json(venv: Path, specs: list[str], req: Request, rs: Any = None) -> None:
    """Provenance next to the venv: what was asked (specs, overrides) and what pip installed."""
    r = subprocess.run(freeze_command(venv), capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise EnvBuildError(f"{tail(r.stdout + r.stderr)}\nckpt-harness: pip freeze failed in {venv}")
    freeze = r.stdout.splitlines()
    installed = {normalize(m[1]): ln for ln in freeze if (m := _LINE_NAME.match(ln))}
    doc = {
        "specs": specs,
        "key": req.key,
        "overrides": [{**asdict(o), "installed": installed.get(o.name)} for o in req.overrides],
        "release_set": rs.to_dict() if rs is not None else None,
        "pip_freeze": freeze,
    }
    (venv / ENV_JSON).write_text(json.dumps(doc, indent=2) + "\n")


def _python(python: str | None) -> str:
    if python:
        return python
    if sys.version_info[:2] == (3, 12):
        from harness.gate.metadata import python_with_pip  # a uv-made venv (the gate's own) has no pip

        return python_with_pip()
    raise EnvBuildError(f"ckpt-harness: building a venv needs Python 3.12 (megatron-bridge 0.6.x requires it), this is "
                        f"{sys.version.split()[0]}: run this file with python3.12 (scripts/ensure-env finds one; CKPT_HARNESS_PYTHON names it)")


def _build(venv: Path, req: Request, specs: list[str], cache: Path, python: str, root: Path, rs: Any = None) -> None:
    shutil.rmtree(venv, ignore_errors=True)  # only ever our own half-built venv under the cache dir
    how = installer()
    print(f"ckpt-harness: building environment {venv} with {how} (first run: ~5 min, ~6 GB; "
          f"{'later envs share its package store' if how == 'uv' else 'every env a full copy'})", file=sys.stderr)
    log = cache / f"install-{req.key}.log"
    log.write_text("")
    uv = Uv.configured(root, cache, python, log) if how == "uv" else None
    if uv:
        uv.venv(python, venv, log)
    else:
        run_logged([python, "-m", "venv", str(venv)], log)
    files = venv / REQUEST_DIR
    files.mkdir()
    withs = ((VERL, req.verl), (CLUSTER, req.cluster))
    for name, text in ((REQUIREMENTS, req.requirements), (NODEPS, req.nodeps), (CONSTRAINTS, req.constraints), *withs):
        (files / name).write_text(text)
    extra = [a for name, text in withs if _has_requirements(text) for a in ("-r", str(files / name))]
    main_args = ["-r", str(files / REQUIREMENTS), *extra, "-c", str(files / CONSTRAINTS)]
    nodeps_args = ["--no-deps", "-r", str(files / NODEPS)] if _has_requirements(req.nodeps) else []
    if uv:
        (venv / UV_JSON).write_text(json.dumps({"uv": str(uv.binary), "store": str(uv.store), "python": python}) + "\n")
        # a source tree is built afresh: uv keys its cached build of a local directory by path and
        # pyproject.toml, so a bisect's worktree (one path, many commits) got an earlier commit's build
        fresh = [a for o in req.overrides if o.kind == "tree" for a in ("--refresh-package", o.name, "--reinstall-package", o.name)]
        uv.install(venv, [*main_args, *fresh], log)
        if nodeps_args:
            uv.install(venv, [*nodeps_args, *fresh], log)
    else:
        pip = pip_command(venv)
        run_logged([*pip, "install", "--upgrade", "pip"], log)
        run_logged([*pip, "install", *main_args], log)
        if nodeps_args:
            run_logged([*pip, "install", *nodeps_args], log)
    _write_env_json(venv, specs, req, rs)
    (venv / ".complete").touch()


_POINTS_AT = ("import sys, pathlib, harness; sys.exit(0 if pathlib.Path(harness.__file__).resolve().parent.parent"
              " == pathlib.Path(sys.argv[1]).resolve() else 1)")


def _ensure_editable(venv: Path, root: Path, cache: Path, key: str) -> None:
    """The harness itself, editable, pointed at this checkout (cheap; re-pointed when the clone moves)."""
    py = venv / "bin" / "python"
    if (venv / "bin" / "ckpt-harness").exists() and subprocess.run(
        [str(py), "-I", "-c", _POINTS_AT, str(root)], capture_output=True, check=False
    ).returncode == 0:
        return
    log = cache / f"editable-{key}.log"
    log.write_text("")
    try:
        if (venv / UV_JSON).exists() and not os.environ.get("CKPT_HARNESS_PIP"):
            uv = json.loads((venv / UV_JSON).read_text())
            Uv.configured(root, Path(uv["store"]).parent, uv["python"], log).install(
                venv, ["--no-deps", "-e", str(root)], log)
        else:
            run_logged([*pip_command(venv), "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(root)], log)
    except EnvBuildError as exc:
        raise EnvBuildError(f"{exc}\nckpt-harness: the editable harness install failed") from None


def ensure(specs: list[str], cache: Path, root: Path, python: str | None = None, companions: bool = True) -> Path:
    """Build (once) or reuse the venv of baseline + `specs`; returns its path. Raises ValueError for a
    bad spec, EnvBuildError when pip fails (with the log tail and the log's path)."""
    overrides = [parse_spec(s, cache=cache) for s in specs]
    rs = release_set(specs, root, cache) if overrides and companions else None
    req = resolve(root, overrides, rs)
    cache.mkdir(parents=True, exist_ok=True)
    venv = cache / f"venv-{req.key}"
    with open(cache / f".lock-{req.key}", "w") as lock:  # same lock file and flock(2) as the old bash
        fcntl.flock(lock, fcntl.LOCK_EX)
        HELD_LOCKS.append(lock.fileno())
        try:
            if not (venv / ".complete").exists():
                _build(venv, req, specs, cache, _python(python), root, rs)
            elif not (venv / ENV_JSON).exists():  # built before this file existed
                _write_env_json(venv, specs, req, rs)
            _ensure_editable(venv, root, cache, req.key)
        finally:
            HELD_LOCKS.remove(lock.fileno())
    return venv


_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def check_import(venv: Path, modules: tuple[str, ...] = ("megatron.core", "megatron.bridge"), root: Path | None = None) -> None:
    """Import `modules` in the venv's own python; EnvBuildError with the stderr tail when one fails.
    megatron.bridge goes through harness.compat's import (Bridge 0.6.x imports Transformer-Engine
    unguarded; the harness answers that import with a stub on CPU), as the cases do."""
    if bad := [m for m in modules if not _MODULE.match(m)]:
        raise ValueError(f"not module names: {bad}")
    code = ["from harness.compat.cuda import guard_megatron_import; guard_megatron_import()", *(f"import {m}" for m in modules)]
    if any(m == "megatron.bridge" or m.startswith("megatron.bridge.") for m in modules):
        code.insert(1, "from harness.compat.te import import_megatron_bridge; import_megatron_bridge()")
    r = subprocess.run([str(venv / "bin" / "python"), "-W", "ignore", "-c", "\n".join(code)], capture_output=True, text=True,
                       cwd=root or Path(__file__).resolve().parents[2], check=False)
    if r.returncode != 0:
        raise EnvBuildError(f"{tail(r.stderr)}\nckpt-harness: {', '.join(modules)} do not import in {venv}")


def _default_cache() -> Path:
    return Path(os.environ.get("CKPT_HARNESS_HOME") or Path.home() / ".cache" / "ckpt-harness")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="envspec.py", description="Build or reuse the venv of the pins plus SPEC overrides.")
    sub = parser.add_subparsers(dest="command", required=True)
    for cmd in ("ensure", "key"):
        p = sub.add_parser(cmd, help="print the venv path (building it once)" if cmd == "ensure" else "print the env key")
        p.add_argument("specs", nargs="*", metavar="SPEC")
        p.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2], help="the harness checkout")
        p.add_argument("--cache", type=Path, default=_default_cache(), help="default: $CKPT_HARNESS_HOME or ~/.cache/ckpt-harness")
        p.add_argument("--exact", action="store_true",
                       help="override only what is named: no release-set companions (reads no package metadata)")
        if cmd == "ensure":
            p.add_argument("--check-import", action="store_true", help="also import megatron.core and megatron.bridge in it")
    args = parser.parse_args(argv)
    try:
        if args.command == "key":
            overrides = [parse_spec(s, cache=args.cache) for s in args.specs]
            rs = release_set(args.specs, args.root, args.cache) if overrides and not args.exact else None
            print(resolve(args.root, overrides, rs).key)
            return 0
        venv = ensure(args.specs, args.cache, args.root, companions=not args.exact)  # built with this python (3.12)
        if args.check_import:
            check_import(venv, root=args.root)
    except (EnvBuildError, ValueError, OSError, LookupError) as exc:  # UnsolvableReleaseSet is caught first
        print(f"ckpt-harness: {exc}" if isinstance(exc, (ValueError, LookupError)) else str(exc), file=sys.stderr)
        return 2
    except UnsolvableReleaseSet as exc:  # one line per conflicting requirement
        print("ckpt-harness: the release set cannot be installed:\n" + "\n".join(f"  {ln}" for ln in exc.lines), file=sys.stderr)
        return 2
    print(venv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
