"""Save once, load many: a run's store of source worlds (a world that writes a checkpoint, and
what its ranks returned), shared by every case of the run and every `--jobs` worker.

Ten cases that build the same model at the same source topology with the same options and save
it through the same backend differ only in where they load it; the store runs that world once.
The key is everything that decides the bytes: the rank function, its whole argument (model spec
with its seed, topology, dtype, backend and its options, steps...), the world's topology, the
dist backend and launcher, and the versions of the packages that write them. A world whose
argument names the case's own scratch directory is never stored (its input is that case's alone).

The first case with a key runs the world into the store under a file lock (another worker asking
for the same key waits for it) and records a sha256 manifest of every file it wrote. Every case
that used an entry, writer included, re-hashes it when it ends (`SourceStore.verify`): a loader
that wrote into a source fails the `source-unchanged` check, and the entry is set aside under
another name, so no later case reads the damage."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from filelock import FileLock

#: the packages whose versions decide what a source world writes (and what its ranks return)
KEY_PACKAGES = ("torch", "megatron-core", "megatron-bridge", "transformers", "peft", "safetensors", "verl", "numpy")
#: where a source world's outputs go, in the argument the key is computed from
PLACEHOLDER = Path("/<source>")
#: the check every case that used a stored source gets (harness.orchestration.runner)
SOURCE_UNCHANGED = "source-unchanged"
_DATA, _META, _VALUES = "data", "source.json", "values.pkl"


@lru_cache(maxsize=1)
def versions() -> dict[str, str]:
    """The installed versions of KEY_PACKAGES ("-" for one not installed), and Python's."""
    out = {"python": sys.version.split()[0]}
    for name in KEY_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "-"
    return out


def source_key(fn: Callable | str, arg: Any, topo: Any, knobs: dict[str, Any], package_versions: dict[str, str] | None = None) -> str:
    """The sha256 of everything that decides a source world's bytes: the rank function (by module
    and qualified name, or a name), `arg` (its repr, with outputs under PLACEHOLDER), `topo`, the launch
    `knobs` (dist backend, launcher) and the package versions (this environment's by default).
    Raises ValueError for an argument whose repr is not a value (an object shown by address)."""
    text = repr(arg)
    if " at 0x" in text:
        raise ValueError(f"a source world's argument must be a plain value to be keyed, got {text[:200]}")
    doc = {"fn": fn if isinstance(fn, str) else f"{fn.__module__}.{fn.__qualname__}", "arg": text, "topo": repr(topo), "knobs": knobs,
           "versions": versions() if package_versions is None else package_versions}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def manifest(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`, by path relative to it."""
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        out[str(path.relative_to(root))] = h.hexdigest()
    return out


def manifest_diff(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """What changed between two manifests, one line a file: changed, removed, added."""
    return ([f"changed {p}" for p in sorted(before) if p in after and after[p] != before[p]]
            + [f"removed {p}" for p in sorted(set(before) - set(after))]
            + [f"added {p}" for p in sorted(set(after) - set(before))])


@dataclass
class SourceUse:
    """One case's use of a stored source (results.json `reuse`)."""

    phase: str
    key: str  # the first 16 hex digits of the key: the entry's name in the store
    role: str  # "wrote" | "reused"
    writer: str  # the id of the case that ran the world
    world_s: float  # how long the writer's world took (what a reuse saved)
    wait_s: float  # how long this case waited for the store's lock

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class SourceStore:
    """A directory of source entries `<key16>/` ({data/, source.json, values.pkl}), one lock file each."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def get_or_make(self, key: str, phase: str, case_id: str, make: Callable[[Path], Any]) -> tuple[Path, Any, SourceUse]:
        """(the entry's data directory, the world's values, this use): the stored ones when the key
        was written before, else `make(data_dir)`'s, stored for the next case. `make` must write
        every output under the directory it gets; a `make` that raises leaves no entry."""
        name = key[:16]
        entry = self.root / name
        start = time.perf_counter()
        with FileLock(str(self.root / f"{name}.lock")):
            wait = round(time.perf_counter() - start, 3)
            if (entry / _META).is_file():
                info = json.loads((entry / _META).read_text())
                with (entry / _VALUES).open("rb") as f:
                    values = pickle.load(f)
                return entry / _DATA, values, SourceUse(phase, name, "reused", info["writer"], info["world_s"], wait)
            shutil.rmtree(entry, ignore_errors=True)  # what a failed make left (ours: a store entry)
            (entry / _DATA).mkdir(parents=True)
            begin = time.perf_counter()
            try:
                values = make(entry / _DATA)
            except BaseException:
                shutil.rmtree(entry, ignore_errors=True)
                raise
            world_s = round(time.perf_counter() - begin, 3)
            with (entry / _VALUES).open("wb") as f:
                pickle.dump(values, f, protocol=pickle.HIGHEST_PROTOCOL)
            info = {"key": key, "phase": phase, "writer": case_id, "world_s": world_s, "manifest": manifest(entry / _DATA)}
            tmp = entry / f"{_META}.tmp"
            tmp.write_text(json.dumps(info, indent=1))
            os.replace(tmp, entry / _META)  # last: an entry without it is unfinished
        return entry / _DATA, values, SourceUse(phase, name, "wrote", case_id, world_s, wait)

    def verify(self, use: SourceUse) -> list[str]:
        """What differs in `use`'s entry from the manifest taken when it was written (empty: intact).
        A changed entry is renamed `<key16>.changed-<pid>-<n>` (kept for inspection) so the next
        case with its key writes it anew."""
        entry = self.root / use.key
        with FileLock(str(self.root / f"{use.key}.lock")):
            if not (entry / _META).is_file():
                return [f"the entry {use.key} left the store before this case ended"]
            before = json.loads((entry / _META).read_text())["manifest"]
            problems = manifest_diff(before, manifest(entry / _DATA))
            if problems:
                n = sum(1 for _ in self.root.glob(f"{use.key}.changed-*"))
                entry.rename(self.root / f"{use.key}.changed-{os.getpid()}-{n}")
        return problems
