"""The release sweep: one matrix over a list of release sets, read as one version x case table.

    ckpt-harness sweep --releases megatron-bridge==0.4.2,0.5.0,0.5.1 [MATRIX] [-k WORDS] [--cross] --out DIR
    ckpt-harness sweep --from-results 0.4.2=runs/a 0.5.0=runs/b/results.json --out DIR

The gate answers "is this one bump safe"; a sweep answers "in which release did this defect arrive,
and in which did it leave". Each release set's run is a results.json (harness/report/results.py); this module
is the pure half: the --releases grammar, the table over the runs (`sweep_table`), the cross-version
grid over golden-corpus checks (`cross_table`), and DIR/sweep.{md,html,json} (`write`). Building the
environments is the caller's `driver` (run_cli), so every function here is tested on hand-made docs.

Outcomes. A case's outcome in a release is its status, with two refinements the table needs:
`failed` whose error says XPASS(strict) is `xpassed` (the named defect no longer reproduces), and
`error` whose error has an "API not available in ..." line is `api-missing` (the harness could not
drive that release). `api-missing`, `not-run`, `not-applicable` and `absent` (no record of the case
in that run) are coverage holes: the release neither kept nor changed the case's outcome, so a change
is measured between the covered releases on either side of a hole (and says so).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from html import escape
from pathlib import Path
from typing import Any, Callable

__all__ = ["SweepSpecError", "SweepInputError", "parse_releases", "sweep_table", "cross_table", "cross_pairs",
           "SweepTable", "CrossTable", "write", "markdown", "render_html", "to_json", "add_parser", "run_cli", "load_results"]

# ----------------------------------------------------------------------------- the --releases grammar

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_VERSION_ITEM = re.compile(rf"^({_NAME})\s*==\s*(\S+)$")
_BARE_VERSION = re.compile(r"^[0-9][A-Za-z0-9.+!_-]*$")
# A "+" starts a new item of a set only where a SPEC starts after it: NAME==, NAME @, or a path.
# So "git+https://..." and a local version ("0.5.0+cu12") never split.
_ITEM_START = re.compile(rf"\+(?=\s*(?:{_NAME}\s*(?:==|@)|/|\./|\.\./|~))")


class SweepSpecError(ValueError):
    """A --releases (or --from-results) argument that does not parse; the message names the token."""


class SweepInputError(Exception):
    """A run's results document cannot be read as one (the message names the release)."""


def _is_path(item: str) -> bool:
    return item.endswith(".whl") or item.startswith(("/", "./", "../", "~"))


def _check_item(item: str, token: str) -> str:
    """One SPEC of a set, checked for syntax only (a version or VCS SPEC through envspec.parse_spec,
    which is pure for those kinds; a path is checked when the driver builds it)."""
    if _is_path(item):
        return item
    from harness.gate import envspec

    try:
        envspec.parse_spec(item)
    except ValueError as exc:
        raise SweepSpecError(f"--releases: {exc}" if repr(token) in str(exc) else f"--releases: {token!r}: {exc}") from None
    return item


def parse_releases(arg: str) -> list[list[str]]:
    """The --releases value -> one list of SPECs per release set, in the order given (oldest first).

    Grammar::

        RELEASES := SET ("," SET)*          sets are separated by commas
        SET      := ITEM ("+" ITEM)*        one release set may pin several packages at once
                  | VERSION                 continues the previous set's package
        ITEM     := a SPEC of `gate --candidate` (harness/gate/envspec.py): NAME==VERSION,
                    NAME @ git+URL@COMMIT, a source tree (/..., ./..., ../..., ~...) or a .whl file

    `megatron-bridge==0.4.2,0.5.0,0.5.1` is three sets; `megatron-bridge==0.5.1+megatron-core==0.18.2`
    is one set of two packages. A bare VERSION (it starts with a digit) continues the previous set
    only when that set is exactly one NAME==VERSION item (after a multi-package set it would be
    ambiguous). A "+" separates items only where a SPEC starts after it, so `git+https://...` and a
    local version `0.5.0+cu12` stay whole. Empty sets, a package twice in one set, and the same set
    twice raise SweepSpecError naming the token.
    """
    if not arg or not arg.strip():
        raise SweepSpecError("--releases: empty; give SPEC,SPEC,... (e.g. megatron-bridge==0.4.2,0.5.0)")
    sets: list[list[str]] = []
    seen: dict[tuple[str, ...], str] = {}
    for pos, raw in enumerate(arg.split(","), 1):
        token = raw.strip()
        if not token:
            raise SweepSpecError(f"--releases: release set #{pos} is empty (a stray or doubled comma in {arg!r})")
        if _BARE_VERSION.match(token) and "==" not in token:
            prev = sets[-1] if sets else None
            m = _VERSION_ITEM.match(prev[0]) if prev and len(prev) == 1 else None
            if m is None:
                why = ("it comes first" if not prev else
                       f"the previous set {'+'.join(prev)!r} is not a single NAME==VERSION")
                raise SweepSpecError(f"--releases: bare version {token!r} (set #{pos}) continues no package: {why}; "
                                     "write NAME==VERSION")
            items = [_check_item(f"{m[1]}=={token}", token)]
        else:
            items = []
            for part in _ITEM_START.split(token):
                item = part.strip()
                if not item:
                    raise SweepSpecError(f"--releases: {token!r} (set #{pos}) has an empty item around '+'")
                if _BARE_VERSION.match(item) and "==" not in item:
                    raise SweepSpecError(f"--releases: {item!r} in {token!r}: inside a '+' set every item names its package")
                items.append(_check_item(item, item))
            names = [_package(i) for i in items]
            dup = next((n for n in names if n and names.count(n) > 1), None)
            if dup:
                raise SweepSpecError(f"--releases: {token!r} (set #{pos}) pins {dup} twice")
        key = tuple(sorted(items))
        if key in seen:
            raise SweepSpecError(f"--releases: {'+'.join(items)!r} (set #{pos}) repeats set {seen[key]}")
        seen[key] = f"#{pos}"
        sets.append(items)
    return sets


