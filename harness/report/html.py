"""One self-contained HTML report of a run (`ckpt-harness run --html FILE`, `ckpt-harness show
results.json --html FILE`): the summary table, every case's checks, each failure's text with the
rank output the launcher quoted, and per case the memory timeline of each rank in each phase,
drawn as inline SVG from the sampler's timeline (no script, no external file: it opens anywhere,
CI artefact viewers included)."""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from harness.core.parity import Tolerance

_COLOR = {"passed": "#1a7f37", "failed": "#cf222e", "error": "#8250df", "xfailed": "#9a6700", "not-run": "#57606a", "not-applicable": "#57606a"}
_RANKS = ("#0969da", "#cf222e", "#1a7f37", "#9a6700", "#8250df", "#bf3989", "#0550ae", "#57606a")
_MiB = 1024 * 1024
_CSS = """
body{font:14px system-ui,sans-serif;margin:24px;color:#1f2328}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #d0d7de;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa}.num{text-align:right;font-variant-numeric:tabular-nums}
pre{background:#f6f8fa;padding:8px;overflow-x:auto;max-height:420px;font-size:12px}
details{margin:10px 0;border:1px solid #d0d7de;border-radius:6px;padding:6px 10px}summary{cursor:pointer}
.status{font-weight:600}.charts{display:flex;flex-wrap:wrap;gap:16px}.chart{font-size:12px}
"""


def _status(s: str) -> str:
    return f'<span class="status" style="color:{_COLOR.get(s, "#1f2328")}">{escape(s)}</span>'


def _anchor(case_id: str) -> str:
    return "c" + "".join(ch if ch.isalnum() else "-" for ch in case_id)


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
    for i, (rank, tl) in enumerate(series.items()):
        xy = " ".join(f"{pad + t / t_max * (width - pad - 4):.1f},{4 + (1 - (v / _MiB - v_min) / span) * (height - 24):.1f}" for t, v in tl)
        lines.append(f'<polyline fill="none" stroke="{_RANKS[i % len(_RANKS)]}" stroke-width="1.5" points="{xy}"><title>rank {escape(rank)}</title></polyline>')
    legend = " ".join(
        f'<span style="color:{_RANKS[i % len(_RANKS)]}">rank {escape(r)}: peak Δ {ranks[r].get("peak_delta", 0) / _MiB:.1f} MiB</span>'
        for i, r in enumerate(series))
    return (f'<div class="chart"><b>{escape(phase)}</b><br><svg width="{width}" height="{height}" role="img" '
            f'aria-label="RSS of each rank during {escape(phase)}">'
            f'<rect x="{pad}" y="4" width="{width - pad - 4}" height="{height - 24}" fill="#fff" stroke="#d0d7de"/>'
            f'<text x="2" y="12" font-size="10">{v_max:.0f}</text><text x="2" y="{height - 20}" font-size="10">{v_min:.0f}</text>'
            f'<text x="{pad}" y="{height - 6}" font-size="10">0 s</text><text x="{width - 40}" y="{height - 6}" font-size="10">{t_max:.2f} s</text>'
            + "".join(lines) + f"</svg><br>RSS MiB over the phase; {legend}</div>")


def _case(r: dict[str, Any]) -> str:
    checks = "".join(
        f'<tr><td>{escape(c["name"])}</td><td>{_status(c["status"])}</td><td>{escape(c.get("detail") or "")}</td>'
        f'<td class="num">{"" if c.get("max_abs_diff") is None else f"{c["max_abs_diff"]:.2e}"}</td><td>{escape(Tolerance.from_json(c.get("tolerance")).label)}</td></tr>'
        for c in r.get("checks", []))
    parts = [f'<details id="{_anchor(r["id"])}"{" open" if r["status"] in ("failed", "error") else ""}>',
             f'<summary>{_status(r["status"])} <code>{escape(r["id"])}</code></summary>']
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
    failed = [c for c in r.get("checks", []) if c["status"] == "failed" and c.get("mismatches")]
    for c in failed:
        rows = "".join(f"<tr><td>{escape(m['key'])}</td><td>{escape(m['kind'])}</td><td>{escape(m['expected'])} vs {escape(m['actual'])}</td>"
                       f"<td>{escape(m.get('detail') or '')}</td></tr>" for m in c["mismatches"][:20])
        parts.append(f"<p>mismatches of {escape(c['name'])} ({len(c['mismatches'])}):</p><table>{rows}</table>")
    if r.get("notes"):
        parts.append("<ul>" + "".join(f"<li>{escape(n)}</li>" for n in r["notes"]) + "</ul>")
    if r.get("memory"):
        parts.append('<div class="charts">' + "".join(_chart(ph, ranks) for ph, ranks in r["memory"].items()) + "</div>")
    phases = ", ".join(f"{escape(k)} {v:.2f} s" for k, v in r.get("phases", {}).items())
    parts.append(f"<p>phases: {phases}</p></details>")
    return "".join(parts)


def render(doc: dict[str, Any], title: str) -> str:
    results = doc.get("results", [])
    summary = ", ".join(f"{n} {s}" for s, n in (doc.get("summary") or {}).items() if n)
    versions = ", ".join(f"{escape(k)} {escape(str(v))}" for k, v in (doc.get("versions") or {}).items())
    rows = []
    for r in results:
        checks = r.get("checks", [])
        bad = [c["name"] for c in checks if c["status"] not in ("passed", "not-run")]
        save0 = (r.get("memory") or {}).get("save", {}).get("0")
        rows.append(
            f'<tr><td><a href="#{_anchor(r["id"])}">{escape(r["id"])}</a></td><td>{_status(r["status"])}</td>'
            f'<td>{sum(c["status"] == "passed" for c in checks)}/{len(checks)}{" " + escape(", ".join(bad)) if bad else ""}'
            f'{" not run: " + escape(r["not_run_reason"]) if r.get("not_run_reason") else ""}'
            f'{" not applicable: " + escape(r["not_applicable_reason"]) if r.get("not_applicable_reason") else ""}</td>'
            f'<td class="num">{r.get("phases", {}).get("total", 0):.1f}</td>'
            f'<td class="num">{"-" if not save0 else f"{save0["peak_delta"] / _MiB:.1f}"}</td></tr>')
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)}</title><style>{_CSS}</style></head><body>"
            f"<h1>{escape(title)}</h1><p>{len(results)} cases in {doc.get('wall_s', 0):.0f} s: {escape(summary)}"
            f"{'' if doc.get('complete', True) else ' (incomplete run)'}</p><p>{versions}</p>"
            "<table><tr><th>case</th><th>status</th><th>checks</th><th>total s</th><th>rank-0 save ΔRSS MiB</th></tr>"
            + "".join(rows) + "</table><h2>Cases</h2>" + "".join(_case(r) for r in results) + "</body></html>")


def write(doc: dict[str, Any], path: Path, title: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(doc, title), encoding="utf-8")
    return path
