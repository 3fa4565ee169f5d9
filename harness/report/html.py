"""One self-contained HTML report of a run (`ckpt-harness run --html FILE`, `ckpt-harness show
results.json --html FILE`), in the order a reader needs it: the counts per status, then the failing
and erroring cases (each with its first failed check or error line), the grid picture (case kind x
topology pair, architecture x column; each cell a link to its case), the expected failures and the
cases not run with their reasons, and last every case's details: failures open with their
mismatches, the failing rank's traceback and output, and the memory timeline of each rank in each
phase as inline SVG; passing cases collapsed per case kind. No script, no external file: it opens
anywhere, CI artefact viewers included."""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any, Callable, Iterable

from harness.core.frames import exception_of
from harness.core.parity import Tolerance
from harness.core.result import HOLES, KNOWN_FORM
from harness.report import grid

_RANKS = ("#0969da", "#cf222e", "#1a7f37", "#9a6700", "#8250df", "#bf3989", "#0550ae", "#57606a")
_MiB = 1024 * 1024
CSS = """.charts{display:flex;flex-wrap:wrap;gap:16px}.chart{font-size:12px}
details.kind>summary{font-weight:600}.tag{font-size:11px;border:1px solid #d0d7de;border-radius:8px;padding:0 6px;margin-left:4px}
"""


def _status(s: str) -> str:
    color = grid.COLORS.get(s, "#1f2328")
    return f'<span class="status" style="color:{"#1f2328" if s in ("not-run", "not-applicable") else color}">{escape(s)}</span>'


def known_form(r: dict[str, Any]) -> bool:
    """An xfailed case that met its defect in a form declared for another release (matrix known_on)."""
    return any(str(n).startswith(KNOWN_FORM) for n in r.get("notes") or [])


def tags(r: dict[str, Any]) -> list[str]:
    """What a status alone hides: an XPASS, a named defect that failed otherwise, a known-on form."""
    out = []
    if (r.get("error") or "").startswith("XPASS"):
        out.append("XPASS: the named defect no longer fails")
    if any(str(n).startswith("failed, but not as expected") for n in r.get("notes") or []):
        out.append("the named defect failed otherwise")
    if r["status"] == "xfailed" and known_form(r):
        out.append("defect in a known_on form")
    return out


def rank(r: dict[str, Any]) -> tuple[int, int]:
    """Failed, error, xfailed (a known_on form first), not-applicable, not-run, passed; run order within."""
    status = r["status"]
    return (grid.RANK.index(status) if status in grid.RANK else len(grid.RANK), 0 if tags(r) else 1)


