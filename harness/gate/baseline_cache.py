"""The baseline's results, cached between gates: a gate costs one run (the candidate's) when the
baseline it needs was already run.

An entry lives in the harness's cache dir (the gate's --cache: $CKPT_HARNESS_HOME or
~/.cache/ckpt-harness) as `baselines/<digest>/` holding `results.json` (a whole baseline run),
`key.json` (the key, when and from where it was stored) and, once a gate's cross-version step wrote
it, `corpus/` (the golden corpus the baseline wrote), and `scale/<shape>/` (the baseline's plan of
each production shape, harness.gate.scale), so a second gate on unchanged pins runs neither again. The key is everything the baseline's results
depend on:

- `env`: the baseline venv's key (harness.gate.envspec: the pins plus --baseline overrides);
- `harness`: the harness's own code digest (harness.report.results.code_digest: harness, cases, matrices);
- the selection: `matrix`, `k` and the selected case ids;
- `host` and the CKPT_* variables that change what a run does (a planted test candidate, the GPUs
  it may use, the dist backend), so a CPU run never stands in for a GPU run.

An entry is used only when its stored key equals the gate's key field by field (never a near
match), and it holds a whole run (`complete`, every selected case); `--fresh-baseline` skips the
lookup and replaces the entry.

`sha256.json` lists the sha256 of every other file of the entry, written as each file is stored. A
gate reuses an entry only through `lookup`, which first compares the entry's files with that list: a
changed, missing or added file (or one that is not a regular file) is `Refused`, and the gate ends
with exit 2 naming the entry and the file; it neither uses the entry nor quietly runs the baseline
again, because a cache that changed under it is something to look at. Each file is read once, in
blocks, and what the gate then uses is the copy made in that same read (the `stage` under the gate's
own directory), so a file changed after the check is never what is read: the corpus is loaded with
its pickles trusted (the gate wrote it), so nothing of an entry is unpickled before it is verified.
The list guards against a changed or half-written cache, not against someone who can rewrite the
list too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.core.result import STATUSES

DIR = "baselines"
SHA256 = "sha256.json"  # in an entry: {"files": {path: sha256}} of every other file in it
STAGE = "cached-baseline"  # in the gate's out dir: the verified copy of the entry it uses
_BLOCK = 1 << 20
#: CKPT_* variables that change where the harness keeps things or how much it says, not what a run does
_NEUTRAL = frozenset({"CKPT_HARNESS_HOME", "CKPT_HARNESS_VERBOSE", "CKPT_HARNESS_PIP", "CKPT_HARNESS_UV",
                      "CKPT_HARNESS_INSTALLER", "CKPT_HARNESS_PYTHON", "CKPT_HARNESS_SOURCES",
                      "CKPT_HARNESS_TEST_GPU_LOG"})


@dataclass(frozen=True)
class Key:
    env: str
    harness: str
    matrix: str
    k: str | None
    cases: tuple[str, ...]
    host: str
    variables: tuple[tuple[str, str], ...] = ()

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cases"], d["variables"] = list(self.cases), [list(v) for v in self.variables]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Key:
        return cls(d["env"], d["harness"], d["matrix"], d.get("k"), tuple(d["cases"]), d["host"],
                   tuple(tuple(v) for v in d.get("variables") or ()))

    def describe(self) -> str:
        return (f"env `{self.env}`, harness `{self.harness}`, matrix `{self.matrix}`"
                + (f" -k `{self.k}`" if self.k else "") + f", {len(self.cases)} case(s), host `{self.host}`"
                + (f", {', '.join(f'{k}={v}' for k, v in self.variables)}" if self.variables else ""))


class Refused(Exception):
    """A cached entry whose files are not the ones stored: the gate ends (exit 2), naming it and the file."""


def _copy_hashed(src: Path, dst: Path | None) -> str:
    """sha256 of `src`, read once in blocks; written to `dst` in the same pass when one is given."""
    h = hashlib.sha256()
    with open(src, "rb") as f, contextlib.ExitStack() as stack:
        out = stack.enter_context(open(dst, "xb")) if dst is not None else None
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)
            if out is not None:
                out.write(block)
    return h.hexdigest()


def _copy_tree(src: Path, dst: Path) -> dict[str, str]:
    """Copy a directory of regular files, hashing each in the copy's one read: {relative path: sha256}."""
    files: dict[str, str] = {}
    for rel in _listing(src):
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        files[rel] = _copy_hashed(src / rel, dst / rel)
    return files


