"""Judging and recording a check: one family of functions every case uses.

Each takes plain values (tensors, shard lists, knob records, an exception) and returns a `Check`,
so a case's judge is a pure function of its worlds' outputs and is tested without a process
(tests/test_judges.py). The comparisons themselves are harness.parity.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

from harness.parity import Mismatch, Shard, Tolerance, assemble, compare_state, compare_tensors, max_abs_diff
from harness.result import Check


def label_of(tolerance: Tolerance | None) -> str:
    return "bitwise" if tolerance is None else str(tolerance)


def _max_diff(expected: Mapping[str, torch.Tensor], actual: Mapping[str, torch.Tensor]) -> float:
    diffs = [max_abs_diff(expected[k], actual[k]) for k in expected if k in actual]
    return max(diffs, default=0.0)


def state_check(
    name: str,
    expected: Mapping[str, torch.Tensor],
    actual: Mapping[str, torch.Tensor],
    expected_label: str,
    actual_label: str,
    detail_ok: str,
    tolerance: Tolerance | None = None,
    problems: Sequence[Mismatch] = (),
) -> Check:
    """Every key of both sides equal (bitwise, or within `tolerance`), plus any `problems` found on
    the way (coverage holes, diverged replicas from `assemble`)."""
    mismatches = list(problems) + compare_state(expected, actual, expected_label, actual_label, tolerance)
    label = label_of(tolerance)
    if mismatches:
        worst = max((m.max_abs_diff for m in mismatches if m.max_abs_diff is not None), default=None)
        kinds = sorted({m.kind for m in mismatches})
        return Check(name, "failed", f"{len(mismatches)} mismatch(es): {', '.join(kinds)}", worst, label, mismatches)
    return Check(name, "passed", detail_ok, 0.0 if tolerance is None else _max_diff(expected, actual), label)


def tensor_check(
    name: str,
    expected: torch.Tensor,
    actual: torch.Tensor,
    expected_label: str,
    actual_label: str,
    detail_ok: str,
    tolerance: Tolerance | None = None,
) -> Check:
    m = compare_tensors(name, expected, actual, expected_label, actual_label, tolerance)
    diff = max_abs_diff(expected, actual)
    if m is None:
        return Check(name, "passed", detail_ok, diff, label_of(tolerance))
    return Check(name, "failed", str(m), diff, label_of(tolerance), [m])


def assembled(outs: Iterable[Any], field: str, label: str) -> tuple[dict[str, torch.Tensor], list[Mismatch]]:
    """Full tensors from the `field` shard lists of every rank's output (see parity.assemble)."""
    shards: list[Shard] = [s for o in outs for s in (getattr(o, field) or ())]
    return assemble(shards, label)


def replicated(outs: Iterable[Any], field: str) -> tuple[Any, bool]:
    """The value of `field` that ranks produced (None where a rank has none, e.g. off the last
    pipeline stage), and whether every rank that produced one agrees bitwise (DP/CP replicas)."""
    found = [getattr(o, field) for o in outs if getattr(o, field) is not None]
    if not found:
        return None, True
    first = found[0]
    return first, all(torch.equal(first.view(torch.uint8), f.view(torch.uint8)) for f in found[1:])


def knob_check(name: str, sides: Sequence[tuple[str, Sequence[Sequence[Mapping[str, Any]]]]], detail_ok: str) -> Check:
    """Every configuration knob a case asked is what the built objects use, on every rank of
    every side: `sides` is [(label, [per-rank list of {knob, asked, actual, ok}])]."""
    bad = [
        f"{label} rank {rank}: {k['knob']} asked {k['asked']!r}, built {k['actual']!r}"
        for label, ranks in sides
        for rank, knobs in enumerate(ranks)
        for k in knobs
        if not k["ok"]
    ]
    if bad:
        return Check(name, "failed", "; ".join(bad[:6]), tolerance="exact")
    return Check(name, "passed", detail_ok, tolerance="exact")


def refusal_check(exc_type: str | None, message: str, allowed: Sequence[str], change: str, meaning: str = "") -> Check:
    """An `expect: refuse` load: it must raise one of `allowed`. A load that completes fails (the
    checkpoint was accepted where it should not be), and so does a refusal through another
    exception (the user gets no clear reason). `exc_type` None means the load completed."""
    meaning = f" (meaning: {meaning})" if meaning else ""
    if exc_type is None:
        return Check("refusal", "failed", f"the load across {change} was expected to refuse but completed{meaning}", tolerance="-")
    first = message.splitlines()[0][:240] if message else ""
    if exc_type in allowed:
        return Check("refusal", "passed", f"refused across {change}: {exc_type}: {first}{meaning}", tolerance="-")
    return Check(
        "refusal", "failed",
        f"refused across {change}, but with {exc_type or 'an unrecognised error'}: {first!r}; not one of {list(allowed)}, "
        "so a user gets no clear reason",
        tolerance="-",
    )
