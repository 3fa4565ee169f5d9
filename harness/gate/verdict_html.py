"""verdict.html beside verdict.md (harness.gate.bump.run_gate writes it; `compare --out` writes the
same page as compare.html): the verdict for a browser, in the order a reviewer needs it. The verdict
and its counts, what could not be evaluated (it keeps the verdict from SAFE), the failing findings
by class, the grid of both sides' outcomes (each cell a case, its left half the baseline's status,
its right half the candidate's, outlined where a failing finding names it; a click opens the case),
the other findings, then each case's details (the cases with a finding first, the rest collapsed
per case kind) and verdict.md itself. No script, no external file."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any, Callable

from harness.core.result import GREEN
from harness.gate import compare
from harness.gate.evidence import CLASS_TITLES, Coverage
from harness.report import grid
from harness.report import html as run_html

_CSS = """h1.verdict{padding:10px 14px;border-radius:6px;color:#fff}h1.v0{background:#1a7f37}h1.v1{background:#cf222e}
h1.v2{background:#57606a}.sides{display:grid;grid-template-columns:1fr 1fr;gap:12px}.sides>div{min-width:0}
"""
#: a case block's rank on the page (data-rank): what needs a reviewer first
RANKS = ("failing", "unevaluated", "finding", "red", "green")


def headline(code: int, failing: int, evaluated: bool = True) -> str:
    """The verdict in words, as verdict.md and verdict.html head it (`evaluated`: the gate got as far
    as judging coverage; before that an exit 2 is COULD NOT RUN)."""
    if code == 2:
        return "NOT EVALUATED (exit 2)" if evaluated else "COULD NOT RUN (exit 2)"
    return f"NOT SAFE, {failing} failing finding(s) (exit 1)" if code == 1 else "SAFE TO BUMP (exit 0)"


def _link(case: str, known: set[str]) -> str:
    code = f"<code>{escape(case)}</code>"
    return f'<a href="#{grid.anchor(case)}">{code}</a>' if case in known else code


def _status_pair(b: dict | None, c: dict | None) -> str:
    return f"{b['status'] if b else 'absent'} → {c['status'] if c else 'absent'}"


def _table(findings: list[compare.Finding], known: set[str], by_case: Callable[[str], tuple[dict | None, dict | None]]) -> str:
    rows = "".join(f'<tr data-class="{escape(f.kind)}"><td>{_link(f.case, known)}</td><td>{escape(f.kind)}</td>'
                   f"<td>{escape(_status_pair(*by_case(f.case)) if f.case in known else '')}</td><td>{escape(f.detail)}</td></tr>"
                   for f in findings)
    return f"<table><tr><th>case</th><th>class</th><th>baseline → candidate</th><th>detail</th></tr>{rows}</table>"


def render(md: str, findings: list[compare.Finding], base: dict | None, cand: dict | None, code: int,
           cover: Any = None, error: str | None = None, tracebacks: dict[str, str] | None = None,
           title: str = "Bump gate", names: tuple[str, str] = ("baseline", "candidate")) -> str:
    """The page. `cover`: evidence.Coverage (None when the gate stopped before judging coverage);
    `tracebacks`: module -> import traceback of each package the candidate cannot import."""
    sides = [{r["id"]: r for r in (doc or {}).get("results") or []} for doc in (base, cand)]
    ids = list(dict.fromkeys([*sides[0], *sides[1]]))
    known = set(ids)

    def by_case(cid: str) -> tuple[dict | None, dict | None]:
        return sides[0].get(cid), sides[1].get(cid)

    failing = [f for f in findings if f.failing]
    per_case: dict[str, list[compare.Finding]] = {}
    for f in findings:
        per_case.setdefault(f.case, []).append(f)
    blocking = dict(cover.blocking) if cover is not None else {}
    parts = [f'<h1 class="verdict v{code}">{escape(title)}: {escape(headline(code, len(failing), cover is not None))}</h1>']
    if cover is not None:
        parts.append(grid.counts([
            ("evaluated on both sides", len(cover.evaluated), "passed", "#grid"),
            ("failing finding(s)", len(failing), "failed", "#failing"),
            ("unevaluated (not accepted)", len(blocking), "not-run", "#unevaluated"),
            ("accepted unevaluated", len(cover.accepted), "not-applicable", "#unevaluated"),
            ("baseline-red", len(cover.baseline_red), "error", "#cases"),
            ("coverage holes", len(cover.holes), "not-applicable", "#grid"),
            ("not run on a side", len(cover.not_run), "not-applicable", "#grid")]))
        parts.append(f"<p>{len(cover.evaluated)} of {cover.selected} selected case(s) evaluated on both sides.</p>")
    for name, doc in zip(names, (base, cand)):
        if doc is not None:
            c = doc.get("summary") or {}
            parts.append(f"<p class='small'>{escape(name)}: {escape(', '.join(f'{n} {s}' for s, n in c.items() if n))}"
                         f" ({escape(', '.join(f'{k} {v}' for k, v in (doc.get('versions') or {}).items() if v))})</p>")
    if error:
        parts.append(f"<pre>{escape(error.strip())}</pre>")
    if blocking or (cover is not None and cover.accepted):
        causes: dict[str, list[str]] = {}
        for cid, why in blocking.items():
            causes.setdefault(why, []).append(cid)
        rows = "".join(f"<tr><td>{escape(why)}</td><td>{len(cs)}</td><td>{', '.join(_link(c, known) for c in cs)}</td></tr>"
                       for why, cs in sorted(causes.items(), key=lambda x: -len(x[1])))
        rows += "".join(f"<tr><td>accepted by <code>--accept-unevaluated {escape(pat)}</code></td><td>1</td>"
                        f"<td>{_link(cid, known)}</td></tr>" for cid, pat in cover.accepted.items())
        parts.append(f'<h2 id="unevaluated">Not evaluated: green on the baseline, no real result on the candidate '
                     f"({len(blocking)})</h2><p>Each keeps the verdict from SAFE unless accepted by name "
                     "(<code>--accept-unevaluated PATTERN</code>).</p>"
                     f'<table id="unevaluated-table"><tr><th>cause</th><th>cases</th><th>which</th></tr>{rows}</table>')
    parts.append(f'<h2 id="failing">Failing findings ({len(failing)})</h2>' + ("" if failing else "<p>None.</p>"))
    for kind in compare.FAILING:
        these = [f for f in failing if f.kind == kind]
        if not these:
            continue
        parts.append(f'<h3 id="f-{escape(kind)}">{escape(CLASS_TITLES.get(kind, kind))} ({len(these)})</h3>'
                     + _table(these, known, by_case))
        for f in these if kind == "does-not-import" else []:
            module = f.case.removeprefix("import ")
            parts.append(f"<p>{escape(module)} in the candidate:</p><pre>{escape((tracebacks or {}).get(module, ''))}</pre>")

    def rank_of(cid: str) -> int:
        fs, (b, c) = per_case.get(cid, []), by_case(cid)
        if any(f.failing for f in fs):
            return 0
        if cid in blocking:
            return 1
        if fs:
            return 2
        return 3 if any(r is not None and r["status"] not in GREEN for r in (b, c)) else 4

    ranks = {cid: rank_of(cid) for cid in ids}
    ordered = sorted(ids, key=lambda cid: (ranks[cid], run_html.rank(by_case(cid)[1] or by_case(cid)[0])))

    def cell(r: dict[str, Any]) -> grid.Cell:
        b, c = by_case(r["id"])
        classes = ", ".join(sorted({f.kind for f in per_case.get(r["id"], [])}))
        return grid.Cell(r["id"], (b["status"] if b else "absent", c["status"] if c else "absent"),
                         f"{r['id']}: {names[0]} {_status_pair(b, c).replace(' → ', f', {names[1]} ')}"
                         + (f"; {classes}" if classes else ""), flag=ranks[r["id"]] == 0)

    records = [by_case(cid)[1] or by_case(cid)[0] for cid in ordered]
    if records:
        parts.append(run_html.grids(records, cell, f"each cell: left half the {names[0]}, right half the {names[1]}; "
                                                   "outlined: a failing finding"))
    rest = [f for f in findings if not f.failing]
    if rest:
        parts.append(f'<h2 id="other">Other findings ({len(rest)})</h2><details><summary>'
                     f"{escape(', '.join(f'{k} {n}' for k, n in _count(rest).items()))}</summary>{_table(rest, known, by_case)}</details>")

    def block(r: dict[str, Any]) -> str:
        cid = r["id"]
        b, c = by_case(cid)
        fs = per_case.get(cid, [])
        head = (f"{escape(_status_pair(b, c))} <code>{escape(cid)}</code>"
                + "".join(f'<span class="tag">{escape(f.kind)}</span>' for f in fs))
        inner = "".join(f"<p><b>{escape(f.kind)}</b>: {escape(f.detail)}</p>" for f in fs)
        charts = any(f.kind == "memory-growth" for f in fs)
        sides_html = "".join(f"<div>{run_html.case_block(r_, '', open_=False, charts=charts, label=f'{n}: ', cls='side')}</div>"
                             if r_ else f"<div><p>{escape(n)}: absent</p></div>" for n, r_ in zip(names, (b, c)))
        return (f'<details class="case" id="{grid.anchor(cid)}" data-rank="{RANKS[ranks[cid]]}"'
                f'{" open" if ranks[cid] == 0 else ""}><summary>{head}</summary>{inner}<div class="sides">{sides_html}</div></details>')

    first = [r for r in records if ranks[r["id"]] < 4]
    parts.append(f'<h2 id="cases">Cases ({len(records)})</h2>' + "".join(block(r) for r in first))
    green = [r for r in records if ranks[r["id"]] == 4]
    if green:
        parts.append(f'<h3 id="unchanged">Green on both sides, no finding ({len(green)}), per case kind</h3>'
                     + run_html.kind_groups(green, block))
    parts.append(f"<details><summary>verdict.md</summary><pre>{escape(md)}</pre></details>")
    return grid.page(title, "".join(parts), run_html.CSS + _CSS)


def _count(findings: list[compare.Finding]) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in findings:
        out[f.kind] = out.get(f.kind, 0) + 1
    return out


def write(path: Path, md: str, findings: list[compare.Finding], base: dict | None, cand: dict | None, code: int,
          cover: Any = None, error: str | None = None, tracebacks: dict[str, str] | None = None, **kw: Any) -> Path:
    """Write the page to `path` (verdict.html, compare.html)."""
    path.write_text(render(md, findings, base, cand, code, cover, error, tracebacks, **kw), encoding="utf-8")
    return path


def write_compare(out: Path) -> Path:
    """out/compare.html, from what `compare --out` wrote beside it (compare.json, compare.md) and the two
    runs it names: the page the gate writes as verdict.html."""
    doc = json.loads((out / "compare.json").read_text())
    findings = [compare.Finding(f["case"], f["class"], f["detail"], f.get("base"), f.get("candidate")) for f in doc["findings"]]
    cover = Coverage(**doc["coverage"]) if doc.get("coverage") else None
    base, cand = (compare.load(Path(doc[side]["path"])) for side in ("base", "candidate"))
    return write(out / "compare.html", (out / "compare.md").read_text(), findings, base, cand, doc["exit_code"], cover,
                 title="ckpt-harness compare", names=("base", "candidate"))
