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
                                                         #     checks: [step]}: only these may fail;
                                                         # or {reason, match, raised_in: MODULE}: an error
                                                         #     raised in that upstream module
        markers: [optimizer]
        memory_budgets: [{phase: save, rank: 0, max_peak_delta_mib: 512}]  # or max_peak_delta_x_shard
        requires: [cuda, te, host-memory-gib>=64]   # what the machine must offer (harness.core.requires);
                                                    # unmet -> not-run with the reason

Every problem names the file, the entry and the key, and the whole file is checked before any
case runs.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from harness.core.frames import OWN_PACKAGES, project_of
from harness.core.memory import Budget
from harness.core.requires import RequirementError, closure
from harness.core.requires import parse as parse_requirement
from harness.core.spec import BACKEND_AXIS, MARKERS, CaseSpec, XFail
from harness.core.topology import Topology, TopologyError

#: libyaml's safe loader where PyYAML has it (the same safe schema, ~8x faster: architectures.yaml
#: parses in 35 ms, not 280, in every pytest worker's collection and every CLI call)
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_TOP_KEYS = {"name", "description", "defaults", "entries", "include"}
_DEFAULT_KEYS = {"backends", "timeout_s", "max_world_size", "markers"}
_ENTRY_KEYS = {
    "case", "models", "backends", "pairs", "cross", "axes", "options", "backend_options", "expect", "xfail", "markers", "timeout_s",
    "memory_budgets", "tag", "requires",
}


class MatrixError(ValueError):
    pass


@dataclass
class Matrix:
    name: str
    path: Path
    description: str = ""
    cases: list[CaseSpec] = field(default_factory=list)
    #: the matrix files `include:` brought in (their cases are in `cases`, origin naming their file)
    included: list[Path] = field(default_factory=list)

    def own(self) -> list[CaseSpec]:
        """The cases this file's own entries define (pytest collects an included file on its own)."""
        return [s for s in self.cases if s.origin.startswith(f"{self.path}: ")]

    def select(self, pattern: str | None, ids: list[str] | tuple[str, ...] = ()) -> list[CaseSpec]:
        """`-k`-like selection: every whitespace-separated word must appear in the id; `ids`, when
        given, keeps exactly those case ids (the gate's rerun of a regressed case), each of which
        must be a case of this matrix (a ValueError names the first that is not)."""
        words = (pattern or "").split()
        chosen = [c for c in self.cases if all(w in c.id for w in words)]
        if not ids:
            return chosen
        known = {c.id for c in chosen}
        if missing := [i for i in ids if i not in known]:
            raise ValueError(f"{self.path}: no case {missing[0]!r}{' matching -k ' + repr(pattern) if pattern else ''}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        return [c for c in chosen if c.id in set(ids)]


def _as_list(value: Any, where: str) -> list:
    if value is None:
        return []
    if isinstance(value, (str, dict)):
        return [value]
    if isinstance(value, list):
        return value
    raise MatrixError(f"{where}: expected a list, got {value!r}")


def _strings(value: Any, where: str) -> list[str]:
    items = _as_list(value, where)
    bad = [v for v in items if not isinstance(v, str) or not v]
    if bad:
        raise MatrixError(f"{where}: expected names (strings), got {bad!r}")
    return items


def _includes(value: Any, where: str) -> list[tuple[str, list[str] | None]]:
    """`include:` items: a file name (every case of it), or `{file: NAME, tags: [TAG, ...]}` (only
    the entries with those tags: the gate takes each workaround's `shown_by` entry this way)."""
    out: list[tuple[str, list[str] | None]] = []
    for i, item in enumerate(_as_list(value, where)):
        if isinstance(item, str) and item:
            out.append((item, None))
        elif isinstance(item, dict) and set(item) == {"file", "tags"} and isinstance(item["file"], str) and item["file"]:
            out.append((item["file"], _strings(item["tags"], f"{where}[{i}].tags")))
        else:
            raise MatrixError(f"{where}[{i}]: expected a file name or {{file: NAME, tags: [TAG, ...]}}, got {item!r}")
    return out


def _number(value: Any, where: str, kind: type = float) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)) or value <= 0:
        raise MatrixError(f"{where}: expected a positive {'integer' if kind is int else 'number'}, got {value!r}")
    return kind(value)


