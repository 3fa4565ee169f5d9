"""The test suite's tiers for matrix cases: matrices/tiers.yaml, one list in one place.

`main_job`: whole matrix files the main job runs on every push (scripts/smoke, ci.yml's smoke
shards: matrices/smoke.yaml). `scripts/test` leaves their cases to that job instead of running
each a second time; `scripts/test -m smoke` still takes them.

The default tier (`scripts/test`) keeps one case per block of the other default-tier matrices: the
cases that share (kind, backend, model, options, backend options, expect, tag, named xfail or not)
and differ only in their topology pair, a block the main job already runs counting as kept. The
rest of each block is listed under `slow` and runs in the scheduled tier (`scripts/test -m "memory
or slow"`, ci.yml's nightly job). `scripts/smoke` and `run` ignore tiers.

The pytest plugin reads the list beside the matrix file it collects and marks those cases;
tests/test_tiers.py holds the rules (every case in exactly one tier, every block one case in the
main job or the default tier, no stale id) and prints the list the rule gives when the file falls
behind.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from harness.core.spec import CaseSpec
from harness.orchestration.matrix import SAFE_LOADER

FILE = "tiers.yaml"
#: markers that are a tier of their own; a case without any is in the default tier
TIERS = ("main_job", "slow", "memory", "gpu", "arch")
#: the matrices whose unmarked cases are the default tier, in the order "first" means
DEFAULT_MATRICES = ("smoke.yaml", "extended.yaml", "verl.yaml", "faults.yaml")


class TiersError(ValueError):
    """tiers.yaml is malformed; the message names the file and key."""


@dataclass(frozen=True)
class Tiers:
    """tiers.yaml as read: `main` the main job's matrix files, `slow` {file: the ids listed slow}."""

    main: frozenset[str] = frozenset()
    slow: dict[str, frozenset[str]] = field(default_factory=dict)

    def markers(self, spec: CaseSpec, file: str) -> list[str]:
        """The tier markers tiers.yaml adds to a case of `file` (what the pytest plugin adds)."""
        if file in self.main:
            return ["main_job"]
        return ["slow"] if spec.id in self.slow.get(file, ()) and "slow" not in spec.markers else []


def load(directory: Path) -> Tiers:
    """The tiers.yaml of a matrices directory; empty tiers when it has none."""
    path = Path(directory) / FILE
    if not path.is_file():
        return Tiers()
    try:
        raw = yaml.load(path.read_text(), Loader=SAFE_LOADER) or {}
    except yaml.YAMLError as exc:
        raise TiersError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict) or set(raw) - {"slow", "main_job"}:
        raise TiersError(f"{path}: a mapping with the keys 'main_job' and 'slow' "
                         f"(got {sorted(raw) if isinstance(raw, dict) else type(raw).__name__})")
    main = raw.get("main_job") or []
    if not isinstance(main, list) or not all(isinstance(m, str) for m in main):
        raise TiersError(f"{path}: main_job: a list of matrix file names")
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
        if name in main:
            raise TiersError(f"{path}: slow.{name}: the file is main_job's; its cases are in that tier")
        out[str(name)] = frozenset(ids)
    return Tiers(frozenset(main), out)


def tier(spec: CaseSpec, listed: frozenset[str] = frozenset(), main: bool = False) -> list[str]:
    """The tiers a case is in: its tier markers, plus `slow` when tiers.yaml lists it and `main_job`
    when its file is the main job's ([] = the default tier)."""
    return [t for t in TIERS if t in spec.markers or (t == "slow" and spec.id in listed) or (t == "main_job" and main)]


def block(spec: CaseSpec) -> str:
    """What a case checks apart from its topology pair: cases with one block differ only in the pair."""
    return json.dumps([spec.case, spec.backend, spec.model, spec.options, spec.backend_options, spec.expect,
                       spec.tag, spec.xfail is not None], default=str)


def rule(files: Iterable[tuple[str, list[CaseSpec]]], main: Iterable[str] = ()) -> dict[str, list[str]]:
    """The slow list the rule gives: of each block of untiered cases, in file order, all but the first;
    a main-job file's cases keep their blocks (they run in the main job) and are never listed."""
    main = set(main)
    seen: set[str] = set()
    slow: dict[str, list[str]] = {}
    for name, specs in files:
        for spec in specs:
            if any(t in spec.markers for t in TIERS):
                continue
            key = block(spec)
            if key in seen and name not in main:
                slow.setdefault(name, []).append(spec.id)
            seen.add(key)
    return slow


def render(slow: dict[str, list[str]], main: Iterable[str] = ()) -> str:
    """tiers.yaml's body (the header comment is kept by hand)."""
    return yaml.safe_dump({"main_job": sorted(main), "slow": slow}, sort_keys=False, width=200)
