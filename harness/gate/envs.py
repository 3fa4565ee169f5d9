"""`ckpt-harness envs list|prune`: the environments the gate and sweeps built, and their real cost.

Every env lives in the cache as `venv-<key>` (harness.gate.envspec) with its `ckpt-env.json`
(what was asked, the release set, pip freeze). uv-built envs share one package store by hard
links, so an env's own cost is the bytes of files no other env or the store links to: that is
what `list` shows and what `prune` gives back. `prune` never removes the env it runs in, nor
the baseline env of the current pins (scripts/test and scripts/smoke need it), nor an env a
build is writing (its lock is held).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness.gate import envspec


@dataclass(frozen=True)
class Env:
    path: Path
    key: str
    specs: tuple[str, ...]
    complete: bool
    own_bytes: int  # bytes of files only this env holds (hard links shared elsewhere not counted)
    total_bytes: int
    last_used: float  # newest mtime of the venv's marker files

    @property
    def label(self) -> str:
        return " ".join(self.specs) or "(the pins)"


def _sizes(venv: Path) -> tuple[int, int]:
    own = total = 0
    for top, _, files in os.walk(venv):
        for f in files:
            try:
                st = os.lstat(os.path.join(top, f))
            except OSError:
                continue
            total += st.st_size
            if st.st_nlink == 1:
                own += st.st_size
    return own, total


def _last_used(venv: Path) -> float:
    marks = [venv / ".complete", venv / envspec.ENV_JSON, venv / "bin" / "python"]
    return max((m.lstat().st_mtime for m in marks if os.path.lexists(m)), default=0.0)


def scan(cache: Path) -> list[Env]:
    out = []
    for venv in sorted(cache.glob("venv-*")):
        if not venv.is_dir():
            continue
        try:
            doc = json.loads((venv / envspec.ENV_JSON).read_text())
        except (OSError, ValueError):
            doc = {}
        own, total = _sizes(venv)
        out.append(Env(venv, venv.name.removeprefix("venv-"), tuple(doc.get("specs") or ()), (venv / ".complete").exists(),
                       own, total, _last_used(venv)))
    return out


def protected(cache: Path, root: Path) -> dict[Path, str]:
    """Envs prune must keep, each with why."""
    keep = {(cache / f"venv-{envspec.resolve(root, []).key}").resolve(): "the baseline of the current pins"}
    running = Path(sys.prefix).resolve()
    if running.parent == cache.resolve():
        keep[running] = "this command runs in it"
    return keep


def _locked(cache: Path, key: str) -> bool:
    lock = cache / f".lock-{key}"
    if not lock.exists():
        return False
    with open(lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def prune(cache: Path, root: Path, older_than_days: float = 0.0, dry_run: bool = False) -> list[tuple[Env, str]]:
    """Remove every env but the protected ones (and, with `older_than_days`, the recently used);
    returns (env, what happened) for each env considered."""
    keep = protected(cache, root)
    now = time.time()
    out = []
    for env in scan(cache):
        why = keep.get(env.path.resolve())
        if why is None and _locked(cache, env.key):
            why = "a build holds its lock"
        if why is None and older_than_days and now - env.last_used < older_than_days * 86400:
            why = f"used in the last {older_than_days:g} day(s)"
        if why is not None:
            out.append((env, f"kept: {why}"))
            continue
        if not dry_run:
            shutil.rmtree(env.path)
        out.append((env, "would remove" if dry_run else "removed"))
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.0f} MiB"


def store_bytes(cache: Path) -> int:
    store = cache / "uv-cache"
    return _sizes(store)[1] if store.exists() else 0


def run_cli(command: str, cache: Path, root: Path, older_than_days: float = 0.0, dry_run: bool = False) -> int:
    if command == "list":
        keep = protected(cache, root)
        envs = scan(cache)
        print(f"{'key':14} {'own':>10} {'files':>10}  {'last used':16}  specs")
        for e in envs:
            mark = " *" if e.path.resolve() in keep else ("" if e.complete else " (incomplete)")
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used)) if e.last_used else "-"
            print(f"{e.key:14} {_gib(e.own_bytes):>10} {_gib(e.total_bytes):>10}  {used:16}  {e.label}{mark}")
        print(f"{len(envs)} env(s); own bytes {_gib(sum(e.own_bytes for e in envs))}; shared package store "
              f"{_gib(store_bytes(cache))} ({cache / 'uv-cache'}); * = kept by prune")
        return 0
    for env, what in prune(cache, root, older_than_days, dry_run):
        print(f"{what:40} {env.key}  {env.label}  ({_gib(env.own_bytes)} own)")
    return 0