def _parse_pair(item: Any, where: str) -> tuple[Topology, Topology]:
    try:
        if isinstance(item, str):
            if "->" not in item:
                raise MatrixError(f"{where}: pair {item!r} must look like 'tp2pp1 -> tp1pp2'")
            src, dst = (p.strip() for p in item.split("->", 1))
            return Topology.parse(src), Topology.parse(dst)
        if isinstance(item, dict) and set(item) == {"source", "target"}:
            return Topology.parse(str(item["source"])), Topology.parse(str(item["target"]))
    except TopologyError as exc:
        raise MatrixError(f"{where}: {exc}") from None
    raise MatrixError(f"{where}: a pair is 'SRC -> DST' or {{source: SRC, target: DST}}, got {item!r}")


#: projects `raised_in` may not name: generic code every upstream project and the harness call into, so an
#: error raised there says nothing of whose defect it is (the gate bumps Megatron-Core/Bridge, transformers, ...)
GENERIC_PROJECTS = ("torch",)
#: a dotted module prefix (`megatron.core.dist_checkpointing`), as `raised_in` names one
_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def _parse_xfail(raw: Any, where: str, entry: str = "") -> XFail | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        if not raw.strip():
            raise MatrixError(f"{where}: give the reason (the upstream defect) as a string")
        return XFail(raw)
    if not isinstance(raw, dict) or set(raw) - {"reason", "match", "checks", "raised_in", "known_on"} or "reason" not in raw:
        raise MatrixError(f"{where}: expected a reason string or {{reason: ..., match: REGEX, checks: [NAME, ...]}} "
                          "or {reason: ..., match: REGEX, raised_in: MODULE}, each with an optional "
                          "known_on: [{release: 'megatron-bridge<0.6', match/checks/raised_in: ...}]")
    if not isinstance(raw["reason"], str) or not raw["reason"].strip():
        raise MatrixError(f"{where}.reason: give the reason (the upstream defect) as a string")
    match = raw.get("match")
    if match is not None:
        if not isinstance(match, str):
            raise MatrixError(f"{where}.match: expected a regex string, got {match!r}")
        try:
            re.compile(match)
        except re.error as exc:
            raise MatrixError(f"{where}.match: bad regex: {exc}") from None
    checks = raw.get("checks", [])
    if not isinstance(checks, list) or not all(isinstance(c, str) and c for c in checks):
        raise MatrixError(f"{where}.checks: expected a list of check names, got {checks!r}")
    raised_in = raw.get("raised_in")
    where = f"{where} ({entry})" if entry else where  # the raising-frame rule's messages name the entry
    if raised_in is not None:
        if not isinstance(raised_in, str) or not _MODULE.match(raised_in):
            raise MatrixError(f"{where}.raised_in: expected a dotted module prefix (e.g. megatron.core.dist_checkpointing), "
                              f"got {raised_in!r}")
        if raised_in.split(".", 1)[0] in OWN_PACKAGES:
            raise MatrixError(f"{where}.raised_in: {raised_in!r} is the harness's own code; an error raised there is a "
                              "harness error, never an upstream defect: name the upstream module, or record a failed check")
        if project_of(raised_in) in GENERIC_PROJECTS:
            raise MatrixError(f"{where}.raised_in: {raised_in!r} is {project_of(raised_in)}, generic code where harness "
                              "errors surface too; name the module of the bumped project (megatron.core, "
                              "megatron.bridge, transformers, peft, verl, ...) whose frame called into it, where "
                              "the defect lies (its innermost frame in that project must be inside it)")
        if not match or checks:
            raise MatrixError(f"{where}.raised_in: only an xfail that accepts an error (`match` and no `checks`) has a "
                              "raising frame to name; a checks-based xfail never accepts an error")
    elif match and not checks:
        raise MatrixError(f"{where}: an xfail with `match` and no `checks` accepts an error, so it must say where the "
                          "defect raises: add `raised_in: <upstream module prefix>` (the raising frame's module, e.g. "
                          "megatron.core.dist_checkpointing), never an exception class alone")
    return XFail(raw["reason"], match, tuple(checks), raised_in, _known_on(raw, where, entry))


