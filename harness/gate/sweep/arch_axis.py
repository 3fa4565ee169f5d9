"""The sweep's architecture axis: which HF architectures each release's Megatron-Bridge registers
(results.json `bridge_architectures`, harness.gate.archs) and, where the run has cases of that
architecture (a zoo HF model of its family), their outcome. One character a cell, so ~40
architectures x ~10 releases stay one screen: architectures whose presence changed come first.
Pure over results.json documents (`axis`), rendered by harness.gate.sweep.render.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from harness.gate import archs
from harness.gate.sweep.table import BAD, GREEN, outcome

#: cell -> meaning, in legend order
CELLS: dict[str, str] = {
    "P": "registered; its cases passed (or failed as their named xfail)",
    "F": "registered; a case of it failed, errored or XPASSed",
    "h": "registered; its cases were coverage holes only (api-missing, not-run, not-applicable)",
    "o": "registered; no case of it in this run (no zoo model of its family, or not selected)",
    "-": "not registered",
    "x": "not registered, yet a case of it has a result",
    "?": "this run recorded no registry (no --probe-imports, or the Bridge did not import)",
}


@dataclass
class ArchRow:
    name: str
    cells: list[str]
    zoo: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        """Registered in some release and not in another (releases with no registry apart)."""
        known = {c not in "-x" for c in self.cells if c != "?"}
        return len(known) > 1


@dataclass
class ArchAxis:
    releases: list[str]
    rows: list[ArchRow]  # changed first (by first release where it changes), then by name

    @property
    def changed(self) -> list[ArchRow]:
        return [r for r in self.rows if r.changed]


def cell(doc: dict[str, Any] | None, architecture: str, models: Callable[[str], list[str]] = archs.zoo_models) -> str:
    names = archs.registry(doc)
    if names is None:
        return "?"
    outs = [outcome(r)[0] for r in archs.cases_of(doc, architecture, models)]
    if architecture not in names:
        return "x" if outs else "-"
    if not outs:
        return "o"
    if any(o in BAD for o in outs):
        return "F"
    return "P" if any(o in GREEN for o in outs) else "h"


def axis(runs: list[tuple[str, dict[str, Any]]], models: Callable[[str], list[str]] = archs.zoo_models) -> ArchAxis | None:
    """The architecture x release matrix of runs = [(label, results.json doc)], oldest first; None
    when no run recorded a registry (a sweep from runs made without --probe-imports)."""
    regs = [archs.registry(doc) for _, doc in runs]
    if all(r is None for r in regs):
        return None
    names = sorted({a for r in regs if r for a in r})
    rows = [ArchRow(a, [cell(doc, a, models) for _, doc in runs], models(a)) for a in names]

    def first_change(row: ArchRow) -> int:
        known = [(i, c not in "-x") for i, c in enumerate(row.cells) if c != "?"]
        return next(i for (i, p), (_, q) in zip(known, known[1:]) if p != q) if row.changed else 0

    rows.sort(key=lambda r: (0, first_change(r), r.name) if r.changed else (1, 0, r.name))
    return ArchAxis([label for label, _ in runs], rows)


def changes(ax: ArchAxis) -> list[str]:
    """One line per release where the registry changed: what it added and removed."""
    out = []
    for i in range(1, len(ax.releases)):
        added = [r.name for r in ax.rows if r.cells[i] not in "-x?" and r.cells[i - 1] in "-x"]
        removed = [r.name for r in ax.rows if r.cells[i] in "-x" and r.cells[i - 1] not in "-x?"]
        if added or removed:
            out.append(f"- `{ax.releases[i]}`" + (f": added {', '.join(added)}" if added else "")
                       + (f"{';' if added else ':'} **removed** {', '.join(removed)}" if removed else ""))
    return out


def markdown_lines(ax: ArchAxis | None) -> list[str]:
    """The axis as Markdown: counts, the changes per release, then a fixed-width matrix (one column per
    release, numbered as in the Releases table) and its legend."""
    if ax is None:
        return []
    n = len(ax.releases)
    width = max([len(r.name) for r in ax.rows] + [12]) + 2
    head = " " * (width + 2) + " ".join(str((i + 1) % 10) for i in range(n))
    body = [f"{'*' if r.changed else ' '} {r.name:<{width}}" + " ".join(r.cells) for r in ax.rows]
    counts = ", ".join(f"{ax.releases[i]} {sum(r.cells[i] not in '-x?' for r in ax.rows)}" for i in range(n))
    lines = [f"## Architectures ({len(ax.rows)}, {len(ax.changed)} changed)", "",
             f"HF architectures each release's Megatron-Bridge registers (AutoBridge.list_supported_models): {counts}.", ""]
    lines += changes(ax) + ([""] if changes(ax) else ["No architecture came or went over these releases.", ""])
    lines += ["Columns are the releases in order (1 = the first, as numbered under Releases); `*` marks an architecture "
              "whose presence changed.", "", "```", head, *body, "```", "",
              "Cells: " + "; ".join(f"`{c}` {m}" for c, m in CELLS.items()) + ".", ""]
    return lines


def to_json(ax: ArchAxis | None) -> dict[str, Any] | None:
    if ax is None:
        return None
    return {"releases": ax.releases, "legend": CELLS,
            "rows": [{"architecture": r.name, "cells": r.cells, "changed": r.changed, "zoo": r.zoo} for r in ax.rows]}
