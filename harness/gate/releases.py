"""Release sets: a candidate plus the companions its release needs, resolved before the venv build.

Stdlib only (envspec.py imports this, and scripts/ensure-env runs envspec with a bare python3.12);
package metadata, version logic and the pins are read by harness/gate/metadata.py (stdlib too).

Why: an override used to drop only its own pin. `megatron-core==0.15.3` then failed (it requires
numpy<2, the constraints pin numpy 2.x, and contourpy/pandas/scipy pinned there require numpy>=2),
and a Megatron-Bridge bump left transformers and megatron-core at pins that release never ran with
(Bridge's wheel declares `megatron-core` without a version and transformers narrowly).

`resolve_release_set(specs, root, baseline_venv)`:
  1. reads each candidate's own metadata (an index release's wheel METADATA fetched with
     `pip download --no-deps`, a wheel file's METADATA, a source tree's pyproject.toml; a VCS URL
     cannot be read without building it: noted, pairing table only);
  2. for Megatron-Bridge adds megatron-core from the Core line that Bridge minor was built against
     (BRIDGE_CORE; a Bridge source tree's own 3rdparty/Megatron-LM checkout wins when present);
  3. every requirement of a candidate or companion that the project's pin does not satisfy moves
     that package: its pin is dropped and the requirement's range added (a Companion with why);
  4. pinned packages whose own requirement on a moved package cannot hold any more (contourpy 1.4.0:
     numpy>=2.0 against numpy<2) are dropped too, transitively, so pip re-resolves them;
  5. a user-given `PKG==V` wins over any companion; where it contradicts a requirement the set
     records it (`overridden`), and where pip itself would have to satisfy both (the requirement
     comes from a package installed with its deps) the set is unsolvable: UnsolvableReleaseSet,
     one line per conflict (the CLI exits 2).

Pairing evidence (BRIDGE_CORE): the git tags of github.com/NVIDIA-NeMo/Megatron-Bridge, each tag's
`3rdparty/Megatron-LM` submodule commit (`git ls-tree <tag> 3rdparty/Megatron-LM`) and
megatron/core/package_info.py of github.com/NVIDIA/Megatron-LM at that commit, recorded in
tests/data/bridge_core_pairing.json (tests/test_releases.py checks the table against it):
v0.3.x -> Core 0.16.0/0.16.1, v0.4.x -> 0.17.0rc0/0.17.1, v0.5.x -> 0.18.0/0.18.2, v0.6.0 -> 0.19.0.
v0.2.x is left out: its submodule is a 0.16.0rc0 development tree while its pyproject declares
megatron-core<0.16.0.

Integration (envspec.resolve): drop `ReleaseSet.drop_names()` from requirements.txt,
constraints.txt and requirements-verl.txt (never from requirements-nodeps.txt), and append
`ReleaseSet.extra_specs()` to requirements.txt, next to the user overrides as today.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.gate import directref
from harness.gate.metadata import (
    BRIDGE,
    CORE,
    MARKER_ENV,
    NODEPS,
    PIN_FILES,
    InvalidRequirement,
    InvalidVersion,
    Metadata,
    MetadataSource,
    PipIndex,
    Requirement,
    SpecifierSet,
    Version,
    _parse_requires,
    _satisfies,
    baseline_requires,
    canonicalize_name,
    compatible,
    default_cache,
    normalize,
    read_pins,
    read_tree,
    read_wheel,
)

# The metadata names re-exported for callers of releases (releases_cli, the tests, envspec).
__all__ = ["BRIDGE", "CORE", "BRIDGE_CORE", "HEAVY", "MARKER_ENV", "NODEPS", "PIN_FILES", "InvalidRequirement", "InvalidVersion",
           "Metadata", "MetadataSource", "PipIndex", "Requirement", "SpecifierSet", "Version", "baseline_requires",
           "canonicalize_name", "compatible", "default_cache", "normalize", "read_pins", "read_tree", "read_wheel",
           "UnsolvableReleaseSet", "Companion", "Dropped", "Asked", "ReleaseSet", "core_minor", "core_line", "pairing_problem",
           "parse_asked", "resolve_release_set"]

# Bridge minor -> the Core minor its release tags carry in 3rdparty/Megatron-LM (evidence above).
BRIDGE_CORE: dict[str, str] = {"0.3": "0.16", "0.4": "0.17", "0.5": "0.18", "0.6": "0.19"}
# Companions whose metadata is not downloaded to follow their own requirements (a wheel of GBs).
HEAVY = frozenset({"torch", "triton", "tensorflow", "jax", "jaxlib", "vllm", "flashinfer-python"})
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_VERSION_SPEC = re.compile(rf"^({_NAME})\s*==\s*([A-Za-z0-9][A-Za-z0-9.+!_-]*)$")
_VCS_SPEC = re.compile(rf"^({_NAME})\s*@\s*(\S+)$")


class UnsolvableReleaseSet(Exception):
    """Requirements pip would have to satisfy together and cannot: one line per conflict."""

    def __init__(self, lines: list[str]):
        self.lines = list(lines)
        super().__init__("\n".join(self.lines))


@dataclass(frozen=True)
class Companion:
    name: str
    spec: str  # the requirement line pip gets
    reason: str


@dataclass(frozen=True)
class Dropped:
    name: str
    pinned: str  # the version the project pinned
    why: str  # "conflict: ..." or "dependent-of-X: ..."
    files: tuple[str, ...]  # the pin files that carried it


@dataclass(frozen=True)
class Asked:
    """One user SPEC: NAME==V, NAME @ URL, a source tree or a wheel file."""

    spec: str
    kind: str  # version | vcs | tree | wheel
    name: str | None  # None until a tree/wheel is read
    version: str | None = None
    path: str | None = None
    url: str | None = None


@dataclass(frozen=True)
class ReleaseSet:
    asked: tuple[str, ...]
    resolved: tuple[Companion, ...] = ()
    dropped: tuple[Dropped, ...] = ()
    conflicts: tuple[str, ...] = ()  # unsolvable lines: only in `failed()`'s record (resolution raises instead)
    overridden: tuple[str, ...] = ()  # a user pin that beat a declared requirement (the user wins; shown in the verdict)
    notes: tuple[str, ...] = ()  # pairing mismatches, unreadable metadata
    candidates: tuple[dict, ...] = field(default=())  # per asked spec: name, version, origin

    @classmethod
    def failed(cls, specs: list[str], exc: UnsolvableReleaseSet) -> ReleaseSet:
        """The record of an unsolvable set, for verdict.md and results.json before exiting 2."""
        return cls(tuple(specs), conflicts=tuple(exc.lines))

    def drop_names(self) -> set[str]:
        """Names whose pins come out of requirements.txt, constraints.txt, requirements-verl.txt."""
        return {d.name for d in self.dropped} | {c.name for c in self.resolved}

    def extra_specs(self) -> list[str]:
        """Requirement lines to append to requirements.txt (the user's own overrides are not here):
        each companion's range, and the bare name of a dropped dependent that was a direct
        requirement (it must stay installed, at whatever version pip picks)."""
        direct = [d.name for d in self.dropped if set(d.files) - {"constraints.txt"}]
        return [c.spec for c in self.resolved] + direct

    def mismatch(self) -> list[str]:
        """The notes saying Bridge and Core are not one release (the gate says so instead of blaming torch)."""
        return [n for n in self.notes if n.startswith("mismatch:")]

    def to_dict(self) -> dict:
        return {"asked": list(self.asked), "candidates": [dict(c) for c in self.candidates],
                "resolved": [asdict(c) for c in self.resolved],
                "dropped": [{**asdict(d), "files": list(d.files)} for d in self.dropped],
                "conflicts": list(self.conflicts), "overridden": list(self.overridden), "notes": list(self.notes)}

    def markdown(self) -> str:
        """A short section for verdict.md: what was asked, what moved with it and why."""
        out = ["### Release set", "", f"Asked: {', '.join(f'`{a}`' for a in self.asked) or '(baseline)'}", ""]
        if self.resolved or self.dropped:
            out += ["| package | becomes | why |", "|---|---|---|"]
            out += [f"| {c.name} | `{c.spec}` | {c.reason} |" for c in self.resolved]
            out += [f"| {d.name} | unpinned (was {d.pinned}) | {d.why} |" for d in self.dropped]
            out.append("")
        for title, lines in (("Conflicts (unsolvable)", self.conflicts), ("User pins over declared requirements", self.overridden), ("Notes", self.notes)):
            if lines:
                out += [f"{title}:", *[f"- {ln}" for ln in lines], ""]
        return "\n".join(out)

    def text(self) -> str:
        """The set as printed before the build."""
        out = [f"release set for {' '.join(self.asked) or '(baseline)'}:"]
        out += [f"  candidate {c['name']} {c.get('version') or '?'}  ({c.get('origin', '')})" for c in self.candidates]
        out += [f"  + {c.spec:<40} {c.reason}" for c in self.resolved]
        out += [f"  - {d.name + '==' + d.pinned:<40} {d.why}" for d in self.dropped]
        out += [f"  ! conflict: {ln}" for ln in self.conflicts]
        out += [f"  ! user pin wins: {ln}" for ln in self.overridden]
        out += [f"  note: {ln}" for ln in self.notes]
        return "\n".join(out)


# ---------------------------------------------------------------- pairing


def core_minor(bridge_version: str) -> str | None:
    """The Core minor ("0.18") a Bridge release was built against, None when the table does not say."""
    try:
        r = Version(bridge_version).release
    except InvalidVersion:
        return None
    return BRIDGE_CORE.get(f"{r[0]}.{r[1] if len(r) > 1 else 0}")


def _line(minor: str) -> str:
    major, mi = (int(x) for x in minor.split(".")[:2])
    return f"{CORE}>={major}.{mi}.0,<{major}.{mi + 1}.0"


def core_line(bridge_version: str) -> str | None:
    """The megatron-core requirement a Bridge release pairs with: a range, so pip takes the newest
    patch of that Core minor."""
    minor = core_minor(bridge_version)
    return _line(minor) if minor else None


def pairing_problem(bridge_version: str, core_version: str) -> str | None:
    """Why (bridge, core) is not a release set (Bridge was built against another Core minor), or None
    when they pair or the Bridge minor is not in the table."""
    minor = core_minor(bridge_version)
    if minor is None:
        return None
    try:
        r = Version(core_version).release
    except InvalidVersion:
        return None
    if f"{r[0]}.{r[1] if len(r) > 1 else 0}" == minor:
        return None
    return (f"megatron-bridge {bridge_version} was built against megatron-core {minor}.x (its 3rdparty/Megatron-LM pin), "
            f"megatron-core {core_version} is another line: not a valid release set")


# ---------------------------------------------------------------- resolution


def parse_asked(spec: str, cwd: Path | None = None, cache: Path | None = None) -> Asked:
    """A user SPEC in envspec's forms (parsed here too: this module must not import envspec). A
    direct reference (NAME @ file:... / NAME @ https://....whl, harness/gate/directref.py) is the
    tree or wheel it names; a wheel URL is downloaded once into `cache` (default: default_cache())."""
    s = spec.strip()
    if direct := directref.match(s):
        name, url = direct
        if directref.is_file_url(url):
            p = directref.file_path(spec, url, cwd or Path.cwd())
        else:
            p = directref.fetch_wheel(spec, url, cache or default_cache())
        return Asked(spec, "wheel" if p.name.endswith(".whl") else "tree", normalize(name), path=str(p), url=url)
    if m := _VERSION_SPEC.match(s):
        return Asked(spec, "version", normalize(m[1]), version=m[2])
    if (m := _VCS_SPEC.match(s)) and "://" in m[2]:
        return Asked(spec, "vcs", normalize(m[1]), url=m[2])
    if s.endswith(".whl") or "/" in s or s.startswith((".", "~")):
        p = Path(s).expanduser()
        p = (p if p.is_absolute() else (cwd or Path.cwd()) / p).resolve()
        return Asked(spec, "wheel" if s.endswith(".whl") else "tree", None, path=str(p))
    raise ValueError(f"{spec!r}: not a SPEC: expected NAME==VERSION, NAME @ git+URL@COMMIT, a source directory, a .whl file, "
                     "NAME @ file:///path or NAME @ https://....whl")


def _read(asked: Asked, source: MetadataSource) -> Metadata:
    if asked.kind == "version":
        return source.index(f"{asked.name}=={asked.version}")
    if asked.kind == "wheel":
        return source.wheel(Path(asked.path or ""))
    if asked.kind == "tree":
        return source.tree(Path(asked.path or ""))
    return Metadata(asked.name or "?", None, (), origin=asked.url or "",
                    note=f"{asked.spec}: a VCS URL's metadata cannot be read without building it; companions from the pairing table only")


@dataclass
class _Need:
    """The requirements gathered on one package: (specifier, who asked, installed with deps?)."""

    items: list[tuple[SpecifierSet, str, bool]] = field(default_factory=list)

    def spec(self) -> SpecifierSet:
        out = SpecifierSet("")
        for s, _, _ in self.items:
            out &= s
        return out


def resolve_release_set(specs: list[str], root: Path, baseline_venv: Path | None,
                        metadata: MetadataSource | None = None, strict: bool = False, cache: Path | None = None) -> ReleaseSet:
    """Resolve the candidate `specs` into a release set against the project's pins at `root`.

    Raises UnsolvableReleaseSet (one line per conflict) when pip would have to satisfy contradicting
    requirements; with strict=True a user pin against a declared requirement is one too. LookupError
    when a candidate's metadata cannot be fetched (no such release); ValueError for a bad SPEC."""
    source = metadata or PipIndex()
    pins, pin_files = read_pins(root)
    nodeps = {n for n, fs in pin_files.items() if NODEPS in fs}
    rdeps = baseline_requires(baseline_venv)
    asked = [parse_asked(s, root, cache) for s in specs]
    notes: list[str] = []
    metas: list[Metadata] = []
    for a in asked:
        meta = _read(a, source)
        metas.append(meta)
        if meta.note:
            notes.append(meta.note)
    user: dict[str, Metadata] = {m.name: m for m in metas}
    candidates = tuple({"spec": a.spec, "name": m.name, "version": m.version, "origin": m.origin} for a, m in zip(asked, metas))

    needs: dict[str, _Need] = {}
    companions: dict[str, list[str]] = {}  # name -> reasons
    followed: set[str] = set()
    queue: list[tuple[Metadata, bool]] = [(m, m.name not in nodeps) for m in metas]

    # Bridge -> Core: the Core line this Bridge was built against, unless the user named a Core.
    bridge = user.get(BRIDGE)
    pinned_core = pins.get(CORE)
    if bridge is not None and CORE not in user:
        line, why = None, None
        if bridge.core_version:
            line = _line(Version(bridge.core_version).base_version)
            why = f"megatron-bridge tree's 3rdparty/Megatron-LM is Core {bridge.core_version}"
        elif bridge.version and (line := core_line(bridge.version)):
            why = f"megatron-bridge {bridge.version} was built against this Core line (pairing table)"
        if line is None:
            notes.append(f"no Core pairing known for megatron-bridge {bridge.version or bridge.origin}: megatron-core stays at {pinned_core}")
        elif pinned_core and _satisfies(pinned_core, SpecifierSet(line[len(CORE):])):
            pass  # the pinned Core is of that line already
        else:
            needs.setdefault(CORE, _Need()).items.append((SpecifierSet(line[len(CORE):]), why or "", True))
            companions.setdefault(CORE, []).append(f"{why}; pinned {pinned_core}")
            try:
                follow = source.index(line)
                companions[CORE].append(f"newest on the index: {follow.version}")
                queue.append((follow, True))
                followed.add(CORE)
            except LookupError as exc:
                notes.append(str(exc))
    # A Core (asked or pinned) against the Bridge (asked or pinned): say when they are not one release.
    core_v = user[CORE].version if CORE in user else None
    bridge_v = bridge.version if bridge else pins.get(BRIDGE)
    if core_v and bridge_v and (problem := pairing_problem(bridge_v, core_v)):
        notes.append(f"mismatch: {problem}" + ("" if bridge else f" (megatron-bridge=={bridge_v} is the pinned one; name a Bridge to move it)"))

    overridden: list[str] = []
    conflicts: list[str] = []
    tried: set[str] = set()
    while queue:
        meta, with_deps = queue.pop(0)
        who = f"{meta.name} {meta.version or '?'}"
        for req in _parse_requires(meta.requires):
            name = normalize(req.name)
            if name == meta.name:
                continue
            if name in user:
                uv = user[name].version
                if uv and not _satisfies(uv, req.specifier):
                    line = f"{user[name].name}=={uv} (asked) against {who} requires {req.name}{req.specifier}"
                    if with_deps or strict:
                        conflicts.append(line + ("" if with_deps else " (strict)"))
                    else:
                        overridden.append(line + f" ({meta.name} is installed --no-deps: pip does not enforce it)")
                continue
            need = needs.setdefault(name, _Need())
            need.items.append((req.specifier, f"{who} requires {req.name}{req.specifier}", with_deps))
            pinned = pins.get(name)
            if pinned is None or name in nodeps:
                continue  # unpinned: pip brings it (with_deps) or it is not installed (--no-deps)
            if _satisfies(pinned, need.spec()):
                continue
            if name not in companions or not _satisfies(pinned, req.specifier):
                companions.setdefault(name, []).append(f"{who} requires {req.name}{req.specifier}; pinned {pinned}")
            if name not in followed and name not in HEAVY and not name.startswith("nvidia-"):
                followed.add(name)
                try:
                    follow = source.index(f"{name}{need.spec()}")
                    companions[name].append(f"newest on the index: {follow.version}")
                    queue.append((follow, True))
                except LookupError as exc:
                    notes.append(str(exc))
        if not queue:  # settled: a dependent that must leave its pin gets the newest release that fits the moves
            moved = _moved(companions, needs, user, pins)
            for d in _dependents(companions, needs, user, pins, pin_files, nodeps, rdeps):
                if d.name in tried or d.name in HEAVY:
                    continue
                tried.add(d.name)
                if fit := _newest_accepting(source, d.name, needs[d.name].spec() if d.name in needs else SpecifierSet(""), moved):
                    needs.setdefault(d.name, _Need()).items.append((SpecifierSet(f"=={fit.version}"), d.why, True))
                    companions[d.name] = [d.why, f"newest {d.name} on the index that accepts it: {fit.version}"]
                    followed.add(d.name)
                    queue.append((fit, True))

    for name, need in needs.items():
        # a companion's line carries every requirement on it; elsewhere pip enforces only the with-deps ones
        items = need.items if name in companions else [i for i in need.items if i[2]]
        if len(items) > 1 and not compatible(*(s for s, _, _ in items)):
            conflicts.append(f"{name}: " + " against ".join(w for _, w, _ in items))
    if conflicts:
        raise UnsolvableReleaseSet(conflicts)

    resolved = tuple(Companion(n, f"{n}{needs[n].spec()}", "; ".join(dict.fromkeys(rs))) for n, rs in sorted(companions.items()))
    dropped = _dependents(companions, needs, user, pins, pin_files, nodeps, rdeps)
    return ReleaseSet(tuple(specs), resolved, dropped, (), tuple(overridden), tuple(notes), candidates)


def _dependents(companions: dict[str, list[str]], needs: dict[str, _Need], user: dict[str, Metadata], pins: dict[str, str],
                pin_files: dict[str, list[str]], nodeps: set[str], rdeps: dict[str, list[Requirement]]) -> tuple[Dropped, ...]:
    """Pinned packages whose own requirement on a moved package cannot hold with its new range,
    transitively: a dropped dependent must leave its pin, so its own pinned dependents that require
    exactly that pin go as well."""
    moved = _moved(companions, needs, user, pins)
    dropped: dict[str, Dropped] = {}
    work = list(moved)
    while work:
        target = work.pop(0)
        new = moved[target]
        for dep, reqs in sorted(rdeps.items()):
            if dep in moved or dep in user or dep in nodeps or dep not in pins:
                continue
            for r in reqs:
                if normalize(r.name) == target and not compatible(r.specifier, new):
                    why = f"dependent-of-{target}: {dep} {pins[dep]} requires {r.name}{r.specifier}, {target} becomes {new or 'unpinned'}"
                    dropped[dep] = Dropped(dep, pins[dep], why, tuple(f for f in pin_files.get(dep, []) if f != NODEPS))
                    moved[dep] = SpecifierSet(f"!={pins[dep]}")
                    work.append(dep)
                    break
    return tuple(dropped[n] for n in sorted(dropped))


def _moved(companions: dict[str, list[str]], needs: dict[str, _Need], user: dict[str, Metadata], pins: dict[str, str]) -> dict[str, SpecifierSet]:
    """The packages that leave their pin, each with the range it moves to."""
    moved: dict[str, SpecifierSet] = {n: needs[n].spec() for n in companions}
    for n, m in user.items():
        if m.version and n in pins and m.version != pins[n]:
            moved[n] = SpecifierSet(f"=={m.version}")
    return moved


def _newest_accepting(source: MetadataSource, name: str, within: SpecifierSet, moved: dict[str, SpecifierSet],
                      tries: int = 12) -> Metadata | None:
    """The newest release of a dropped dependent whose own requirements fit every moved range.

    Why: left unpinned, pip keeps the other pins and backtracks to whatever release declares no bound
    at all: datasets 5.2.0 dropped for huggingface-hub<1.0 came back as datasets 2.2.1 (no bound on
    fsspec/dill), which imports pyarrow's removed PyExtensionType. Naming the release and following
    its requirements moves those pins instead. None when no release among the newest `tries` fits."""
    for v in [v for v in source.versions(name) if within.contains(v, prereleases=True)][:tries]:
        try:
            meta = source.index(f"{name}=={v}")
        except LookupError:
            continue
        reqs = [r for r in _parse_requires(meta.requires) if normalize(r.name) in moved]
        if all(compatible(r.specifier, moved[normalize(r.name)]) for r in reqs):
            return meta
    return None