def _known_on(raw: dict, where: str, entry: str) -> tuple[tuple[str, XFail], ...]:
    """`known_on:` the defect's signature on other releases: each a PEP 508 requirement (`release`)
    with its own match/checks/raised_in, validated as an xfail of its own."""
    from packaging.requirements import InvalidRequirement, Requirement

    items = raw.get("known_on") or []
    if not isinstance(items, list):
        raise MatrixError(f"{where}.known_on: expected a list of {{release: REQUIREMENT, match/checks/raised_in}}")
    out = []
    for i, item in enumerate(items):
        at = f"{where}.known_on[{i}]"
        if not isinstance(item, dict) or "release" not in item or set(item) - {"release", "match", "checks", "raised_in"}:
            raise MatrixError(f"{at}: expected {{release: 'megatron-bridge<0.6', match/checks/raised_in: ...}}, got {item!r}")
        try:
            Requirement(str(item["release"]))
        except InvalidRequirement as exc:
            raise MatrixError(f"{at}.release: not a requirement ({exc})") from None
        sig = {k: v for k, v in item.items() if k != "release"}
        out.append((str(item["release"]), _parse_xfail({"reason": raw["reason"], **sig}, at, entry)))
    return tuple(out)


def load_matrix(path: str | Path, max_world: int | None = None, _within: tuple[Path, ...] = ()) -> Matrix:
    """Read and validate a whole matrix file; every problem is a MatrixError naming file, entry and key.

    `include: [other.yaml, ...]` (paths relative to this file) adds every case of those matrices
    (`{file: other.yaml, tags: [...]}`: only its entries with those tags),
    each with its own defaults, before this file's own `entries` (optional then): one selection
    that `run`, `gate` and `sweep` take as one matrix (matrices/gate.yaml). A case id defined twice
    across the files, or an include cycle, is a MatrixError naming both places.

    `max_world` cuts every topology above that many ranks to one that fits (harness.core.cut's rule),
    after the matrix is validated as written; cases that collapse to one id run once, and each
    cut case's notes say which pair(s) it was written as."""
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(), Loader=SAFE_LOADER)
    except FileNotFoundError:
        raise MatrixError(f"{path}: no such matrix file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MatrixError(f"{path}: cannot read: {exc}") from None
    except yaml.YAMLError as exc:
        raise MatrixError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise MatrixError(f"{path}: a matrix is a mapping with 'entries', got {type(raw).__name__}")
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise MatrixError(f"{path}: unknown top-level key(s) {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    defaults = raw.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise MatrixError(f"{path}: defaults: expected a mapping of {sorted(_DEFAULT_KEYS)}, got {defaults!r}")
    unknown = set(defaults) - _DEFAULT_KEYS
    if unknown:
        raise MatrixError(f"{path}: defaults: unknown key(s) {sorted(unknown)}; allowed: {sorted(_DEFAULT_KEYS)}")
    matrix = Matrix(name=str(raw.get("name", path.stem)), path=path, description=str(raw.get("description", "")))
    seen: dict[str, str] = {}
    for name, tags in _includes(raw.get("include"), f"{path}: include"):
        other = path.parent / name
        if other.resolve() in _within + (path.resolve(),):
            raise MatrixError(f"{path}: include: {name} includes itself (a cycle through {[str(p) for p in _within]})")
        cases = load_matrix(other, None, _within + (path.resolve(),)).cases
        if tags is not None:
            if unknown := [t for t in tags if not any(c.tag == t for c in cases)]:
                raise MatrixError(f"{path}: include: {name} has no entry tagged {unknown[0]!r}")
            cases = [c for c in cases if c.tag in tags]
        for spec in cases:
            if spec.id in seen:  # the same case in two files (the smoke's per-family slice): once, if it is the same
                first = next(c for c in matrix.cases if c.id == spec.id)
                if _same_case(first, spec):
                    continue
                raise MatrixError(f"{path}: include: case {spec.id} of {spec.origin} differs from its definition in {seen[spec.id]}")
            seen[spec.id] = spec.origin
            matrix.cases.append(spec)
        matrix.included.append(other)
    entries = raw.get("entries")
    if not matrix.included and (not isinstance(entries, list) or not entries):
        raise MatrixError(f"{path}: 'entries' must be a non-empty list")
    if entries is not None and not isinstance(entries, list):
        raise MatrixError(f"{path}: 'entries' must be a list, got {type(entries).__name__}")
    file_max_world = _number(defaults["max_world_size"], f"{path}: defaults.max_world_size", int) if "max_world_size" in defaults else None
    default_timeout = _number(defaults.get("timeout_s", 300), f"{path}: defaults.timeout_s")
    default_backends = _strings(defaults.get("backends", ["mcore_dist"]), f"{path}: defaults.backends")
    default_markers = _strings(defaults.get("markers"), f"{path}: defaults.markers")
    for i, entry in enumerate(entries or ()):
        where = f"{path}: entries[{i}]"
        for spec in _entry_specs(entry, where, default_backends, default_markers, default_timeout, file_max_world):
            if spec.id in seen:
                raise MatrixError(f"{where}: case {spec.id} is already defined by {seen[spec.id]}")
            seen[spec.id] = where
            matrix.cases.append(spec)
    if max_world is not None:
        matrix.cases = _cut_cases(matrix.cases, _number(max_world, "--max-world", int))
    return matrix


def _same_case(a: CaseSpec, b: CaseSpec) -> bool:
    """One case written in two files: equal but for where it is written, its markers and timeout."""
    return replace(a, origin="", notes=(), markers=(), timeout_s=0.0) == replace(b, origin="", notes=(), markers=(), timeout_s=0.0)


def _cut_cases(specs: list[CaseSpec], max_world: int) -> list[CaseSpec]:
    """Each spec with its topologies cut to `max_world` ranks, re-validated (a cut the case refuses is
    a MatrixError naming the entry and both pairs), deduplicated by id keeping the first."""
    from harness.cases import get_case
    from harness.core.cut import cut
    from harness.core.zoo import get_model

    out: dict[str, CaseSpec] = {}
    for spec in specs:
        try:
            src, dst = cut(spec.source, max_world), cut(spec.target, max_world)
        except ValueError as exc:  # the cut topology cannot exist (TopologyError), e.g. ep no longer divides it
            raise MatrixError(f"{spec.origin}: {spec.id} cannot be cut to --max-world {max_world}: {exc}") from None
        if (src, dst) == (spec.source, spec.target):
            out.setdefault(spec.id, spec)
            continue
        written = f"{spec.source.id} -> {spec.target.id}"
        new = replace(spec, source=src, target=dst,
                      notes=spec.notes + (f"cut to --max-world {max_world}: written as {written}",))
        try:
            if spec.expect == "refuse" and spec.source != spec.target and src == dst:
                raise ValueError("the cut makes source and target the same topology: no reshard is left to refuse")
            for topo in (src, dst):
                topo.validate(get_model(spec.model))
            get_case(spec.case).validate(new)
        except ValueError as exc:  # TopologyError is a ValueError
            raise MatrixError(f"{spec.origin}: {spec.id} cut to --max-world {max_world} as {src.id} -> {dst.id}: {exc}") from None
        if new.id in out:
            first = out[new.id]
            if replace(first, origin="", notes=()) != replace(new, origin="", notes=()):
                raise MatrixError(f"{spec.origin}: cut to --max-world {max_world}, {written} becomes {new.id}, which "
                                  f"{first.origin} defines differently (options, expectation, budgets or requirements): "
                                  "give one entry a `tag`")
            out[new.id] = replace(first, notes=first.notes + (f"also covers {written} (same case after the cut)",))
        else:
            out[new.id] = new
    return list(out.values())


def _entry_specs(
    entry: Any, where: str, default_backends: list[str], default_markers: list[str], default_timeout: float, max_world: int | None
) -> list[CaseSpec]:
    from harness.cases import get_case
    from harness.backends import available as available_backends
    from harness.core.zoo import get_model

    if not isinstance(entry, dict):
        raise MatrixError(f"{where}: an entry is a mapping, got {entry!r}")
    unknown = set(entry) - _ENTRY_KEYS
    if unknown:
        raise MatrixError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_ENTRY_KEYS)}")
    if "case" not in entry:
        raise MatrixError(f"{where}: missing required key 'case'")
    try:
        case = get_case(str(entry["case"]))
    except KeyError as exc:
        raise MatrixError(f"{where}.case: {exc.args[0]}") from None
    models = _strings(entry.get("models"), f"{where}.models")
    if not models:
        raise MatrixError(f"{where}: missing required key 'models'")
    for m in models:
        try:
            get_model(m)
        except KeyError as exc:
            raise MatrixError(f"{where}.models: {exc.args[0]}") from None
    backends = _strings(entry["backends"], f"{where}.backends") if "backends" in entry else default_backends
    for b in backends:
        if b not in available_backends():
            raise MatrixError(f"{where}.backends: unknown backend {b!r}; available: {available_backends()}")
    pairs = [_parse_pair(p, f"{where}.pairs[{j}]") for j, p in enumerate(_as_list(entry.get("pairs"), f"{where}.pairs"))]
    if "cross" in entry:
        cross = entry["cross"]
        if not isinstance(cross, dict) or set(cross) != {"sources", "targets"}:
            raise MatrixError(f"{where}.cross: expected {{sources: [...], targets: [...]}}")
        try:
            srcs = [Topology.parse(t) for t in _strings(cross["sources"], f"{where}.cross.sources")]
            dsts = [Topology.parse(t) for t in _strings(cross["targets"], f"{where}.cross.targets")]
        except TopologyError as exc:
            raise MatrixError(f"{where}.cross: {exc}") from None
        pairs += [(s, d) for s in srcs for d in dsts]
    if not pairs:
        raise MatrixError(f"{where}: no topology pairs (give 'pairs' or 'cross')")
    expect = entry.get("expect", "pass")
    if expect not in ("pass", "refuse"):
        raise MatrixError(f"{where}.expect: must be 'pass' or 'refuse', got {expect!r}")
    named = f"case {entry['case']}" + (f", tag {entry['tag']}" if entry.get("tag") else "")  # the entry, for its author
    xfail = _parse_xfail(entry.get("xfail"), f"{where}.xfail", named)
    markers = tuple(default_markers) + tuple(_strings(entry.get("markers"), f"{where}.markers"))
    bad = sorted(set(markers) - set(MARKERS))
    if bad:
        raise MatrixError(f"{where}.markers: unknown marker(s) {bad}; known: {sorted(MARKERS)}")
    options = entry.get("options") or {}
    backend_options = entry.get("backend_options") or {}
    axes = entry.get("axes") or {}
    if not isinstance(options, dict) or not isinstance(axes, dict) or not isinstance(backend_options, dict):
        raise MatrixError(f"{where}: 'options', 'backend_options' and 'axes' are mappings")
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
    timeout_s = _number(entry["timeout_s"], f"{where}.timeout_s") if "timeout_s" in entry else default_timeout
    try:
        requires = tuple(parse_requirement(r) for r in _strings(entry.get("requires"), f"{where}.requires"))
    except RequirementError as exc:
        raise MatrixError(f"{where}.requires: {exc}") from None
    tag = entry.get("tag", "")
    if not isinstance(tag, str):
        raise MatrixError(f"{where}.tag: expected a string, got {tag!r}")
    axis_names = tuple(axes)
    out = []
    for combo in itertools.product(*(axes[a] for a in axis_names)) if axis_names else [()]:
        chosen = dict(zip(axis_names, combo))
        opts = {**options, **{a: v for a, v in chosen.items() if not a.startswith(BACKEND_AXIS)}}
        bopts = {**backend_options, **{a[len(BACKEND_AXIS):]: v for a, v in chosen.items() if a.startswith(BACKEND_AXIS)}}
        for model, backend, (src, dst) in itertools.product(models, backends, pairs):
            spec = CaseSpec(
                case=case.name, model=model, backend=backend, source=src, target=dst, options=tuple(sorted(opts.items())),
                backend_options=tuple(sorted(bopts.items())),
                axes=axis_names, expect=expect, xfail=xfail, markers=markers, timeout_s=timeout_s, budgets=budgets, tag=tag,
                origin=where, requires=closure(frozenset(requires)),  # what the entry declares, for the case's validation
            )
            for topo in (src, dst):
                try:
                    topo.validate(get_model(model), available_ranks=max_world)
                except TopologyError as exc:
                    raise MatrixError(f"{where}: {exc}") from None
            try:
                typed = case.validate(spec)
            except ValueError as exc:
                raise MatrixError(f"{where}: {spec.id}: {exc}") from None
            out.append(replace(spec, requires=closure(frozenset(requires) | case.machine_requirements(typed))))
    return out