def ranked(results: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records in the order the pages show them (a stable sort: run order within a rank)."""
    return sorted(results, key=rank)


def what(r: dict[str, Any]) -> str:
    """One line on why a case is not green: its first failed check, its error's exception, its reason."""
    if r["status"] == "xfailed":
        return str(r.get("xfail_reason") or "")
    if r["status"] in HOLES:
        return str(r.get("not_run_reason") or r.get("not_applicable_reason") or "")
    bad = [c for c in r.get("checks") or [] if c.get("status") == "failed"]
    if bad:
        return f"{bad[0]['name']}: {str(bad[0].get('detail') or '')[:240]}"
    exc_type, message = exception_of(r.get("error") or "")
    first = message.splitlines()[0] if message else ""
    return (f"{exc_type}: {first}" if exc_type else first)[:300]


def _chart(phase: str, ranks: dict[str, Any], width: int = 360, height: int = 150) -> str:
    """One phase: an SVG polyline of RSS (MiB) over time per rank, with the axes' ranges."""
    series = {r: m.get("timeline") or [] for r, m in sorted(ranks.items(), key=lambda kv: int(kv[0]))}
    pts = [p for tl in series.values() for p in tl]
    if not pts:
        return f'<div class="chart">{escape(phase)}: no timeline recorded</div>'
    t_max = max(t for t, _ in pts) or 1e-9
    v_min, v_max = min(v for _, v in pts) / _MiB, max(v for _, v in pts) / _MiB
    span = (v_max - v_min) or 1.0
    pad = 30
    lines = []
    for i, (rank_, tl) in enumerate(series.items()):
        xy = " ".join(f"{pad + t / t_max * (width - pad - 4):.1f},{4 + (1 - (v / _MiB - v_min) / span) * (height - 24):.1f}" for t, v in tl)
        lines.append(f'<polyline fill="none" stroke="{_RANKS[i % len(_RANKS)]}" stroke-width="1.5" points="{xy}"><title>rank {escape(rank_)}</title></polyline>')
    legend = " ".join(
        f'<span style="color:{_RANKS[i % len(_RANKS)]}">rank {escape(r)}: peak Δ {ranks[r].get("peak_delta", 0) / _MiB:.1f} MiB</span>'
        for i, r in enumerate(series))
    return (f'<div class="chart"><b>{escape(phase)}</b><br><svg width="{width}" height="{height}" role="img" '
            f'aria-label="RSS of each rank during {escape(phase)}">'
            f'<rect x="{pad}" y="4" width="{width - pad - 4}" height="{height - 24}" fill="#fff" stroke="#d0d7de"/>'
            f'<text x="2" y="12" font-size="10">{v_max:.0f}</text><text x="2" y="{height - 20}" font-size="10">{v_min:.0f}</text>'
            f'<text x="{pad}" y="{height - 6}" font-size="10">0 s</text><text x="{width - 40}" y="{height - 6}" font-size="10">{t_max:.2f} s</text>'
            + "".join(lines) + f"</svg><br>RSS MiB over the phase; {legend}</div>")


def _checks_count(r: dict[str, Any]) -> str:
    checks = r.get("checks") or []
    return f"{sum(c['status'] == 'passed' for c in checks)}/{len(checks)}"


def case_block(r: dict[str, Any], element_id: str | None = None, open_: bool | None = None, charts: bool = True,
               label: str = "", cls: str = "case") -> str:
    """One case's details: its checks, reasons, error, mismatches, notes, memory charts (`charts`)
    and phases. `element_id` (default: the case's anchor; '' for none) is what grid cells link to;
    `open_` (default: failed or error) shows it unfolded; `cls`: `case`, or `side` for one side's
    record inside the verdict page's case."""
    element_id = grid.anchor(r["id"]) if element_id is None else element_id
    open_ = r["status"] in ("failed", "error") if open_ is None else open_
    checks = "".join(
        f'<tr><td>{escape(c["name"])}</td><td>{_status(c["status"])}</td><td>{escape(c.get("detail") or "")}</td>'
        f'<td class="num">{"" if c.get("max_abs_diff") is None else f"{c["max_abs_diff"]:.2e}"}</td><td>{escape(Tolerance.from_json(c.get("tolerance")).label)}</td></tr>'
        for c in r.get("checks", []))
    secs = (r.get("phases") or {}).get("total", 0) or 0
    head = (f'{escape(label)}{_status(r["status"])} <code>{escape(r["id"])}</code> <span class="small">{_checks_count(r)} checks, '
            f'{secs:.1f} s</span>' + "".join(f'<span class="tag">{escape(t)}</span>' for t in tags(r)))
    id_attr = f' id="{escape(element_id)}"' if element_id else ""
    parts = [f'<details{id_attr} class="{cls}" data-status="{escape(r["status"])}"{" open" if open_ else ""}><summary>{head}</summary>']
    if checks:
        parts.append(f"<table><tr><th>check</th><th>status</th><th>detail</th><th>max |Δ|</th><th>tolerance</th></tr>{checks}</table>")
    if r.get("not_run_reason"):
        parts.append(f"<p>not run on this machine: {escape(r['not_run_reason'])}</p>")
    if r.get("not_applicable_reason"):
        parts.append(f"<p>not applicable to this release: {escape(r['not_applicable_reason'])}</p>")
    if r.get("xfail_reason"):
        parts.append(f"<p>expected failure (named upstream defect): {escape(r['xfail_reason'])}</p>")
    if r.get("error"):
        parts.append(f"<p>error, with the failing rank's traceback and output:</p><pre>{escape(r['error'])}</pre>")
    for c in (c for c in r.get("checks", []) if c["status"] == "failed" and c.get("mismatches")):
        rows = "".join(f"<tr><td>{escape(m['key'])}</td><td>{escape(m['kind'])}</td><td>{escape(m['expected'])} vs {escape(m['actual'])}</td>"
                       f"<td>{escape(m.get('detail') or '')}</td></tr>" for m in c["mismatches"][:20])
        parts.append(f"<p>mismatches of {escape(c['name'])} ({len(c['mismatches'])}):</p><table>{rows}</table>")
    if r.get("notes"):
        parts.append("<ul>" + "".join(f"<li>{escape(n)}</li>" for n in r["notes"]) + "</ul>")
    if charts and r.get("memory"):
        parts.append('<div class="charts">' + "".join(_chart(ph, ranks) for ph, ranks in r["memory"].items()) + "</div>")
    phases = ", ".join(f"{escape(k)} {v:.2f} s" for k, v in (r.get("phases") or {}).items())
    parts.append(f"<p>phases: {phases or '-'}</p></details>")
    return "".join(parts)


def rows_table(records: list[dict[str, Any]], table_id: str) -> str:
    """One row per case: status, the case (a link to its details), kind, S→D, checks, why."""
    rows = "".join(
        f'<tr data-status="{escape(r["status"])}"><td>{_status(r["status"])}</td>'
        f'<td><a href="#{grid.anchor(r["id"])}"><code>{escape(r["id"])}</code></a>'
        + "".join(f'<span class="tag">{escape(t)}</span>' for t in tags(r))
        + f"</td><td>{escape(grid.kind_of(r))}</td><td>{escape(grid.pair_of(r))}</td><td>{_checks_count(r)}</td>"
        f"<td>{escape(what(r))}</td></tr>" for r in records)
    return (f'<table class="cases" id="{table_id}"><tr><th>status</th><th>case</th><th>kind</th><th>S→D</th><th>checks</th>'
            f"<th>first failed check / error / reason</th></tr>{rows}</table>")


def kind_groups(records: list[dict[str, Any]], block: Callable[[dict[str, Any]], str] | None = None) -> str:
    """Cases grouped per case kind, each group one collapsed <details> (`block` renders a case)."""
    block = block or case_block
    kinds: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        kinds.setdefault(grid.kind_of(r), []).append(r)
    return "".join(f'<details class="kind" id="k-{escape(grid.anchor(k))}"><summary>{escape(k)}: {len(rs)} case(s)</summary>'
                   + "".join(block(r) for r in rs) + "</details>" for k, rs in kinds.items())


def _cell(r: dict[str, Any]) -> grid.Cell:
    return grid.Cell(r["id"], (r["status"],), f"{r['id']}: {r['status']}", flag=bool(tags(r)))


def grids(records: list[dict[str, Any]], cell_of: Callable[[dict[str, Any]], grid.Cell] = _cell, legend: str = "") -> str:
    """The grid section: case kind x topology pair, then architecture x column where the run has such cases."""
    present = {s for r in records for s in cell_of(r).statuses}
    statuses = [s for s in dict.fromkeys((*grid.RANK, *grid.COLORS, *sorted(present))) if s in present]
    parts = ['<h2 id="grid">Grid: case kind x topology pair</h2>', grid.legend(statuses, legend),
             grid.kind_pair_grid(records, cell_of)]
    if arch := grid.arch_grid(records, cell_of):
        parts += ['<h3 id="grid-architectures">Architectures x column</h3>', arch]
    return "".join(parts)


def render(doc: dict[str, Any], title: str) -> str:
    """The page of one results.json document: what needs a reader first, at the top."""
    results = ranked(doc.get("results", []))
    by = {s: [r for r in results if r["status"] == s] for s in grid.RANK}
    bad = by["failed"] + by["error"]
    holes = by["not-applicable"] + by["not-run"]
    versions = ", ".join(f"{escape(k)} {escape(str(v))}" for k, v in (doc.get("versions") or {}).items())
    box = {"failed": "#failing", "error": "#failing", "xfailed": "#xfailed", "not-applicable": "#holes", "not-run": "#holes",
           "passed": "#passed"}
    parts = [f"<h1>{escape(title)}</h1><p>{len(results)} cases in {doc.get('wall_s', 0):.0f} s"
             f"{'' if doc.get('complete', True) else ' (incomplete run)'}</p><p class='small'>{versions}</p>",
             grid.counts((s, len(by[s]), s, box[s]) for s in grid.RANK)]
    parts.append(f'<h2 id="failing">Failed and errored ({len(bad)})</h2>'
                 + (rows_table(bad, "failing-table") if bad else "<p>None: every case passed, xfailed or was not run.</p>"))
    parts.append(grids(results, legend="outlined: an XPASS, a defect failing otherwise, or a known_on form"))
    if by["xfailed"]:
        parts.append(f'<h2 id="xfailed">Expected failures: named upstream defects ({len(by["xfailed"])})</h2>'
                     + rows_table(by["xfailed"], "xfailed-table"))
    if holes:
        parts.append(f'<h2 id="holes">Not run or not applicable ({len(holes)})</h2>' + rows_table(holes, "holes-table"))
    parts.append('<h2 id="cases">Cases</h2>' + "".join(case_block(r) for r in results if r["status"] != "passed"))
    if by["passed"]:
        parts.append(f'<h3 id="passed">Passed ({len(by["passed"])}), per case kind</h3>' + kind_groups(by["passed"]))
    return grid.page(title, "".join(parts), CSS)


def write(doc: dict[str, Any], path: Path, title: str) -> Path:
    """`render` into `path` (its directory made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(doc, title), encoding="utf-8")
    return path
