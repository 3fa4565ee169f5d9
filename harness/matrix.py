"""Matrices: which scenarios run on which topologies, read from YAML and validated up front.

A matrix file:

    name: smoke
    defaults: {backends: [mcore_dist], timeout_s: 300, max_world_size: 4, markers: [smoke]}
    entries:
      - case: reshard-weights
        models: [gpt-gqa, gpt-tied]
        pairs: ["tp1 -> tp2", {source: tp2pp1, target: tp1pp2}]
        cross: {sources: [tp2], targets: [pp2, dp2]}     # optional cross product
        axes: {sharding: [dp_reshardable, fully_reshardable]}  # optional, crossed into options
        options: {steps: 3}                              # fixed case options
        tag: no-workaround                               # optional id suffix
        expect: pass | refuse
        xfail: "why (strict: an unexpected pass fails the case)"  # or {reason: ..., match: REGEX,
                                                         #     checks: [step]}: only these may fail
        markers: [optimizer]
        memory_budgets: [{phase: save, rank: 0, max_peak_delta_mib: 512}]  # or max_peak_delta_x_shard

Every problem names the file, the entry and the key, and the whole file is checked before any
case runs.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness.memory import Budget
from harness.topology import Topology, TopologyError

KNOWN_MARKERS = frozenset(
    {"smoke", "optimizer", "resume", "refusal", "hf", "peft", "slow", "memory", "gpu", "cp", "tied"}
)
_TOP_KEYS = {"name", "description", "defaults", "entries"}
_DEFAULT_KEYS = {"backends", "timeout_s", "max_world_size", "markers"}
_ENTRY_KEYS = {
    "case", "models", "backends", "pairs", "cross", "axes", "options", "expect", "xfail", "markers", "timeout_s",
    "memory_budgets", "tag",
}


class MatrixError(ValueError):
    pass


@dataclass(frozen=True)
class CaseSpec:
    case: str
    model: str
    backend: str
    source: Topology
    target: Topology
    options: tuple[tuple[str, Any], ...] = ()
    axes: tuple[str, ...] = ()  # option names that vary in this entry (shown in the id)
    tag: str = ""  # an entry's own suffix, to tell apart entries that differ only in fixed options
    expect: str = "pass"
    xfail: str | None = None
    xfail_match: str | None = None  # the failure must match this regex to count as the expected one
    xfail_checks: tuple[str, ...] = ()  # if given: the checks that must fail, and the only ones that may
    markers: tuple[str, ...] = ()
    timeout_s: float = 300.0
    budgets: tuple[Budget, ...] = ()
    origin: str = ""  # file:entry, for messages

    @property
    def opts(self) -> dict[str, Any]:
        return dict(self.options)

    @property
    def id(self) -> str:
        axes = "".join(f"-{self.opts[a]}" if isinstance(self.opts[a], str) else f"-{a}={self.opts[a]}" for a in self.axes)
        tag = f"-{self.tag}" if self.tag else ""
        return f"{self.case}[{self.backend}-{self.model}-{self.source.id}->{self.target.id}{axes}{tag}]"


@dataclass
class Matrix:
    name: str
    path: Path
    description: str = ""
    cases: list[CaseSpec] = field(default_factory=list)

    def select(self, pattern: str | None) -> list[CaseSpec]:
        """`-k`-like selection: every whitespace-separated word must appear in the id."""
        if not pattern:
            return list(self.cases)
        words = pattern.split()
        return [c for c in self.cases if all(w in c.id for w in words)]


def _as_list(value: Any, where: str) -> list:
    if value is None:
        return []
    if isinstance(value, (str, dict)):
        return [value]
    if isinstance(value, list):
        return value
    raise MatrixError(f"{where}: expected a list, got {value!r}")


def _parse_pair(item: Any, where: str) -> tuple[Topology, Topology]:
    try:
        if isinstance(item, str):
            if "->" not in item:
                raise MatrixError(f"{where}: pair {item!r} must look like 'tp2pp1 -> tp1pp2'")
            src, dst = (p.strip() for p in item.split("->", 1))
            return Topology.parse(src), Topology.parse(dst)
        if isinstance(item, dict) and set(item) == {"source", "target"}:
            return Topology.parse(item["source"]), Topology.parse(item["target"])
    except TopologyError as exc:
        raise MatrixError(f"{where}: {exc}") from None
    raise MatrixError(f"{where}: a pair is 'SRC -> DST' or {{source: SRC, target: DST}}, got {item!r}")


def load_matrix(path: str | Path) -> Matrix:
    from cases import get_case
    from harness.backends import available as available_backends
    from harness.models import get_any_model as get_model

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise MatrixError(f"{path}: no such matrix file") from None
    except yaml.YAMLError as exc:
        raise MatrixError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise MatrixError(f"{path}: a matrix is a mapping with 'entries', got {type(raw).__name__}")
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise MatrixError(f"{path}: unknown top-level key(s) {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    defaults = raw.get("defaults") or {}
    unknown = set(defaults) - _DEFAULT_KEYS
    if unknown:
        raise MatrixError(f"{path}: defaults: unknown key(s) {sorted(unknown)}; allowed: {sorted(_DEFAULT_KEYS)}")
    entries = raw.get("entries")
    if not isinstance(entries, list) or not entries:
        raise MatrixError(f"{path}: 'entries' must be a non-empty list")
    matrix = Matrix(name=str(raw.get("name", path.stem)), path=path, description=str(raw.get("description", "")))
    max_world = defaults.get("max_world_size")
    seen: dict[str, str] = {}
    for i, entry in enumerate(entries):
        where = f"{path}: entries[{i}]"
        if not isinstance(entry, dict):
            raise MatrixError(f"{where}: an entry is a mapping, got {entry!r}")
        unknown = set(entry) - _ENTRY_KEYS
        if unknown:
            raise MatrixError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_ENTRY_KEYS)}")
        if "case" not in entry:
            raise MatrixError(f"{where}: missing required key 'case'")
        try:
            case = get_case(entry["case"])
        except KeyError as exc:
            raise MatrixError(f"{where}.case: {exc.args[0]}") from None
        models = _as_list(entry.get("models"), f"{where}.models")
        if not models:
            raise MatrixError(f"{where}: missing required key 'models'")
        for m in models:
            try:
                get_model(m)
            except KeyError as exc:
                raise MatrixError(f"{where}.models: {exc.args[0]}") from None
        backends = _as_list(entry.get("backends", defaults.get("backends", ["mcore_dist"])), f"{where}.backends")
        for b in backends:
            if b not in available_backends():
                raise MatrixError(f"{where}.backends: unknown backend {b!r}; available: {available_backends()}")
        pairs = [_parse_pair(p, f"{where}.pairs[{j}]") for j, p in enumerate(_as_list(entry.get("pairs"), f"{where}.pairs"))]
        if "cross" in entry:
            cross = entry["cross"]
            if not isinstance(cross, dict) or set(cross) != {"sources", "targets"}:
                raise MatrixError(f"{where}.cross: expected {{sources: [...], targets: [...]}}")
            try:
                srcs = [Topology.parse(t) for t in _as_list(cross["sources"], f"{where}.cross.sources")]
                dsts = [Topology.parse(t) for t in _as_list(cross["targets"], f"{where}.cross.targets")]
            except TopologyError as exc:
                raise MatrixError(f"{where}.cross: {exc}") from None
            pairs += [(s, d) for s in srcs for d in dsts]
        if not pairs:
            raise MatrixError(f"{where}: no topology pairs (give 'pairs' or 'cross')")
        expect = entry.get("expect", "pass")
        if expect not in ("pass", "refuse"):
            raise MatrixError(f"{where}.expect: must be 'pass' or 'refuse', got {expect!r}")
        xfail, xfail_match, xfail_checks = entry.get("xfail"), None, ()
        if isinstance(xfail, dict):
            if set(xfail) - {"reason", "match", "checks"} or "reason" not in xfail:
                raise MatrixError(f"{where}.xfail: expected a reason string or {{reason: ..., match: REGEX, checks: [NAME, ...]}}")
            checks = xfail.get("checks", [])
            if not isinstance(checks, list) or not all(isinstance(c, str) and c for c in checks):
                raise MatrixError(f"{where}.xfail.checks: expected a list of check names, got {checks!r}")
            xfail, xfail_match, xfail_checks = xfail["reason"], xfail.get("match"), tuple(checks)
            try:
                re.compile(xfail_match or "")
            except re.error as exc:
                raise MatrixError(f"{where}.xfail.match: bad regex: {exc}") from None
        if xfail is not None and (not isinstance(xfail, str) or not xfail.strip()):
            raise MatrixError(f"{where}.xfail: give the reason (the upstream defect) as a string")
        markers = tuple(_as_list(defaults.get("markers"), f"{path}: defaults.markers")) + tuple(
            _as_list(entry.get("markers"), f"{where}.markers")
        )
        bad = sorted(set(markers) - KNOWN_MARKERS)
        if bad:
            raise MatrixError(f"{where}.markers: unknown marker(s) {bad}; known: {sorted(KNOWN_MARKERS)}")
        options = entry.get("options") or {}
        axes = entry.get("axes") or {}
        if not isinstance(options, dict) or not isinstance(axes, dict):
            raise MatrixError(f"{where}: 'options' and 'axes' are mappings")
        for name, values in axes.items():
            if not isinstance(values, list) or not values:
                raise MatrixError(f"{where}.axes.{name}: expected a non-empty list of values")
        try:
            budgets = tuple(
                Budget.parse(b, f"{where}.memory_budgets[{j}]")
                for j, b in enumerate(_as_list(entry.get("memory_budgets"), f"{where}.memory_budgets"))
            )
        except (TypeError, ValueError) as exc:
            raise MatrixError(str(exc)) from None
        axis_names = tuple(axes)
        timeout_s = float(entry.get("timeout_s", defaults.get("timeout_s", 300)))
        for combo in itertools.product(*(axes[a] for a in axis_names)) if axis_names else [()]:
            opts = {**options, **dict(zip(axis_names, combo))}
            for model, backend, (src, dst) in itertools.product(models, backends, pairs):
                spec = CaseSpec(
                    case=entry["case"], model=model, backend=backend, source=src, target=dst,
                    options=tuple(sorted(opts.items())), axes=axis_names, expect=expect, xfail=xfail, xfail_match=xfail_match,
                    xfail_checks=xfail_checks,
                    markers=markers, timeout_s=timeout_s, budgets=budgets, tag=str(entry.get("tag", "")), origin=where,
                )
                for topo in (src, dst):
                    try:
                        topo.validate(get_model(model), available_ranks=max_world)
                    except TopologyError as exc:
                        raise MatrixError(f"{where}: {exc}") from None
                try:
                    case.validate(spec)
                except ValueError as exc:
                    raise MatrixError(f"{where}: {spec.id}: {exc}") from None
                if spec.id in seen:
                    raise MatrixError(f"{where}: case {spec.id} is already defined by {seen[spec.id]}")
                seen[spec.id] = where
                matrix.cases.append(spec)
    return matrix