def _package(item: str) -> str | None:
    m = re.match(rf"^({_NAME})\s*(?:==|@)", item)
    return re.sub(r"[-_.]+", "-", m[1]).lower() if m and not _is_path(item) else None


def release_label(specs: list[str]) -> str:
    """A release set's name in the table: its SPECs joined with '+' (what --releases would say)."""
    return "+".join(s.strip() for s in specs) or "the pins"


# ----------------------------------------------------------------------------- outcomes

#: Outcomes in the order tables list them, with the compact glyph the Markdown cells use.
GLYPHS: dict[str, str] = {
    "passed": "ok", "failed": "FAIL", "error": "ERR", "xfailed": "xf", "xpassed": "XP",
    "api-missing": "api", "not-run": "nr", "not-applicable": "na", "absent": "-",
}
MEANING: dict[str, str] = {
    "passed": "passed", "failed": "failed", "error": "error (a crash, not a missing API)",
    "xfailed": "failed as its named upstream defect (xfail)",
    "xpassed": "XPASS(strict): the named defect no longer reproduces (drop the xfail)",
    "api-missing": "error: API not available in this release (the harness cannot drive it; coverage hole)",
    "not-run": "not run (the machine lacked a requirement; coverage hole)",
    "not-applicable": "not applicable to this release (coverage hole)",
    "absent": "no record of the case in this run (coverage hole)",
}
HOLES = frozenset({"api-missing", "not-run", "not-applicable", "absent"})
GREEN = frozenset({"passed", "xfailed"})
BAD = frozenset({"failed", "error", "xpassed"})
_API = "API not available"