def _listing(root: Path) -> list[str]:
    """Every file under `root` (relative, '/'-separated); anything but a regular file or a directory is
    listed as well, so that the check refuses it."""
    out = []
    for d, dirs, names in os.walk(root):
        for n in [*names, *(x for x in dirs if os.path.islink(os.path.join(d, x)))]:
            out.append(Path(d, n).relative_to(root).as_posix())
    return sorted(out)


def _write_list(path: Path, files: dict[str, str]) -> None:
    tmp = path / f".{SHA256}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"files": dict(sorted(files.items()))}, indent=1) + "\n")
    tmp.replace(path / SHA256)


def _refuse(path: Path, rel: str, what: str) -> Refused:
    return Refused(f"the cached baseline {path} is refused: {rel} {what}; its files are not the ones stored (listed "
                   f"in its {SHA256}), so nothing in it is used: look at it, then delete it or run the gate with "
                   "--fresh-baseline (which runs the baseline and stores the entry again)")


def verify(path: Path, stage: Path | None = None) -> tuple[dict[str, str], dict[str, bytes]]:
    """Check every file of the entry at `path` against its sha256.json, reading each once: (the list,
    the bytes of its top-level JSON files); the corpus goes into `stage`/corpus in the same read. Raises
    Refused, naming the file, on a changed, missing or added one."""
    try:
        files = json.loads((path / SHA256).read_text())["files"]
    except FileNotFoundError:
        raise _refuse(path, SHA256, "is missing") from None
    except (OSError, ValueError, KeyError, TypeError):
        files = None
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise _refuse(path, SHA256, "is not a list of sha256 sums")
    present = [rel for rel in _listing(path) if rel != SHA256]
    if extra := sorted(set(present) - set(files)):
        raise _refuse(path, extra[0], "was not stored with the entry (an added file)")
    if missing := sorted(set(files) - set(present)):
        raise _refuse(path, missing[0], "is missing")
    small: dict[str, bytes] = {}
    for rel, want in sorted(files.items()):
        src = path / rel
        if not stat.S_ISREG(os.lstat(src).st_mode):
            raise _refuse(path, rel, "is not a regular file")
        if "/" not in rel:  # results.json, key.json: read once, hashed and parsed from the same bytes
            small[rel] = src.read_bytes()
            got = hashlib.sha256(small[rel]).hexdigest()
        else:
            dst = stage / rel if stage is not None else None
            if dst is not None:
                dst.parent.mkdir(parents=True, exist_ok=True)
            got = _copy_hashed(src, dst)
        if got != want:
            raise _refuse(path, rel, f"changed since it was stored (sha256 {got[:12]}, stored {want[:12]})")
    return files, small


def variables(environ: dict[str, str] | None = None) -> tuple[tuple[str, str], ...]:
    env = os.environ if environ is None else environ
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith("CKPT_") and k not in _NEUTRAL))


def selection(matrix: Path, k: str | None) -> list[str] | None:
    """The case ids `run MATRIX -k K` selects (None when the matrix does not load: no cache then;
    the run itself reports the matrix's error)."""
    from harness.orchestration.matrix import load_matrix

    try:
        return [c.id for c in load_matrix(matrix).select(k)]
    except Exception:  # noqa: BLE001 - a matrix that does not load is the run's error to report, not the cache's
        return None


