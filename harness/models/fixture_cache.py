"""HF fixtures kept across runs: a fixture is a pure function of its spec, the installed transformers
and torch, and the harness code that derives it, so a run (and each side of a gate whose two
environments share transformers) writes each one once per machine instead of once per run.

Key: sha256 of the fixture's arguments (`repr` of the spec, dtype, shards, extra keys), the
transformers and torch versions, and the bytes of the harness modules that shape a fixture
(DERIVED_FROM). Store: `$CKPT_HARNESS_HOME/fixtures/<key>/` (default ~/.cache/ckpt-harness), written
in a temporary sibling and renamed into place, so a reader never sees half a fixture and two writers
keep the first. `CKPT_HARNESS_FIXTURE_CACHE=0` turns it off. A hit is copied into the caller's
directory: the case owns and may change its copy; the store is never handed out.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

#: the harness modules whose code decides a fixture's bytes (config derivation, weights, tokenizer)
DERIVED_FROM = ("harness/models/hf.py", "harness/models/architectures.py", "harness/models/vl.py", "harness/core/families.py",
                "harness/core/zoo.py", "harness/core/truth.py", "harness/models/fixture_cache.py")
OFF = "CKPT_HARNESS_FIXTURE_CACHE"
_ROOT = Path(__file__).resolve().parents[2]


def cache_root() -> Path | None:
    """Where fixtures are kept (None: caching is off)."""
    if os.environ.get(OFF) == "0":
        return None
    home = os.environ.get("CKPT_HARNESS_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "ckpt-harness") / "fixtures"


def fixture_key(*args: Any) -> str:
    """The store key of a fixture written from `args`, under the installed transformers and torch."""
    import torch
    import transformers

    h = hashlib.sha256(repr(args).encode())
    h.update(f"transformers {transformers.__version__} torch {torch.__version__}".encode())
    h.update(_code_digest())
    return h.hexdigest()[:20]


@lru_cache(maxsize=1)
def _code_digest() -> bytes:
    """The deriving modules' bytes, hashed once per process (they are the code this process runs)."""
    h = hashlib.sha256()
    for rel in DERIVED_FROM:
        h.update((_ROOT / rel).read_bytes())
    return h.digest()


def cached(directory: Path, args: tuple[Any, ...], write: Callable[[Path], Any]) -> tuple[Path, str]:
    """`directory` filled with the fixture of `args`: copied from the store when it holds it, else
    written by `write(dir)` into the store first. Returns (directory, "hit" | "wrote" | "off")."""
    root = cache_root()
    if root is None:
        write(directory)
        return directory, "off"
    entry = root / fixture_key(*args)
    state = "hit"
    if not entry.is_dir():
        state = "wrote"
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".writing-", dir=root))
        try:
            write(tmp)
            os.rename(tmp, entry)
        except OSError:
            if not entry.is_dir():  # not another writer's win: a real failure
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copytree(entry, directory, dirs_exist_ok=True)
    return directory, state