def _first_line(text: str | None, limit: int = 160) -> str:
    line = next((ln.strip() for ln in (text or "").splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def outcome(record: dict[str, Any] | None) -> tuple[str, str]:
    """(outcome, why) of one case record; why is the line a reader needs (error, reason), or ''."""
    if record is None:
        return "absent", "no record of the case in this run"
    status, error = str(record.get("status")), record.get("error") or ""
    api = next((ln.strip() for ln in error.splitlines() if ln.strip().startswith(_API)), None)
    if status == "error" and api:
        return "api-missing", _first_line(api, 200)
    if status == "failed" and "XPASS(strict)" in error:
        return "xpassed", _first_line(error)
    if status == "not-run":
        return "not-run", _first_line(record.get("not_run_reason"))
    if status == "not-applicable":
        return "not-applicable", _first_line(record.get("not_applicable_reason") or record.get("reason") or error)
    if status == "xfailed":
        return "xfailed", _first_line(record.get("xfail_reason"))
    return status, _reason(error)


def _records(label: str, doc: Any) -> dict[str, dict[str, Any]]:
    """Case id -> record of one results.json (report.document writes 'results'; 'cases' is accepted too)."""
    if not isinstance(doc, dict):
        raise SweepInputError(f"release {label!r}: not a results.json document")
    rows = doc.get("results", doc.get("cases"))
    if not isinstance(rows, list):
        raise SweepInputError(f"release {label!r}: no 'results' list")
    out: dict[str, dict[str, Any]] = {}
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or not isinstance(r.get("id"), str) or not isinstance(r.get("status"), str):
            raise SweepInputError(f"release {label!r}: results[{i}] has no string 'id' and 'status'")
        if r["id"] in out:
            raise SweepInputError(f"release {label!r}: case {r['id']!r} appears twice")
        out[r["id"]] = r
    return out


def _check_statuses(record: dict[str, Any] | None) -> dict[str, str]:
    return {c["name"]: str(c.get("status")) for c in (record or {}).get("checks") or [] if isinstance(c, dict) and "name" in c}


# ----------------------------------------------------------------------------- the sweep table


@dataclass
class CheckChange:
    name: str
    old: str | None  # None: the check was not recorded
    new: str | None


@dataclass
class Change:
    """The case's outcome (or its checks' statuses) differs from the last covered release before."""

    release: str  # where the new outcome is first seen
    index: int
    since: str  # the last covered release before it (== the previous release unless holes lie between)
    since_index: int
    old: str
    new: str
    checks: list[CheckChange] = field(default_factory=list)
    why: str = ""  # the new outcome's error / reason line

    @property
    def kind(self) -> str:
        """arrived | left | fixed-upstream | checks | moved: how a person reads this change."""
        if self.old == self.new:
            return "checks"
        if self.new == "xpassed" and self.old == "xfailed":
            return "fixed-upstream"
        if self.old in GREEN and self.new in BAD:
            return "arrived"
        if self.old in BAD and self.new in GREEN:
            return "left"
        return "moved"

    @property
    def exact(self) -> bool:
        """False when holes lie between `since` and `release`: the change happened somewhere in between."""
        return self.since_index == self.index - 1

    def sentence(self) -> str:
        where = f"in {self.release}" if self.exact else f"between {self.since} and {self.release} (releases between not covered)"
        checks = _checks_text(self.checks)
        what = {
            "arrived": f"{self.new} arrived {where}",
            "left": f"{self.old} left {where} (now {self.new})",
            "fixed-upstream": f"defect fixed upstream {where}: XPASS, drop the xfail",
            "checks": f"{self.new}, but its checks changed {where}",
            "moved": f"{self.old} -> {self.new} {where}",
        }[self.kind]
        if self.kind in ("arrived", "moved") and self.why:
            what += f": {self.why}"
        return what + (f" [{checks}]" if checks else "")


def _checks_text(changes: list[CheckChange]) -> str:
    if not changes:
        return ""
    if all(c.new is None for c in changes):
        return "no checks ran"
    return ", ".join(f"{c.name}: {c.old or '-'} -> {c.new or '-'}" for c in changes)


@dataclass
class CaseRow:
    id: str
    outcomes: list[str]
    why: list[str]  # per release: the error / reason line ('' when none)
    checks: list[dict[str, str]]  # per release: check name -> status
    changes: list[Change] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.changes)

    @property
    def holes(self) -> list[int]:
        return [i for i, o in enumerate(self.outcomes) if o in HOLES]

    @property
    def steady(self) -> str:
        """The one covered outcome of an unchanged case ('never-covered' when every release is a hole)."""
        covered = [o for o in self.outcomes if o not in HOLES]
        return covered[0] if covered else "never-covered"

    def story(self) -> str:
        return "; ".join(c.sentence() for c in self.changes)


@dataclass
class Release:
    label: str
    index: int
    counts: dict[str, int]
    versions: dict[str, Any]
    error: str = ""  # the run itself could not be made (the driver failed): every case is absent


@dataclass
class CrossCell:
    writer: str
    reader: str
    rollback: bool
    counts: dict[str, int]
    problems: list[tuple[str, str, str]]  # (artefact, outcome, why) of every artefact not loaded green
    refused: list[str]  # artefacts the reader refused cleanly (a named exception; allowed on a rollback)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def green(self) -> int:
        return self.counts.get("passed", 0) + self.counts.get("xfailed", 0)

    @property
    def ok(self) -> bool:
        return not self.problems

    def glyph(self) -> str:
        head = "ok" if self.ok else ("FAIL" if any(o in BAD for _, o, _ in self.problems) else "hole")
        return f"{head} {self.green}/{self.total}" + (f" ({len(self.refused)} refused)" if self.refused else "")


@dataclass
class CrossTable:
    """Writer x reader grid of golden checks: row = release that wrote the corpus, column = the reader."""

    releases: list[str]
    cells: dict[tuple[str, str], CrossCell]

    def to_dict(self) -> dict[str, Any]:
        return {"releases": self.releases,
                "cells": [{**asdict(c), "total": c.total, "green": c.green, "ok": c.ok,
                           "problems": [{"artefact": a, "outcome": o, "why": w} for a, o, w in c.problems]}
                          for c in self.cells.values()]}


@dataclass
class SweepTable:
    releases: list[Release]
    cases: list[CaseRow]  # changed first (by first change, then id), then unchanged (by id)
    cross: CrossTable | None = None

    @property
    def labels(self) -> list[str]:
        return [r.label for r in self.releases]

    @property
    def changed(self) -> list[CaseRow]:
        return [c for c in self.cases if c.changed]

    @property
    def unchanged(self) -> list[CaseRow]:
        return [c for c in self.cases if not c.changed]

    def case(self, case_id: str) -> CaseRow:
        return next(c for c in self.cases if c.id == case_id)

    def unchanged_counts(self) -> dict[str, int]:
        c = Counter(r.steady for r in self.unchanged)
        return {k: c[k] for k in (*GLYPHS, "never-covered") if c.get(k)}

    def holes(self) -> list[tuple[list[int], str, str, list[str]]]:
        """(release indices, outcome, reason, case ids) per coverage-hole group: one group per
        (outcome, reason), so a machine's not-run reason is one line however many releases it spans."""
        groups: dict[tuple[str, str], tuple[set[int], list[str]]] = {}
        for row in self.cases:
            for i in row.holes:
                reason = _first_line(self.releases[i].error) or row.why[i]
                rel, ids = groups.setdefault((row.outcomes[i], reason), (set(), []))
                rel.add(i)
                if row.id not in ids:
                    ids.append(row.id)
        out = [(sorted(rel), o, why, ids) for (o, why), (rel, ids) in groups.items()]
        return sorted(out, key=lambda h: (h[0][0], list(GLYPHS).index(h[1]) if h[1] in GLYPHS else 99, h[2]))


def _ranges(indices: list[int]) -> str:
    """1-based release numbers, runs compressed: [0, 1, 2, 4] -> '1-3, 5'."""
    out, start = [], None
    for j, i in enumerate(indices):
        if start is None:
            start = i
        if j + 1 == len(indices) or indices[j + 1] != i + 1:
            out.append(f"{start + 1}" if start == i else f"{start + 1}-{i + 1}")
            start = None
    return ", ".join(out)


def _changes(row: CaseRow, labels: list[str]) -> list[Change]:
    out: list[Change] = []
    last: int | None = None
    for i, o in enumerate(row.outcomes):
        if o in HOLES:
            continue
        if last is not None:
            old, new = row.checks[last], row.checks[i]
            checks = [CheckChange(n, old.get(n), new.get(n)) for n in dict.fromkeys([*old, *new]) if old.get(n) != new.get(n)]
            if o != row.outcomes[last] or checks:
                out.append(Change(labels[i], i, labels[last], last, row.outcomes[last], o, checks, row.why[i]))
        last = i
    return out


def sweep_table(runs: list[tuple[str, dict[str, Any]]], cross: CrossTable | None = None) -> SweepTable:
    """The version x case table of runs = [(release label, results.json doc)], oldest release first.

    A doc with a top-level 'sweep_error' stands for a release whose run could not be made (the
    driver's message): it has no records, so every case is absent there (a hole, not a change)."""
    if not runs:
        raise SweepInputError("no runs to tabulate")
    labels = [label for label, _ in runs]
    if len(set(labels)) != len(labels):
        raise SweepInputError(f"release labels repeat: {[x for x in labels if labels.count(x) > 1][0]!r}")
    recs = [_records(label, doc) if not doc.get("sweep_error") else {} for label, doc in runs]
    ids = list(dict.fromkeys(i for r in recs for i in r))
    rows: list[CaseRow] = []
    for cid in ids:
        per = [outcome(r.get(cid)) for r in recs]
        row = CaseRow(cid, [o for o, _ in per], [w for _, w in per], [_check_statuses(r.get(cid)) for r in recs])
        row.changes = _changes(row, labels)
        rows.append(row)
    rows.sort(key=lambda r: (0, r.changes[0].index, r.id) if r.changes else (1, 0, r.id))
    releases = []
    for i, (label, doc) in enumerate(runs):
        c = Counter(row.outcomes[i] for row in rows)
        releases.append(Release(label, i, {k: c[k] for k in GLYPHS if c.get(k)}, dict(doc.get("versions") or {}),
                                str(doc.get("sweep_error") or "")))
    return SweepTable(releases, rows, cross)


# ----------------------------------------------------------------------------- the cross grid

_ARTEFACT = re.compile(r"^golden\[([^@\]]+)")
_EXCEPTION = re.compile(r"\b([A-Z][A-Za-z0-9_]*(?:Exception|Error))\b")
NOT_WRITTEN = "not written"  # harness.gate.golden.NOT_WRITTEN starts so: the writer's failure, not the reader's


def cross_pairs(labels: list[str]) -> list[tuple[str, str, bool]]:
    """The (writer, reader, rollback) checks --cross runs: every older release's corpus read by the
    newest (the upgrade a user makes), and the newest's corpus read by every older one (a rollback,
    where a clean refusal is allowed: `golden check --allow-refusal`)."""
    newest = labels[-1]
    return [(old, newest, False) for old in labels[:-1]] + [(newest, old, True) for old in labels[:-1]]


def _reason(error: str | None) -> str:
    lines = [ln.strip() for ln in (error or "").splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith((_API, NOT_WRITTEN)):
            return _first_line(ln, 200)
    named = [ln for ln in lines if _EXCEPTION.search(ln)]
    return _first_line(named[-1] if named else (lines[0] if lines else ""), 200)


def cross_table(checks: list[tuple[str, str, dict[str, Any]]], releases: list[str] | None = None) -> CrossTable:
    """checks = [(writer label, reader label, results.json of `golden check` run by the reader on the
    writer's corpus)]. A reader older than the writer (by `releases` order) is a rollback."""
    order = list(releases) if releases else list(dict.fromkeys(x for w, r, _ in checks for x in (w, r)))
    cells: dict[tuple[str, str], CrossCell] = {}
    for writer, reader, doc in checks:
        for x in (writer, reader):
            if x not in order:
                order.append(x)
        recs = _records(f"{writer} -> {reader}", doc)
        counts: Counter[str] = Counter()
        problems, refused = [], []
        for cid, r in recs.items():
            m = _ARTEFACT.match(cid)
            name = m[1] if m else cid
            o, _ = outcome(r)
            if o == "error" and (r.get("error") or "").startswith(NOT_WRITTEN):
                o = "not-written"
            counts[o] += 1
            if any(c.get("name") == "refusal" and c.get("status") == "passed" for c in r.get("checks") or []):
                refused.append(name)
            if o not in GREEN:
                failed = [c["name"] for c in r.get("checks") or [] if c.get("status") == "failed"]
                why = _reason(r.get("error")) or (f"checks failed: {', '.join(failed)}" if failed else "")
                problems.append((name, o, why))
        rollback = order.index(reader) < order.index(writer)
        cells[(writer, reader)] = CrossCell(writer, reader, rollback, dict(counts), problems, refused)
    return CrossTable(order, cells)


# ----------------------------------------------------------------------------- Markdown

_LEGEND_ORDER = tuple(GLYPHS)


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").replace("<", "&lt;")  # no raw tag reaches a renderer


def _code(text: str) -> str:
    return "`" + str(text).replace("`", "'").replace("|", "\\|") + "`"


def _counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "none"


def markdown(t: SweepTable) -> str:
    """The sweep for people: releases, then only the cases whose outcome changed (one row each,
    the change cells in bold, what changed in words), unchanged cases as counts, coverage holes
    grouped by reason, and the cross-version grid. Readable at ~10 releases x ~150 cases."""
    n = len(t.releases)
    lines = [f"# ckpt-harness sweep: {n} release(s), {len(t.cases)} case(s)", "", "## Releases", "",
             "| # | release | installed | " + " | ".join(GLYPHS[k] for k in _LEGEND_ORDER) + " |", "|---:|---|---|" + "---:|" * len(_LEGEND_ORDER)]
    for r in t.releases:
        v = r.versions
        inst = ", ".join(f"{k.replace('megatron-', 'm')} {v[k]}" for k in ("megatron-core", "megatron-bridge") if v.get(k)) or "-"
        if r.error:
            inst = f"run failed: {_md(_first_line(r.error, 120))}"
        lines.append(f"| {r.index + 1} | {_code(r.label)} | {inst} | " + " | ".join(str(r.counts.get(k, 0) or "") for k in _LEGEND_ORDER) + " |")
    lines += ["", "Cells: " + ", ".join(f"`{g}` {k}" for k, g in GLYPHS.items())
              + ". **Bold**: the outcome (or a check's status) changed there; hole outcomes (api, nr, na, -) never count as a change.", ""]
    changed = t.changed
    lines.append(f"## Changed cases ({len(changed)})")
    lines.append("")
    if changed:
        lines += ["| case | " + " | ".join(str(i + 1) for i in range(n)) + " | what changed |", "|---|" + ":-:|" * n + "---|"]
        for row in changed:
            at = {c.index for c in row.changes}
            cells = [f"**{GLYPHS.get(o, o)}**" if i in at else GLYPHS.get(o, o) for i, o in enumerate(row.outcomes)]
            lines.append(f"| {_code(row.id)} | " + " | ".join(cells) + f" | {_md(row.story())} |")
    else:
        lines.append("No case changed outcome across these releases.")
    un = t.unchanged
    holed = sum(bool(r.holes) for r in un)
    lines += ["", f"## Unchanged cases ({len(un)})", "",
              f"{len(un)} case(s) kept one outcome in every release they ran: {_counts_text(t.unchanged_counts())}"
              + (f" ({holed} of them with coverage holes, below)." if holed else ".")
              + " Every one is in sweep.json and sweep.html."]
    holes = t.holes()
    if holes:
        n_holes = sum(len(r.holes) for r in t.cases)
        lines += ["", f"## Coverage holes ({n_holes} case-release(s) in {len({i for *_, ids in holes for i in ids})} case(s))", "",
                  "The harness could not drive these cases in these releases; not changes caused by the release.", "",
                  "| releases | outcome | reason | cases |", "|---|---|---|---|"]
        for rel, o, why, ids in holes:
            shown = ", ".join(_code(i) for i in ids[:3]) + (f" and {len(ids) - 3} more" if len(ids) > 3 else "")
            lines.append(f"| {_ranges(rel)} | {GLYPHS.get(o, o)} | {_md(why) or '-'} | {len(ids)}: {shown} |")
    if t.cross is not None:
        lines += ["", *_cross_markdown(t.cross)]
    return "\n".join(lines) + "\n"


def _cross_markdown(x: CrossTable) -> list[str]:
    readers = [r for r in x.releases if any(k[1] == r for k in x.cells)]
    writers = [w for w in x.releases if any(k[0] == w for k in x.cells)]
    lines = ["## Cross-version: golden corpus written by (row), read by (column)", "",
             "Cells: `ok green/total`, `FAIL` when an artefact did not load or loaded wrong, `hole` when it was not written "
             "or could not be driven; *italic*: a rollback (an older reader; a clean refusal passes).", "",
             "| written by \\ read by | " + " | ".join(_code(r) for r in readers) + " |", "|---|" + "---|" * len(readers)]
    for w in writers:
        cells = []
        for r in readers:
            c = x.cells.get((w, r))
            cells.append("" if c is None else (f"*{c.glyph()}*" if c.rollback else c.glyph()))
        lines.append(f"| {_code(w)} | " + " | ".join(cells) + " |")
    bad = [c for c in x.cells.values() if c.problems]
    if bad:
        lines += ["", "| written by | read by | artefact | outcome | why |", "|---|---|---|---|---|"]
        lines += [f"| {_code(c.writer)} | {_code(c.reader)} | {_code(a)} | {o} | {_md(why)} |" for c in bad for a, o, why in c.problems]
    return lines


# ----------------------------------------------------------------------------- HTML

_COLOR = {"passed": "#dafbe1", "xfailed": "#fff8c5", "failed": "#ffebe9", "error": "#fbefff", "xpassed": "#ffd8b5",
          "api-missing": "#eaeef2", "not-run": "#eaeef2", "not-applicable": "#eaeef2", "absent": "#ffffff"}
_CSS = """
body{font:14px system-ui,sans-serif;margin:24px;color:#1f2328}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #d0d7de;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f6f8fa}td.o{text-align:center;font-family:ui-monospace,monospace;font-size:12px;white-space:nowrap}
td.chg{outline:2px solid #cf222e;outline-offset:-2px;font-weight:700}.num{text-align:right}
details{margin:10px 0;border:1px solid #d0d7de;border-radius:6px;padding:6px 10px}summary{cursor:pointer}
code{font-size:12px}.small{font-size:12px;color:#57606a}
"""


def _e(x: Any) -> str:
    return escape(str(x), quote=True)


def _html_cases(t: SweepTable, rows: list[CaseRow]) -> str:
    head = "<tr><th>case</th>" + "".join(f'<th title="{_e(r.label)}">{r.index + 1}</th>' for r in t.releases) + "<th>what changed</th></tr>"
    body = []
    for row in rows:
        at = {c.index for c in row.changes}
        cells = []
        for i, o in enumerate(row.outcomes):
            tip = f"{t.releases[i].label}: {o}" + (f" - {row.why[i]}" if row.why[i] else "")
            cls = "o chg" if i in at else "o"
            cells.append(f'<td class="{cls}" style="background:{_COLOR.get(o, "#fff")}" title="{_e(tip)}">{_e(GLYPHS.get(o, o))}</td>')
        body.append(f"<tr><td><code>{_e(row.id)}</code></td>{''.join(cells)}<td>{_e(row.story())}</td></tr>")
    return f"<table>{head}{''.join(body)}</table>"


def render_html(t: SweepTable, title: str = "ckpt-harness sweep") -> str:
    """One self-contained page (no script, no external file): every case, unchanged ones collapsed."""
    rel = "".join(
        f"<tr><td class='num'>{r.index + 1}</td><td><code>{_e(r.label)}</code></td>"
        f"<td>{_e(', '.join(f'{k} {v}' for k, v in r.versions.items() if v)) or '-'}</td>"
        + "".join(f"<td class='num'>{r.counts.get(k, 0) or ''}</td>" for k in _LEGEND_ORDER)
        + f"<td>{_e(_first_line(r.error, 300))}</td></tr>" for r in t.releases)
    legend = "".join(f'<li><span style="background:{_COLOR[k]};padding:0 4px"><code>{_e(g)}</code></span> {_e(MEANING[k])}</li>'
                     for k, g in GLYPHS.items())
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{_e(title)}</h1><p>{len(t.releases)} release(s), {len(t.cases)} case(s), {len(t.changed)} changed.</p>",
             "<h2>Releases</h2><table><tr><th>#</th><th>release</th><th>installed</th>"
             + "".join(f"<th>{_e(g)}</th>" for g in GLYPHS.values()) + f"<th>run error</th></tr>{rel}</table>",
             f"<ul class='small'>{legend}<li>a red outline: the outcome or a check changed there</li></ul>",
             f"<h2>Changed cases ({len(t.changed)})</h2>",
             _html_cases(t, t.changed) if t.changed else "<p>No case changed outcome across these releases.</p>",
             f"<details><summary>Unchanged cases ({len(t.unchanged)}): {_e(_counts_text(t.unchanged_counts()))}</summary>"
             + _html_cases(t, t.unchanged) + "</details>"]
    holes = t.holes()
    if holes:
        rows = "".join(f"<tr><td>{_e(_ranges(rel))}</td><td>{_e(o)}</td><td>{_e(why)}</td>"
                       f"<td>{len(ids)}: {_e(', '.join(ids))}</td></tr>" for rel, o, why, ids in holes)
        parts.append(f"<h2>Coverage holes</h2><table><tr><th>releases</th><th>outcome</th><th>reason</th><th>cases</th></tr>{rows}</table>")
    if t.cross is not None:
        parts.append(_cross_html(t.cross))
    parts.append("</body></html>")
    return "".join(parts)


def _cross_html(x: CrossTable) -> str:
    readers = [r for r in x.releases if any(k[1] == r for k in x.cells)]
    writers = [w for w in x.releases if any(k[0] == w for k in x.cells)]
    head = "<tr><th>written by \\ read by</th>" + "".join(f"<th><code>{_e(r)}</code></th>" for r in readers) + "</tr>"
    rows = []
    for w in writers:
        cells = []
        for r in readers:
            c = x.cells.get((w, r))
            if c is None:
                cells.append("<td></td>")
                continue
            tip = "; ".join(f"{a}: {o} {why}" for a, o, why in c.problems) or "every artefact loaded"
            color = _COLOR["passed"] if c.ok else _COLOR["failed"]
            cells.append(f'<td class="o" style="background:{color}" title="{_e(tip)}">{"<i>" if c.rollback else ""}{_e(c.glyph())}'
                         f'{"</i>" if c.rollback else ""}</td>')
        rows.append(f"<tr><td><code>{_e(w)}</code></td>{''.join(cells)}</tr>")
    probs = "".join(f"<tr><td><code>{_e(c.writer)}</code></td><td><code>{_e(c.reader)}</code></td><td><code>{_e(a)}</code></td>"
                    f"<td>{_e(o)}</td><td>{_e(why)}</td></tr>" for c in x.cells.values() for a, o, why in c.problems)
    return ("<h2>Cross-version: golden corpus written by (row), read by (column)</h2>"
            "<p class='small'>italic: a rollback (an older reader; a clean refusal passes)</p>"
            f"<table>{head}{''.join(rows)}</table>"
            + (f"<table><tr><th>written by</th><th>read by</th><th>artefact</th><th>outcome</th><th>why</th></tr>{probs}</table>" if probs else ""))


# ----------------------------------------------------------------------------- JSON and files


def to_json(t: SweepTable) -> dict[str, Any]:
    """The full matrix for machines: every case's outcome in every release, its changes and holes."""
    return {
        "format": 1,
        "legend": {k: {"glyph": g, "meaning": MEANING[k], "hole": k in HOLES} for k, g in GLYPHS.items()},
        "releases": [asdict(r) for r in t.releases],
        "unchanged_counts": t.unchanged_counts(),
        "cases": [{
            "id": row.id, "changed": row.changed, "outcomes": dict(zip(t.labels, row.outcomes)),
            "why": {lb: w for lb, w in zip(t.labels, row.why) if w},
            "holes": [t.labels[i] for i in row.holes],
            "changes": [{**asdict(c), "kind": c.kind, "exact": c.exact, "sentence": c.sentence()} for c in row.changes],
            "checks": dict(zip(t.labels, row.checks)),
        } for row in t.cases],
        "cross": t.cross.to_dict() if t.cross is not None else None,
    }


def write(t: SweepTable, out: Path) -> dict[str, Path]:
    """out/sweep.md, out/sweep.html, out/sweep.json (the directory is created; files are replaced)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "sweep.md", "html": out / "sweep.html", "json": out / "sweep.json"}
    paths["md"].write_text(markdown(t), encoding="utf-8")
    paths["html"].write_text(render_html(t), encoding="utf-8")
    paths["json"].write_text(json.dumps(to_json(t), indent=2, default=str) + "\n", encoding="utf-8")
    return paths


def load_results(path: Path) -> dict[str, Any]:
    """A results.json, or a report directory holding one."""
    file = path / "results.json" if path.is_dir() else path
    try:
        doc = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise SweepInputError(f"{file}: not a readable results.json ({exc})") from None
    _records(str(file), doc)
    return doc


# ----------------------------------------------------------------------------- CLI

#: driver(release_specs, matrix, k, out_dir) -> path of the results.json of that release's run
Driver = Callable[[list[str], Path | None, str | None, Path], Path]
#: cross_driver(writer_specs, reader_specs, rollback, out_dir) -> results.json of the reader's golden check
CrossDriver = Callable[[list[str], list[str], bool, Path], Path]


def _labelled(value: str) -> tuple[str, Path]:
    """LABEL=PATH; the PATH is what follows the last '=' (so a label may be megatron-bridge==0.5.0)."""
    label, sep, path = value.rpartition("=")
    if not sep or not label.strip() or not path.strip():
        raise SweepSpecError(f"--from-results: {value!r} is not LABEL=PATH")
    return label.strip(), Path(path.strip())


def _cross_labelled(value: str) -> tuple[str, str, Path]:
    """WRITER>READER=PATH (the reader's golden-check results.json of the writer's corpus)."""
    pair, path = _labelled(value)
    writer, sep, reader = pair.partition(">")
    if not sep or not writer.strip() or not reader.strip():
        raise SweepSpecError(f"--from-cross: {value!r} is not WRITER>READER=PATH")
    return writer.strip(), reader.strip(), path


def add_parser(subparsers: Any, driver: Driver | None = None, cross_driver: CrossDriver | None = None) -> argparse.ArgumentParser:
    """`ckpt-harness sweep`; with a driver, the parser's func runs it (cli.main calls args.func(args))."""
    p = subparsers.add_parser("sweep", help="run one matrix over a list of releases: a version x case table of where outcomes change")
    p.add_argument("matrix", type=Path, nargs="?", default=Path("matrices/smoke.yaml"))
    p.add_argument("--releases", default=None, metavar="SPEC,SPEC,...",
                   help="release sets, oldest first: 'megatron-bridge==0.4.2,0.5.0' (a bare version continues the previous "
                        "package), 'megatron-bridge==0.5.1+megatron-core==0.18.2' (one set of two packages)")
    p.add_argument("-k", default=None, help="only matrix cases whose id contains every word of this")
    p.add_argument("--cross", action="store_true",
                   help="each release's golden corpus is read by the newest, and the newest's by each older one (rollback)")
    p.add_argument("--out", type=Path, required=True, help="DIR/sweep.md, sweep.html, sweep.json, and one run dir per release")
    p.add_argument("--from-results", nargs="+", default=None, metavar="LABEL=PATH",
                   help="tabulate existing results.json files (or report dirs), oldest first, running nothing")
    p.add_argument("--from-cross", nargs="+", default=None, metavar="WRITER>READER=PATH",
                   help="with --from-results: golden-check results of WRITER's corpus read by READER")
    if driver is not None:
        p.set_defaults(func=lambda args: run_cli(args, driver, cross_driver))
    return p


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=+-]+", "_", label)[:80]


