"""Reports: results.json for machines (CI, the baseline gate) and a table for people."""

from __future__ import annotations

import json
import os
import platform
import re
import sys
from collections import Counter
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harness.core.parity import Tolerance
from harness.core.result import HOLES, STATUSES, CaseResult, shows_diff
from harness.core.schedule import summaries

_STYLE = {"passed": "green", "failed": "bold red", "error": "bold magenta", "xfailed": "yellow", "not-run": "cyan", "not-applicable": "cyan"}
_VERSIONED = ("torch", "megatron-core", "megatron-bridge", "transformers", "peft")


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in _VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def environment() -> dict | None:
    """The record harness/gate/envspec.py left in this venv (specs, overrides with commits, pip freeze),
    so every results.json says exactly what it ran against; None outside such a venv."""
    path = Path(sys.prefix) / "ckpt-env.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def code_digest() -> str:
    """sha256 (12 hex) of the harness's own code and matrices as this run imported them: two runs
    with the same digest ran the same harness, so the gate may reuse one side's results."""
    import hashlib

    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for top in ("harness", "cases", "matrices"):
        for path in sorted((root / top).rglob("*")):
            if path.suffix in (".py", ".yaml") and path.is_file():
                h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def moved_from_pins(env: dict | None = None) -> set[str]:
    """The distributions this venv's release set moved from the project's pins (asked, resolved as a
    companion, or dropped as a dependent); empty for the pins' own venv or outside the harness's venvs.
    Why: an API missing in one of these is the release's (the case is not-applicable to it), while on
    the pins every API the harness calls exists, so a missing one there is the harness's own error."""
    env = environment() if env is None else env
    if not env:
        return set()
    rs = env.get("release_set") or {}
    names = [o.get("name") for o in env.get("overrides") or []]
    names += [c.get("name") for key in ("resolved", "dropped") for c in rs.get(key) or []]
    return {re.sub(r"[-_.]+", "-", n).lower() for n in names if n}


def counts(results: Iterable[CaseResult]) -> dict[str, int]:
    c = Counter(r.status for r in results)
    return {s: c.get(s, 0) for s in STATUSES}


def document(results: list[CaseResult], matrix: str, wall_s: float, complete: bool = True, **run: Any) -> dict:
    """What results.json holds (and what the HTML report is drawn from). `run`: what the run says of
    itself beside its results: `selected` (the ids it was asked for, so a reader such as the gate can
    tell a whole run from one that died part-way) and `import_problems` (module -> traceback, when
    the run probed its environment's imports)."""
    return {
        "matrix": matrix,
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "complete": complete,
        **run,
        "wall_s": round(wall_s, 2),
        "platform": {"machine": platform.machine(), "system": platform.system()},
        "versions": versions(),
        "environment": environment(),
        "summary": counts(results),
        "results": [r.to_dict() for r in results],
    }


def write_json(results: list[CaseResult], path: Path, matrix: str, wall_s: float, complete: bool = True, **run: Any) -> Path:
    """results.json, replaced atomically: the CLI rewrites it after every case (complete=False),
    so a run that dies half-way still leaves every finished result readable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = document(results, matrix, wall_s, complete, **run)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str))
    tmp.replace(path)
    return path


def write_junit(results: list[CaseResult], path: Path, suite: str, wall_s: float) -> Path:
    """JUnit XML for CI test views (junit_xml) written to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(junit_xml(results, suite, wall_s))
    return path


def junit_xml(results: list[CaseResult], suite: str, wall_s: float) -> bytes:
    """One testcase per case; `failed` -> <failure>, `error` -> <error> (both with the failure text),
    `xfailed` -> <skipped> naming the upstream defect, `not-run` -> <skipped> with what the machine
    lacks, `not-applicable` -> <skipped> with the API the release lacks."""
    import xml.etree.ElementTree as ET

    c = counts(results)
    root = ET.Element("testsuite", name=suite, tests=str(len(results)), failures=str(c["failed"]), errors=str(c["error"]),
                      skipped=str(c["xfailed"] + c["not-run"] + c["not-applicable"]), time=f"{wall_s:.3f}")
    for r in results:
        tc = ET.SubElement(root, "testcase", classname=f"ckpt_harness.{r.case}", name=r.id, time=f"{r.phases.get('total', 0):.3f}")
        text = r.failure_text()
        if r.status == "failed":
            ET.SubElement(tc, "failure", message=(r.error or text).splitlines()[0][:500]).text = text
        elif r.status == "error":
            ET.SubElement(tc, "error", message=(r.error or "error").strip().splitlines()[0][:500]).text = text
        elif r.status == "xfailed":
            ET.SubElement(tc, "skipped", message=f"xfail (named upstream defect): {r.xfail_reason}")
        elif r.status in HOLES:
            ET.SubElement(tc, "skipped", message=f"{r.status.replace('-', ' ')}: {r.hole_reason}")
    return ET.tostring(root, encoding="utf-8", xml_declaration=True)


def _checks_cell(r: CaseResult) -> str:
    if not r.checks:
        return "-"
    parts = []
    for c in r.checks:
        if c.status != "passed":
            mark = {"failed": "[red]✗[/]", "not-run": "[dim]–[/]"}.get(c.status, "?")
            parts.append(f"{mark}{c.name}")
    passed = sum(c.status == "passed" for c in r.checks)
    return f"{passed}/{len(r.checks)} ✓ " + " ".join(parts)


def _diff_cell(r: CaseResult) -> str:
    diffs = [c.max_abs_diff for c in r.checks if c.max_abs_diff is not None and shows_diff(c.name, c.tolerance)]
    if not diffs:
        return "-"
    worst = max(diffs)
    return "0" if worst == 0 else f"{worst:.1e}"


