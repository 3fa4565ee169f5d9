"""The test suite's tiers for matrix cases: matrices/tiers.yaml, one list in one place.

The default tier (`scripts/test`, what every push runs) keeps one case per block: the cases of the
default-tier matrices that share (kind, backend, model, options, backend options, expect, tag,
named xfail or not) and differ only in their topology pair. The rest of each block is listed under
`slow` and runs in the scheduled tier (`scripts/test -m "memory or slow"`, ci.yml's nightly job);
`scripts/smoke` and `run` ignore tiers, so every smoke case still runs in the main job.

The pytest plugin reads the list beside the matrix file it collects and marks those cases `slow`;
tests/test_tiers.py holds the rules (every case in exactly one tier, every block one case in the
default tier, no stale id) and prints the list the rule gives when the file falls behind.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import yaml

from harness.core.spec import CaseSpec

FILE = "tiers.yaml"
#: markers that are a tier of their own; a case without any is in the default tier
TIERS = ("slow", "memory", "gpu", "arch")
#: the matrices whose unmarked cases are the default tier, in the order "first" means
DEFAULT_MATRICES = ("smoke.yaml", "extended.yaml", "verl.yaml", "faults.yaml")


class TiersError(ValueError):
    """tiers.yaml is malformed; the message names the file and key."""


def load(directory: Path) -> dict[str, frozenset[str]]:
    """{matrix file name: the ids listed as slow}; empty when the directory has no tiers.yaml."""
    path = Path(directory) / FILE
    if not path.is_file():
        return {}
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise TiersError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict) or set(raw) - {"slow"}:
        raise TiersError(f"{path}: a mapping with one key, 'slow' (got {sorted(raw) if isinstance(raw, dict) else type(raw).__name__})")
    slow = raw.get("slow") or {}
    if not isinstance(slow, dict):
        raise TiersError(f"{path}: slow: a mapping of matrix file -> list of case ids")
    out: dict[str, frozenset[str]] = {}
    for name, ids in slow.items():
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise TiersError(f"{path}: slow.{name}: a list of case ids")
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise TiersError(f"{path}: slow.{name}: {dup} is listed twice")
        out[str(name)] = frozenset(ids)
    return out


def tier(spec: CaseSpec, listed: frozenset[str] = frozenset()) -> list[str]:
    """The tiers a case is in: its tier markers, plus `slow` when tiers.yaml lists it ([] = default)."""
    return [t for t in TIERS if t in spec.markers or (t == "slow" and spec.id in listed)]


def block(spec: CaseSpec) -> str:
    """What a case checks apart from its topology pair: cases with one block differ only in the pair."""
    return json.dumps([spec.case, spec.backend, spec.model, spec.options, spec.backend_options, spec.expect,
                       spec.tag, spec.xfail is not None], default=str)


def rule(files: Iterable[tuple[str, list[CaseSpec]]]) -> dict[str, list[str]]:
    """The slow list the rule gives: of each block of untiered cases, in file order, all but the first."""
    seen: set[str] = set()
    slow: dict[str, list[str]] = {}
    for name, specs in files:
        for spec in specs:
            if any(t in spec.markers for t in TIERS):
                continue
            key = block(spec)
            if key in seen:
                slow.setdefault(name, []).append(spec.id)
            seen.add(key)
    return slow


def render(slow: dict[str, list[str]]) -> str:
    """tiers.yaml's body for a slow list (the header comment is kept by hand)."""
    return yaml.safe_dump({"slow": slow}, sort_keys=False, width=200)
