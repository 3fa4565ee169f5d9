"""A matrix split across CI runners: `run --shard I/N` takes a deterministic, balanced part (issue 20
item 3). Every runner computes the same split from the same matrix, so the N parts hold every case
exactly once; `ckpt-harness merge` (harness.report.merge) makes one report from their results.

Balance: each case weighs what it took in a previous results.json (`--durations`), else an estimate
from its world size and model kind; cases go heaviest first to the lightest shard (longest
processing time first), ties by case id, so the split does not depend on dict or file order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

#: seconds a case of an unknown duration is taken to cost: per rank of its larger world, and the
#: extra an HF fixture model brings (Bridge provider, transformers logits); measured on the smoke
#: matrix with --jobs 2: ~1.3 s per case of 2 ranks, HF cases ~1.5x
SECONDS_PER_RANK = 0.7
HF_FACTOR = 1.5


def parse_shard(text: str) -> tuple[int, int]:
    """(index, total) of `I/N` (1 <= I <= N); ValueError naming what is wrong."""
    index, sep, total = text.partition("/")
    if not sep or not index.strip().isdigit() or not total.strip().isdigit():
        raise ValueError(f"--shard takes I/N (e.g. 2/4), got {text!r}")
    i, n = int(index), int(total)
    if n < 1 or not 1 <= i <= n:
        raise ValueError(f"--shard {text}: I must be between 1 and N (N >= 1)")
    return i, n


def durations_of(path: Path) -> dict[str, float]:
    """Case id -> seconds it took, from a previous results.json (or a report dir holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    try:
        doc = json.loads(path.read_text())
        return {r["id"]: float(r.get("phases", {}).get("total", 0.0)) for r in doc["results"] if r.get("id")}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--durations {path}: not a readable results.json ({type(exc).__name__}: {exc})") from None


def estimate(spec: Any) -> float:
    """What a case is taken to cost without a measured duration."""
    from harness.core.zoo import get_model

    ranks = max(spec.source.world_size, spec.target.world_size)
    try:
        hf = get_model(spec.model).kind == "hf"
    except KeyError:
        hf = False
    return SECONDS_PER_RANK * (ranks + 1) * (HF_FACTOR if hf else 1.0)


def split(specs: Sequence[Any], total: int, durations: dict[str, float] | None = None) -> list[list[Any]]:
    """The `total` parts, each in matrix order; every spec in exactly one."""
    durations = durations or {}
    weight = {s.id: durations.get(s.id) or estimate(s) for s in specs}
    loads, parts = [0.0] * total, [set() for _ in range(total)]
    for s in sorted(specs, key=lambda s: (-weight[s.id], s.id)):
        k = min(range(total), key=lambda j: (loads[j], j))
        loads[k] += weight[s.id]
        parts[k].add(s.id)
    return [[s for s in specs if s.id in part] for part in parts]


def select(specs: Sequence[Any], index: int, total: int, durations: dict[str, float] | None = None) -> list[Any]:
    """Shard `index` (1-based) of `total`."""
    return split(specs, total, durations)[index - 1]
