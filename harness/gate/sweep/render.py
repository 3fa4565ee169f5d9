"""The sweep table for people and machines: DIR/sweep.md, sweep.html, sweep.json (`write`), and
`load_results` (a run's results.json, or the report directory holding one)."""

from __future__ import annotations

import json
from dataclasses import asdict
from html import escape
from pathlib import Path
from typing import Any

from harness.gate.sweep.arch_axis import markdown_lines as arch_lines
from harness.gate.sweep.arch_axis import to_json as arch_json
from harness.gate.sweep.table import (
    GLYPHS,
    HOLES,
    MEANING,
    CaseRow,
    CrossTable,
    SweepInputError,
    SweepTable,
    _first_line,
    _ranges,
)
from harness.report import grid

# ----------------------------------------------------------------------------- Markdown

_LEGEND_ORDER = tuple(GLYPHS)


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").replace("<", "&lt;")  # no raw tag reaches a renderer


def _code(text: str) -> str:
    return "`" + str(text).replace("`", "'").replace("|", "\\|") + "`"


def _counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "none"


#: what the 'installed' column shows of each release's versions (verl's separate `mbridge` package
#: is not Megatron-Bridge: no abbreviation that reads like it)
_INSTALLED = (("megatron-core", "core"), ("megatron-bridge", "bridge"), ("transformers", "transformers"), ("peft", "peft"))


def markdown(t: SweepTable) -> str:
    """The sweep for people: releases, then only the cases whose outcome changed (one row each,
    the change cells in bold, what changed in words), unchanged cases as counts, coverage holes
    grouped by reason, and the cross-version grid. Readable at ~10 releases x ~150 cases."""
    n = len(t.releases)
    lines = [f"# ckpt-harness sweep: {n} release(s), {len(t.cases)} case(s)", "", "## Releases", "",
             "| # | release | installed | " + " | ".join(GLYPHS[k] for k in _LEGEND_ORDER) + " |", "|---:|---|---|" + "---:|" * len(_LEGEND_ORDER)]
    for r in t.releases:
        v = r.versions
        inst = ", ".join(f"{short} {v[k]}" for k, short in _INSTALLED if v.get(k)) or "-"
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
    if t.archs is not None:
        lines += ["", *arch_lines(t.archs)]
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
#grid-release .cells{max-width:432px}
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
        body.append(f'<tr id="{grid.anchor(row.id)}"><td><code>{_e(row.id)}</code></td>{"".join(cells)}<td>{_e(row.story())}</td></tr>')
    return f"<table>{head}{''.join(body)}</table>"


def _grid_html(t: SweepTable) -> str:
    """Release (rows) x case (columns, grouped per case kind): one cell per case and release, colored
    by its outcome, outlined where it changed, each a link to the case's row below. Every release
    holds every case (absent ones too), so a case sits at the same spot in each release's row."""
    rows = [f"{r.index + 1} {r.label}" for r in t.releases]
    cells: dict[tuple[str, str], list[grid.Cell]] = {}
    for row in t.cases:
        kind = row.id.split("[", 1)[0]
        at = {c.index for c in row.changes}
        for i, o in enumerate(row.outcomes):
            tip = f"{t.releases[i].label}: {row.id}: {o}" + (f" - {row.why[i]}" if row.why[i] else "")
            cells.setdefault((rows[i], kind), []).append(grid.Cell(row.id, (o,), tip, flag=i in at))
    kinds = list(dict.fromkeys(k for _, k in cells))
    return ('<h2 id="grid">Grid: release x case</h2>'
            + grid.legend(GLYPHS, "outlined: the outcome or a check changed there; a cell opens the case's row")
            + grid.grid("grid-release", "release \\ case kind", rows, kinds, cells))


def render_html(t: SweepTable, title: str = "ckpt-harness sweep") -> str:
    """One self-contained page (no script, no external file): every case, unchanged ones collapsed."""
    rel = "".join(
        f"<tr><td class='num'>{r.index + 1}</td><td><code>{_e(r.label)}</code></td>"
        f"<td>{_e(', '.join(f'{k} {v}' for k, v in r.versions.items() if v)) or '-'}</td>"
        + "".join(f"<td class='num'>{r.counts.get(k, 0) or ''}</td>" for k in _LEGEND_ORDER)
        + f"<td>{_e(_first_line(r.error, 300))}</td></tr>" for r in t.releases)
    legend = "".join(f'<li><span style="background:{_COLOR[k]};padding:0 4px"><code>{_e(g)}</code></span> {_e(MEANING[k])}</li>'
                     for k, g in GLYPHS.items())
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)}</title><style>{grid.CSS}{_CSS}</style></head><body>",
             f"<h1>{_e(title)}</h1><p>{len(t.releases)} release(s), {len(t.cases)} case(s), {len(t.changed)} changed.</p>",
             "<h2>Releases</h2><table><tr><th>#</th><th>release</th><th>installed</th>"
             + "".join(f"<th>{_e(g)}</th>" for g in GLYPHS.values()) + f"<th>run error</th></tr>{rel}</table>",
             f"<ul class='small'>{legend}<li>a red outline: the outcome or a check changed there</li></ul>",
             _grid_html(t),
             f"<h2>Changed cases ({len(t.changed)})</h2>",
             _html_cases(t, t.changed) if t.changed else "<p>No case changed outcome across these releases.</p>",
             f"<details><summary>Unchanged cases ({len(t.unchanged)}): {_e(_counts_text(t.unchanged_counts()))}</summary>"
             + _html_cases(t, t.unchanged) + "</details>"]
    holes = t.holes()
    if holes:
        rows = "".join(f"<tr><td>{_e(_ranges(rel))}</td><td>{_e(o)}</td><td>{_e(why)}</td>"
                       f"<td>{len(ids)}: {_e(', '.join(ids))}</td></tr>" for rel, o, why, ids in holes)
        parts.append(f"<h2>Coverage holes</h2><table><tr><th>releases</th><th>outcome</th><th>reason</th><th>cases</th></tr>{rows}</table>")
    if t.archs is not None:
        ax = arch_lines(t.archs)
        parts.append(f"<h2>{_e(ax[0].removeprefix('## '))}</h2><pre>{_e(chr(10).join(ax[2:]))}</pre>")
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
        "architectures": arch_json(t.archs),
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
    """A results.json, or a report directory holding one: read and checked as compare reads it."""
    from harness.gate.compare import CompareInputError, load

    try:
        return load(path)
    except CompareInputError as exc:
        raise SweepInputError(str(exc)) from None