def key_for(env: str, matrix: Path, k: str | None, cases: list[str], harness: str | None = None,
            root: Path | None = None, environ: dict[str, str] | None = None, host: str | None = None) -> Key:
    if harness is None:
        from harness.report.results import code_digest

        harness = code_digest()
    m = Path(matrix)
    if root is not None:
        try:
            m = m.resolve().relative_to(Path(root).resolve())
        except ValueError:
            pass
    return Key(env, harness, str(m), k or None, tuple(sorted(cases)), host or platform.node(), variables(environ))


@dataclass(frozen=True)
class Entry:
    path: Path
    key: Key
    stored: str  # ISO date it was stored
    source: str  # the gate directory its run was made in
    #: (path, sha256) of every file stored, as checked by lookup or written by store
    files: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    #: the verified copy lookup made in the gate's directory: what the gate reads, never the cache again
    staged: Path | None = field(default=None, compare=False)

    @property
    def results(self) -> Path:
        return (self.staged or self.path) / "results.json"

    @property
    def corpus(self) -> Path | None:
        return part(self, "corpus")  # stored only once its manifest.json was written (store_corpus)

    def describe(self) -> str:
        return f"`{self.path}` (key {self.key.digest}, stored {self.stored}, first run in `{self.source}`)"


def lookup(cache: Path, key: Key, stage: Path | None = None) -> tuple[Entry | None, str]:
    """The entry for exactly `key` with a whole run in it, or None and why not (for the verdict). Its
    files are checked first (`verify`; Refused when one differs) and, with `stage` (a new directory in
    the gate's own), copied there in the same read: the entry returned reads from that copy."""
    path = Path(cache) / DIR / key.digest
    if not path.is_dir():
        return None, f"no cached baseline for key {key.digest}"
    if stage is not None:
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
    try:
        files, small = verify(path, stage)
        meta = json.loads(small["key.json"])
        stored = Key.from_dict(meta["key"])
        doc = json.loads(small["results.json"])
        if stage is not None:
            (stage / "results.json").write_bytes(small["results.json"])
    except Refused:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:  # verified, but not what this code stores
        why = f"the cached baseline {path} is unreadable ({type(exc).__name__}): running it again"
    else:
        if stored != key:  # a digest collision, or an entry written by other code: never a near match
            why = f"the cached baseline {path} was stored under another key: running it again"
        elif doc.get("complete") is not True or sorted(doc.get("selected") or []) != list(key.cases) or \
                doc.get("harness") != key.harness:
            why = f"the cached baseline {path} is not a whole run of this selection: running it again"
        else:
            return Entry(path, stored, str(meta.get("stored", "?")), str(meta.get("source", "?")),
                         tuple(sorted(files.items())), stage), f"cached baseline {key.digest}"
    if stage is not None:
        shutil.rmtree(stage, ignore_errors=True)
    return None, why


def store(cache: Path, key: Key, results: Path, source: Path) -> Entry | None:
    """Keep a whole baseline run (results: its results.json) under `key`, replacing any entry there,
    with the sha256 of each file in its sha256.json; None when the run is not whole (a partial run is
    never cached)."""
    doc = json.loads(Path(results).read_text())
    if doc.get("complete") is not True or sorted(doc.get("selected") or []) != list(key.cases):
        return None
    root = Path(cache) / DIR
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{key.digest}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    stored = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    meta = (json.dumps({"key": key.to_dict(), "digest": key.digest, "stored": stored, "source": str(source)},
                       indent=2) + "\n").encode()
    (tmp / "key.json").write_bytes(meta)
    files = {"results.json": _copy_hashed(Path(results), tmp / "results.json"),
             "key.json": hashlib.sha256(meta).hexdigest()}
    _write_list(tmp, files)
    final = root / key.digest
    if final.exists():
        shutil.rmtree(final, ignore_errors=True)
    tmp.replace(final)
    return Entry(final, key, stored, str(source), tuple(sorted(files.items())))


def part(entry: Entry, name: str) -> Path | None:
    """Where the entry's stored part `name` (the corpus, a scale plan) is read from: its verified stage,
    or the cache; None when the entry holds none."""
    return (entry.staged or entry.path) / name if any(rel.startswith(f"{name}/") for rel, _ in entry.files) else None