def run_cli(args: argparse.Namespace, driver: Driver | None = None, cross_driver: CrossDriver | None = None) -> int:
    """Exit 0: the table is written; 2: bad input, or no release could be run. A release whose run
    the driver could not make (it raised) stays in the table as a hole with the driver's message."""
    import sys

    def fail(msg: str) -> int:
        print(f"ckpt-harness sweep: {msg}", file=sys.stderr)
        return 2

    try:
        if args.from_results:
            if args.releases:
                return fail("give --releases or --from-results, not both")
            pairs = [_labelled(v) for v in args.from_results]
            runs = [(label, load_results(path)) for label, path in pairs]
            cross = None
            if getattr(args, "from_cross", None):
                checks = [(w, r, load_results(p)) for w, r, p in map(_cross_labelled, args.from_cross)]
                cross = cross_table(checks, [label for label, _ in runs])
            elif args.cross:
                return fail("--cross with --from-results needs --from-cross WRITER>READER=PATH ...")
        else:
            if not args.releases:
                return fail("give --releases SPEC,SPEC,... or --from-results LABEL=PATH ...")
            sets = parse_releases(args.releases)
            if driver is None:
                return fail("no driver to build release environments (cli.py wires harness.gate's)")
            if args.cross and cross_driver is None:
                return fail("--cross: no cross driver wired")
            runs, by_label = [], {}
            for i, specs in enumerate(sets, 1):
                label = release_label(specs)
                by_label[label] = specs
                print(f"[{i}/{len(sets)}] {label}", flush=True)
                try:
                    path = driver(specs, args.matrix, args.k, args.out / f"r{i:02d}-{_slug(label)}")
                    runs.append((label, load_results(Path(path))))
                except Exception as exc:  # one release that cannot be built must not lose the sweep
                    runs.append((label, {"sweep_error": f"{type(exc).__name__}: {exc}", "results": []}))
                    print(f"  could not run {label}: {_first_line(str(exc))}", file=sys.stderr)
            if all(doc.get("sweep_error") for _, doc in runs):
                return fail("no release could be run:\n" + "\n".join(f"{lb}: {d['sweep_error']}" for lb, d in runs))
            cross = None
            if args.cross and len(sets) > 1:
                checks = []
                for w, r, rollback in cross_pairs([lb for lb, _ in runs]):
                    d = args.out / "cross" / f"{_slug(w)}--to--{_slug(r)}"
                    try:
                        checks.append((w, r, load_results(Path(cross_driver(by_label[w], by_label[r], rollback, d)))))
                    except Exception as exc:
                        checks.append((w, r, {"results": [{"id": "golden[corpus]", "status": "error",
                                                           "error": f"{NOT_WRITTEN} or not checked: {type(exc).__name__}: {exc}"}]}))
                cross = cross_table(checks, [lb for lb, _ in runs])
        table = sweep_table(runs, cross)
    except (SweepSpecError, SweepInputError) as exc:
        return fail(str(exc))
    paths = write(table, args.out)
    print(f"sweep: {len(table.releases)} release(s), {len(table.cases)} case(s), {len(table.changed)} changed; "
          + ", ".join(str(p) for p in paths.values()))
    return 0
