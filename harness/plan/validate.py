"""Is a plan whole? Pure functions over records (harness.plan.collect.Record or anything with
key, global_shape, global_offset, local_shape, dtype, main): cheap to test with planted faults.

A topology's plan is whole when, for every key, the main replicas' boxes lie inside the global
shape and cover it exactly once (no gap, no overlap), and every rank agrees on the key's global
shape and dtype. A load plan is whole against a save when it asks for no key the save lacks and
every key's global shape and dtype match."""

from __future__ import annotations

from collections import defaultdict
from math import prod
from typing import Iterable


def _overlap(a, b) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1]))


def coverage_problems(records: Iterable) -> list[str]:
    """Gaps, overlaps, out-of-bounds boxes and global shape/dtype disagreements, one line each."""
    by_key: dict[str, list] = defaultdict(list)
    for r in records:
        by_key[r.key].append(r)
    problems = []
    for key in sorted(by_key):
        recs = by_key[key]
        shapes = {tuple(r.global_shape) for r in recs}
        dtypes = {r.dtype for r in recs}
        if len(shapes) > 1:
            problems.append(f"{key}: ranks disagree on the global shape: {sorted(shapes)}")
            continue
        if len(dtypes) > 1:
            problems.append(f"{key}: ranks disagree on the dtype: {sorted(dtypes)}")
        (shape,) = shapes
        boxes = []
        for r in recs:
            if len(r.global_offset) != len(shape) or len(r.local_shape) != len(shape):
                problems.append(f"{key}: rank {r.rank} has a box of rank {len(r.local_shape)} for a {len(shape)}-d tensor")
            elif any(o < 0 or o + n > s for o, n, s in zip(r.global_offset, r.local_shape, shape)):
                problems.append(f"{key}: rank {r.rank}'s box at {tuple(r.global_offset)} size {tuple(r.local_shape)} "
                                f"leaves the global shape {shape}")
            elif r.main:
                boxes.append((tuple(r.global_offset), tuple(r.local_shape), r.rank))
        overlaps = _overlaps(boxes)
        for a, b in overlaps[:3]:
            problems.append(f"{key}: overlap: ranks {a[2]} and {b[2]} both write the box at {a[0]} "
                            f"(sizes {a[1]} and {b[1]})")
        if len(overlaps) > 3:
            problems.append(f"{key}: ... {len(overlaps) - 3} more overlapping pairs")
        if not overlaps:
            covered, total = sum(prod(b[1]) for b in boxes), prod(shape)
            if covered < total:
                problems.append(f"{key}: gap: the main replicas cover {covered} of {total} elements "
                                f"({total - covered} written by no rank){_where(boxes, shape)}")
    return problems


def _overlaps(boxes: list) -> list:
    """Pairs of boxes that share an element: a sweep along axis 0 compares only neighbours."""
    boxes = sorted(boxes, key=lambda b: (b[0], b[2]))
    found, active = [], []
    for b in boxes:
        active = [a for a in active if a[0][0] + a[1][0] > b[0][0]] if b[0] else active
        found += [(a, b) for a in active if _overlap(a, b)]
        active.append(b)
    return found


def _where(boxes: list, shape: tuple) -> str:
    """For a 1-axis-split gap, the first uncovered start along the axis the boxes split."""
    for axis in range(len(shape)):
        starts = {b[0][axis] for b in boxes}
        ends = {b[0][axis] + b[1][axis] for b in boxes}
        missing = sorted(e for e in ({0} | ends) - starts if e < shape[axis])
        if boxes and missing:
            return f"; first uncovered index {missing[0]} on axis {axis}"
    return "" if boxes else "; no main replica at all"


def key_table(records: Iterable) -> dict[str, tuple[tuple[int, ...], str]]:
    """key -> (global shape, dtype), the first record's (coverage_problems reports disagreement)."""
    table: dict[str, tuple[tuple[int, ...], str]] = {}
    for r in records:
        table.setdefault(r.key, (tuple(r.global_shape), r.dtype))
    return table


def load_problems(saved: Iterable, loading: Iterable) -> dict[str, list[str]]:
    """What a load at the target would find against the save: keys it would miss (asked for, not
    saved: the load fails), keys it does not expect (saved, not asked for: a strict load fails,
    a non-strict one drops them), and keys whose global shape or dtype differ."""
    s, l = key_table(saved), key_table(loading)
    return {
        "missing": sorted(set(l) - set(s)),
        "unexpected": sorted(set(s) - set(l)),
        "mismatched": [f"{k}: saved {s[k][0]} {s[k][1]}, load asks {l[k][0]} {l[k][1]}"
                       for k in sorted(set(s) & set(l)) if s[k] != l[k]],
    }


def layout(records: list) -> dict[str, dict]:
    """Per key, what a checkpoint's metadata says of it at this topology: global shape, dtype, how
    many chunks the built coordinates hold, and a digest of those chunks (offset, local shape,
    replica id, sorted). Two releases that plan the same model and topologies the same way give the
    same layout; the gate's scale step (harness.gate.scale) diffs it."""
    import hashlib

    by: dict[str, list] = {}
    for r in records:
        by.setdefault(r.key, []).append(r)
    out = {}
    for key, rs in sorted(by.items()):
        chunks = sorted({(tuple(r.global_offset), tuple(r.local_shape), tuple(r.replica_id)) for r in rs})
        out[key] = {"shape": list(rs[0].global_shape), "dtype": rs[0].dtype, "chunks": len(chunks),
                    "digest": hashlib.sha1(repr(chunks).encode()).hexdigest()[:16]}
    return out