def store_part(entry: Entry, name: str, src: Path, marker: str) -> None:
    """Keep a directory the baseline wrote (`src`, whole once `marker` is in it) beside its results as
    part `name`, its files' sha256 added to the entry's sha256.json (as it is on disk now, so parts
    stored one after the other are all listed). A part already there is kept."""
    if part(entry, name) is not None or (entry.path / name).exists() or not (Path(src) / marker).exists():
        return
    tmp = entry.path.parent / f".{entry.path.name}.{name.replace('/', '_')}.{os.getpid()}.tmp"  # never inside the entry
    shutil.rmtree(tmp, ignore_errors=True)
    added = _copy_tree(Path(src), tmp)
    try:
        (entry.path / name).parent.mkdir(parents=True, exist_ok=True)
        tmp.replace(entry.path / name)
    except OSError:  # another gate stored one first (or the entry is gone): keep what is there
        shutil.rmtree(tmp, ignore_errors=True)
        return
    listed = json.loads((entry.path / SHA256).read_text())["files"]
    _write_list(entry.path, {**listed, **{f"{name}/{rel}": sha for rel, sha in added.items()}})


def restore_part(entry: Entry, name: str, dest: Path) -> bool:
    """Put the entry's part `name` at `dest`; False when it has none. A staged entry's part was verified
    in the copy lookup made, and moves; an unstaged one is copied from the cache and checked in that
    copy (Refused when a file differs)."""
    where = part(entry, name)
    if where is None or Path(dest).exists():
        return False
    Path(dest).parent.mkdir(parents=True, exist_ok=True)
    if entry.staged is not None:
        where.replace(dest)
        return True
    want = {rel.removeprefix(f"{name}/"): sha for rel, sha in entry.files if rel.startswith(f"{name}/")}
    got = _copy_tree(where, Path(dest))
    if got != want:
        shutil.rmtree(dest, ignore_errors=True)
        rel = next(iter(sorted(set(got) ^ set(want)) or [r for r in sorted(want) if got[r] != want[r]]))
        raise _refuse(entry.path, f"{name}/{rel}", "differs from the list it was stored with")
    return True


def store_corpus(entry: Entry, corpus: Path) -> None:
    """Keep the golden corpus the baseline wrote (a later gate's cross-version step reads it instead of
    writing it again)."""
    store_part(entry, "corpus", corpus, "manifest.json")


def restore_corpus(entry: Entry, dest: Path) -> bool:
    """Put the entry's corpus at `dest` (the gate's cross/written-by-baseline); False when it has none."""
    return restore_part(entry, "corpus", dest)


def restricted(doc: dict[str, Any], ids: list[str], where: Path, matrix: Path | None = None) -> dict[str, Any]:
    """`doc` (a --baseline-results run) as the run of exactly `ids`, when it ran all of them and maybe
    more of the same matrix file (a nightly baseline of the whole matrix serving a gate on a -k slice);
    the cut is said in `restricted_from`. Refused, naming what, when it lacks one or ran another file."""
    ran = doc.get("selected") or []
    if ran == ids:
        return doc
    if matrix is not None and Path(str(doc.get("matrix", ""))).name != Path(matrix).name:
        raise Refused(f"--baseline-results {where} ran the matrix {doc.get('matrix')!r}, this gate runs "
                      f"{str(matrix)!r}: run the gate without it")
    missing = [i for i in ids if i not in set(ran)]
    if missing:
        raise Refused(f"--baseline-results {where} did not run {len(missing)} of this gate's {len(ids)} case(s) "
                      f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): run the gate without it")
    keep = set(ids)
    results = [r for r in doc["results"] if r.get("id") in keep]
    return {**doc, "selected": list(ids), "results": results,
            "summary": {s: sum(r["status"] == s for r in results) for s in STATUSES}, "restricted_from": len(ran)}