def table(results: list[CaseResult], title: str) -> Table:
    t = Table(title=title, show_lines=False, header_style="bold")
    t.add_column("case")
    t.add_column("status")
    t.add_column("checks")
    t.add_column("max |Δ| (tol.)", justify="right")
    t.add_column("save/load/total s", justify="right")
    t.add_column("rank0 save ΔRSS MiB", justify="right")
    for r in results:
        times = "/".join(f"{r.phases.get(p, 0):.1f}" for p in ("save", "load", "total"))
        save0 = r.memory.get("save", {}).get("0")
        mem = f"{save0['peak_delta'] / 2**20:.1f}" if save0 else "-"
        t.add_row(escape(r.id), f"[{_STYLE.get(r.status, '')}]{r.status}[/]", _checks_cell(r), _diff_cell(r), times, mem)
    return t


def print_summary(results: list[CaseResult], title: str, wall_s: float, console: Console | None = None) -> None:
    console = console or Console()
    console.print(table(results, title))
    c = counts(results)
    console.print(
        f"[bold]{len(results)} cases[/] in {wall_s:.1f}s: "
        + ", ".join(f"[{_STYLE[s]}]{n} {s}[/]" for s, n in c.items() if n)
    )
    if line := reuse_line(r.reuse for r in results):
        console.print(f"[dim]{line}[/]")
    for s in summaries(r.placement for r in results):
        console.print(f"schedule: {s.line()}", highlight=False)
    notes = sorted({c.detail for r in results for c in r.checks if c.status == "not-run"})
    for n in notes:
        console.print(f"[dim]– not run: {n}[/]")
    for r in results:
        if r.status in ("failed", "error"):
            console.print(f"\n[bold red]{escape(r.id)}[/]")
            console.print(r.failure_text(), markup=False, highlight=False)
        elif r.status == "xfailed":
            console.print(f"[yellow]xfailed[/] {escape(r.id)}: {escape(r.xfail_reason or '')}", highlight=False)
    for status in HOLES:
        for reason, ids in not_run_groups(results, status).items():
            console.print(f"[cyan]{status}[/] ({len(ids)}): {escape(reason)}", highlight=False)
            for i in ids:
                console.print(f"  {escape(i)}", highlight=False)


def reuse_line(uses_per_case: Iterable[list[dict]]) -> str | None:
    """One line on the run's save once, load many (harness.run.reuse): sources written, reuses, the
    world time the reuses did not spend; None when no case used the store."""
    wrote, reused, cases, saved = 0, 0, 0, 0.0
    for uses in uses_per_case:
        cases += any(u["role"] == "reused" for u in uses)
        for u in uses:
            wrote += u["role"] == "wrote"
            reused += u["role"] == "reused"
            saved += u["world_s"] if u["role"] == "reused" else 0.0
    if not wrote and not reused:
        return None
    return (f"save once, load many: {wrote} source(s) written, {reused} reuse(s) by {cases} case(s), "
            f"{saved:.0f} s of source worlds not run (ckpt-harness run --no-reuse runs every one)")


def not_run_groups(results: Iterable[CaseResult], status: str = "not-run") -> dict[str, list[str]]:
    """Case ids of one hole status (`not-run`, `not-applicable`) grouped by their reason (one line per
    missing thing, not per case)."""
    out: dict[str, list[str]] = {}
    for r in results:
        if r.status == status:
            out.setdefault(r.hole_reason or "(no reason recorded)", []).append(r.id)
    return out


def _worst_toleranced(checks: list[dict]) -> tuple[float | None, str]:
    """(largest diff, its check's tolerance) over logits/toleranced checks of one record."""
    worst: tuple[float | None, str] = (None, "")
    for c in checks:
        d, tol = c.get("max_abs_diff"), Tolerance.from_json(c.get("tolerance"))
        if d is None or not shows_diff(c["name"], tol):
            continue
        if worst[0] is None or d > worst[0]:
            worst = (d, tol.label.split(" (")[0])
    return worst


def markdown(doc: dict) -> str:
    """results.json as Markdown (CI summaries, PR comments, docs): one row per case, then totals."""
    rows = ["| case | status | checks | max abs diff (tolerance) | total s |", "|---|---|---|---|---:|"]
    for r in doc["results"]:
        checks = r.get("checks", [])
        failed = [c["name"] for c in checks if c["status"] == "failed"]
        ok = sum(c["status"] == "passed" for c in checks)
        cell = f"{ok}/{len(checks)}" + (f" (failed: {', '.join(failed)})" if failed else "")
        d, tol = _worst_toleranced(checks)
        diff = "-" if d is None else ("0" if d == 0 else f"{d:.1e}") + (f" ({tol})" if tol else "")
        why = r.get("not_run_reason") if r["status"] == "not-run" else r.get("not_applicable_reason") if r["status"] == "not-applicable" else None
        status = r["status"] + (f" ({why})" if why else "")
        rows.append(f"| `{r['id']}` | {status} | {cell} | {diff} | {r.get('phases', {}).get('total', 0):.1f} |")
    s = doc.get("summary", {})
    total = ", ".join(f"{n} {k}" for k, n in s.items() if n)
    rows.append(f"\n{len(doc['results'])} cases in {doc.get('wall_s', 0):.0f} s: {total}")
    if line := reuse_line(r.get("reuse", []) for r in doc["results"]):
        rows.append(f"\n{line}")
    # GPU packing (harness.orchestration.schedulers.packing): each case's set and times are its `placement`
    rows += [f"\nschedule: {s.line()}" for s in summaries(r.get("placement") for r in doc["results"])]
    return "\n".join(rows)
