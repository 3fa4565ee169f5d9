"""The baseline's results, cached between gates: a gate costs one run (the candidate's) when the
baseline it needs was already run.

An entry lives in the harness's cache dir (the gate's --cache: $CKPT_HARNESS_HOME or
~/.cache/ckpt-harness) as `baselines/<digest>/` holding `results.json` (a whole baseline run),
`key.json` (the key, when and from where it was stored) and, once a gate's cross-version step wrote
it, `corpus/` (the golden corpus the baseline wrote). The key is everything the baseline's results
depend on:

- `env`: the baseline venv's key (harness.gate.envspec: the pins plus --baseline overrides);
- `harness`: the harness's own code digest (harness.report.results.code_digest: harness, cases, matrices);
- the selection: `matrix`, `k` and the selected case ids;
- `host` and the CKPT_* variables that change what a run does (a planted test candidate, the GPUs
  it may use, the dist backend), so a CPU run never stands in for a GPU run.

An entry is used only when its stored key equals the gate's key field by field (never a near
match), and it holds a whole run (`complete`, every selected case); `--fresh-baseline` skips the
lookup and replaces the entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DIR = "baselines"
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

    @property
    def results(self) -> Path:
        return self.path / "results.json"

    @property
    def corpus(self) -> Path | None:
        return self.path / "corpus" if (self.path / "corpus" / "manifest.json").exists() else None

    def describe(self) -> str:
        return f"`{self.path}` (key {self.key.digest}, stored {self.stored}, first run in `{self.source}`)"


def lookup(cache: Path, key: Key) -> tuple[Entry | None, str]:
    """The entry for exactly `key` with a whole run in it, or None and why not (for the verdict)."""
    path = Path(cache) / DIR / key.digest
    try:
        meta = json.loads((path / "key.json").read_text())
        stored = Key.from_dict(meta["key"])
        doc = json.loads((path / "results.json").read_text())
    except FileNotFoundError:
        return None, f"no cached baseline for key {key.digest}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"the cached baseline {path} is unreadable ({type(exc).__name__}): running it again"
    if stored != key:  # a digest collision, or an entry written by other code: never a near match
        return None, f"the cached baseline {path} was stored under another key: running it again"
    if doc.get("complete") is not True or sorted(doc.get("selected") or []) != list(key.cases) or \
            doc.get("harness") != key.harness:
        return None, f"the cached baseline {path} is not a whole run of this selection: running it again"
    return Entry(path, stored, str(meta.get("stored", "?")), str(meta.get("source", "?"))), f"cached baseline {key.digest}"


def store(cache: Path, key: Key, results: Path, source: Path) -> Entry | None:
    """Keep a whole baseline run (results: its results.json) under `key`, replacing any entry there;
    None when the run is not whole (a partial run is never cached)."""
    doc = json.loads(Path(results).read_text())
    if doc.get("complete") is not True or sorted(doc.get("selected") or []) != list(key.cases):
        return None
    root = Path(cache) / DIR
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{key.digest}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    shutil.copy2(results, tmp / "results.json")
    stored = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    (tmp / "key.json").write_text(json.dumps({"key": key.to_dict(), "digest": key.digest, "stored": stored,
                                              "source": str(source)}, indent=2) + "\n")
    final = root / key.digest
    if final.exists():
        shutil.rmtree(final, ignore_errors=True)
    tmp.replace(final)
    return Entry(final, key, stored, str(source))


def store_corpus(entry: Entry, corpus: Path) -> None:
    """Keep the golden corpus the baseline wrote beside its results (a later gate's cross-version step
    reads it instead of writing it again)."""
    if entry.corpus is not None or not (Path(corpus) / "manifest.json").exists():
        return
    tmp = entry.path / f".corpus.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(corpus, tmp)
    tmp.replace(entry.path / "corpus")


def restore_corpus(entry: Entry, dest: Path) -> bool:
    """Copy the entry's corpus to `dest` (the gate's cross/written-by-baseline); False when it has none."""
    if entry.corpus is None or Path(dest).exists():
        return False
    shutil.copytree(entry.corpus, dest)
    return True
