"""The balanced split of a matrix (issue 20 item 3), shared by the shard and cluster schedulers (and
the cost estimate packing orders by): `run --shard I/N` takes a deterministic, balanced part. Every runner computes the same split from the same matrix, so the N parts hold every case
exactly once; `ckpt-harness merge` (harness.report.merge) makes one report from their results.

Balance: each case weighs what it took in a previous results.json (`--durations`), else an estimate
from its world size and model kind. The cases that likely share a stored source world
(`source_group`: harness.run.reuse saves it once per run) stay in one shard, so a split does not
save a source once per shard; a group heavier than a fifth of a shard's fair share is cut in parts
of at most that (so the shards stay within about 20% of each other). The units go heaviest first to the lightest shard (longest processing time first),
ties by their first case id, so the split does not depend on dict or file order."""

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


def source_group(spec: Any) -> str:
    """What decides a case's source world apart from the target (case, model, backend and its
    options, source topology, case options): cases with the same group likely share one stored
    source (the store's own key, harness.run.reuse.source_key, decides what is really shared)."""
    return repr((spec.case, spec.model, spec.backend, sorted(spec.backend_opts.items()), spec.source.id, sorted(spec.opts.items())))


def split(specs: Sequence[Any], total: int, durations: dict[str, float] | None = None) -> list[list[Any]]:
    """The `total` parts, each in matrix order; every spec in exactly one."""
    durations = durations or {}
    weight = {s.id: durations.get(s.id) or estimate(s) for s in specs}
    cap = sum(weight.values()) / total / 5  # a unit's most: longest-first then ends within one unit of balance
    groups: dict[str, list[Any]] = {}
    for s in specs:
        groups.setdefault(source_group(s), []).append(s)
    units: list[list[Any]] = []
    for members in groups.values():  # a group above the cap is cut (it would unbalance the split)
        unit: list[Any] = []
        for s in members:
            if unit and sum(weight[u.id] for u in unit) + weight[s.id] > cap:
                units.append(unit)
                unit = []
            unit.append(s)
        units.append(unit)
    loads, parts = [0.0] * total, [set() for _ in range(total)]
    for unit in sorted(units, key=lambda u: (-sum(weight[s.id] for s in u), u[0].id)):
        k = min(range(total), key=lambda j: (loads[j], j))
        loads[k] += sum(weight[s.id] for s in unit)
        parts[k].update(s.id for s in unit)
    return [[s for s in specs if s.id in part] for part in parts]


def select(specs: Sequence[Any], index: int, total: int, durations: dict[str, float] | None = None) -> list[Any]:
    """Shard `index` (1-based) of `total`."""
    return split(specs, total, durations)[index - 1]
