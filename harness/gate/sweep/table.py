"""Outcomes, the version x case sweep table (`sweep_table`) and the writer x reader cross grid
(`cross_table`), from results.json documents; pure (no file, no environment)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any


class SweepInputError(Exception):
    """A run's results document cannot be read as one (the message names the release)."""


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
    #: the architecture x release axis (harness.gate.sweep.arch_axis.ArchAxis; None: no run recorded a registry)
    archs: Any = None

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
