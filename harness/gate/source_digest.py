"""What identifies a source tree or a wheel the gate installs: a sha256 of its content, so the same
content keys the same environment (harness/gate/envspec.py). Standard library only: scripts/ensure-env
runs envspec with `python -I` before any venv exists."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

# Build products pip/setuptools write into a source tree when installing it: not part of its identity.
_BUILD_ARTEFACTS = {".git", "__pycache__", "build", "dist", ".eggs", ".tox", ".venv", ".pytest_cache"}


def _git(d: Path, *args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(d), *args], capture_output=True, text=True, check=False)
    except OSError:
        return None
    return r.stdout if r.returncode == 0 else None


def _file_sha256(p: Path) -> str:
    h = hashlib.sha256()
    with p.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _skipped(rel: str) -> bool:
    parts = rel.split("/")
    return any(p in _BUILD_ARTEFACTS or p.endswith(".egg-info") for p in parts) or rel.endswith(".pyc")


def tree_digest(d: Path, git: bool) -> str:
    """sha256 over (path, content) of a tree's files: git-tracked plus untracked-not-ignored in a
    checkout (edits not yet committed count), every file otherwise; build products excluded."""
    if git:
        listed = _git(d, "ls-files", "-z", "--cached", "--others", "--exclude-standard") or ""
        rels = sorted({r for r in listed.split("\0") if r})
    else:
        rels = []
        for top, dirs, files in os.walk(d):
            dirs[:] = [x for x in dirs if not _skipped(x)]  # never walk into build/, .venv/, ...
            rels += [str((Path(top) / f).relative_to(d)) for f in files]
        rels.sort()
    h = hashlib.sha256()
    for rel in rels:
        p = d / rel
        if _skipped(rel):
            continue
        if p.is_symlink():
            content = "link:" + os.readlink(p)
        elif p.is_file():
            content = _file_sha256(p)
        else:  # a submodule (gitlink) or a tracked file deleted in the work tree
            continue
        h.update(f"{rel}\0{content}\n".encode())
    return h.hexdigest()
