"""verdict.md: the gate's answer for people (harness.gate.bump.run_gate writes it).

The head and what could not be evaluated first (evidence.Coverage, the architecture registry's
lines), then what failed (an import the candidate broke with its traceback before anything else),
then the evidence in detail: sides, release sets, findings by class, workarounds, the matrix
comparison, the cross-version reads, the baseline used (run or cached) and the wall times.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.core.frames import exception_of
from harness.core.result import API_MISSING
from harness.gate import classify, compare, evidence, verdict_html
from harness.gate.golden import NOT_WRITTEN


def reason(error: str | None) -> str:
    """The line of an error a reader needs: the 'API not available' line, else the exception a
    rank raised (not the 'rank N of M raised:' header), else the first line."""
    lines = (error or "").strip().splitlines()
    if not lines:
        return ""
    if lines[0].startswith((API_MISSING, NOT_WRITTEN)):
        return lines[0]
    exc_type, message = exception_of(error or "")
    return f"{exc_type}: {message.splitlines()[0] if message else ''}" if exc_type else lines[0]


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def _findings_section(title: str, meaning: str, found: list[compare.Finding]) -> list[str]:
    if not found:
        return []
    rows = [f"| `{f.case}` | {f.kind} | {_cell(f.detail)} |" for f in found]
    return [f"## {title} ({len(found)})", "", meaning + ".", "", "| case | class | detail |", "|---|---|---|", *rows, ""]


def _not_evaluated(findings: list[compare.Finding]) -> list[str]:
    """The harness's own limits on this candidate: counted per case kind, with each distinct reason once."""
    holes = [f for f in findings if f.kind == "not-evaluated"]
    if not holes:
        return []
    kinds: dict[str, int] = {}
    reasons: dict[str, list[str]] = {}
    for f in holes:
        kinds[classify.case_kind(f.case)] = kinds.get(classify.case_kind(f.case), 0) + 1
        reasons.setdefault(f.detail.split(": ", 1)[-1], []).append(f.case)
    lines = [f"## Could not evaluate ({len(holes)})", "", "A coverage hole of the harness, not a finding about the "
             "candidate: no driver for this release's internals, or no valid release set.", "",
             "| case kind | cases |", "|---|---:|", *[f"| {k} | {n} |" for k, n in sorted(kinds.items())], "",
             "| reason | cases |", "|---|---|"]
    lines += [f"| {_cell(why)[:300]} | {len(ids)}: {', '.join(f'`{i}`' for i in ids[:3])}{' ...' if len(ids) > 3 else ''} |"
              for why, ids in reasons.items()]
    return lines + [""]


def _release_sets(sides: list[Any]) -> list[str]:
    """What was asked, what was resolved with it and why each companion moved (harness.gate.releases)."""
    lines = []
    for s in sides:
        rs = s.release_set
        if not rs:
            continue
        lines += [f"### Release set: {s.name}", "", "| | package | spec | why |", "|---|---|---|---|"]
        lines += [f"| asked | | `{a}` | |" for a in rs.get("asked", [])]
        lines += [f"| companion | {c['name']} | `{c['spec']}` | {_cell(c['reason'])} |" for c in rs.get("resolved", [])]
        lines += [f"| dropped pin | {d['name']} | `{d.get('pinned')}` | {_cell(d['why'])} |" for d in rs.get("dropped", [])]
        lines += [f"| user wins | | | {_cell(str(o))} |" for o in rs.get("overridden", [])]
        lines += [f"| note | | | {_cell(str(n))} |" for n in rs.get("notes", [])]
        lines.append("")
    return lines


def _side_table(sides: list[Any]) -> list[str]:
    rows = ["| | specs | venv | megatron-core | megatron-bridge | torch | transformers | peft | env build s |", "|---|---|---|---|---|---|---|---|---:|"]
    for s in sides:
        v = s.versions
        rows.append(f"| {s.name} | {' '.join(f'`{x}`' for x in s.specs) or 'the pins'} | `{s.venv.name if s.venv else '-'}` | "
                    f"{v.get('megatron-core')} | {v.get('megatron-bridge')} | {v.get('torch')} | {v.get('transformers')} | {v.get('peft')} | {s.build_s:.0f} |")
    return rows


def _results_rows(doc: dict[str, Any]) -> list[str]:
    rows = ["| artefact | status | checks | note |", "|---|---|---|---|"]
    for r in doc["results"]:
        checks = r.get("checks", [])
        bad = [c["name"] for c in checks if c["status"] != "passed"]
        note = reason(r.get("error"))[:200] if r.get("error") else "; ".join(
            c["detail"][:160] for c in checks if c["name"] == "refusal")
        rows.append(f"| `{r['id']}` | {r['status']} | {sum(c['status'] == 'passed' for c in checks)}/{len(checks)}"
                    f"{' (' + ', '.join(bad) + ')' if bad else ''} | {note.replace('|', '/')} |")
    return rows


def verdict_markdown(sides: list[Any], findings: list[compare.Finding], base: dict | None, cand: dict | None,
                     cross_docs: list[tuple[str, dict]], timings: dict[str, float], error: str | None,
                     code: int | None = None, cover: evidence.Coverage | None = None,
                     head_lines: list[str] | tuple[str, ...] = ()) -> str:
    """verdict.md: the head and what could not be evaluated first (then `head_lines`: the architecture
    registry's changes, the baseline used), then what failed (an import the candidate broke with its
    traceback before anything else), then the evidence in detail."""
    code = code if code is not None else 2 if error else compare.exit_code(findings)
    failing = [f for f in findings if f.failing]
    lines = [f"# Bump gate: {verdict_html.headline(code, len(failing), cover is not None)}", ""]
    if cover is not None:
        lines += [*cover.lines(), ""]
    if head_lines:
        lines += [*head_lines, ""]
    if error:
        lines += ["```", error.strip(), "```", ""]
    for f in (f for f in findings if f.kind == "does-not-import"):
        module = f.case.removeprefix("import ")
        lines += [f"## {module} does not import in the candidate", "", "Every user who bumps hits this first:", "",
                  "```", sides[1].import_problems[module].strip(), "```", ""]
    lines += [*_side_table(sides), "", *_release_sets(sides)]
    for s in sides:
        for module, problem in s.import_problems.items():
            if s.name == "baseline" or module in sides[0].import_problems:
                lines += [f"**{module} does not import in the {s.name}**: its cases could not be evaluated there.", "",
                          "```", problem.strip(), "```", ""]
    apart = ("api-break", "does-not-import", "architecture-removed", "defect-changed", "hides-workaround", "check-lost")
    lines += _findings_section("Regressions", "a check that passed now fails, or the candidate raises where the "
                               "baseline loaded", [f for f in failing if f.kind not in apart])
    lines += _findings_section("Known defects changed", "a named upstream defect shows another form on the candidate "
                               "(other checks, another error or module, a difference grown or NaN, no longer met, or "
                               "a pass that did not judge everything): nobody has looked at the new form (counted as "
                               "failing, apart from regressions)", [f for f in findings if f.kind == "defect-changed"])
    lines += _findings_section("Workarounds the candidate needs", "a harness.compat workaround that hides an upstream "
                               "defect applied on the candidate and not on the baseline: its green results ran with "
                               "that defect patched (counted as failing; its strict xfail shows the defect unpatched)",
                               [f for f in findings if f.kind == "hides-workaround"])
    lines += _findings_section("Judging checks lost", "a check that judged the case on the baseline is absent or not "
                               "run on the candidate (counted as failing)", [f for f in findings if f.kind == "check-lost"])
    lines += _findings_section("Breaking API changes", "the candidate removed or renamed an API users call: whoever "
                               "bumps hits it too (counted as failing)", [f for f in findings if f.kind == "api-break"])
    lines += _findings_section("Not reproduced (flaky)", "a case that failed on the first run and not when run again "
                               "on both sides: neither a regression nor evidence (it keeps the verdict from SAFE)",
                               [f for f in findings if f.kind == "flaky"])
    lines += _findings_section("Architectures removed", "the candidate's Megatron-Bridge no longer registers an HF "
                               "architecture the baseline's does (counted as failing)",
                               [f for f in findings if f.kind == "architecture-removed"])
    lines += _findings_section("Architectures added", "new in the candidate's registry (listed, never failing)",
                               [f for f in findings if f.kind == "architecture-added"])
    lines += _findings_section("Layout changes at scale", "the production shapes of harness.gate.scale planned on both "
                               "sides: the same keys, shapes and dtypes, chunked otherwise (a warning; a key or shape "
                               "change is a regression above)", [f for f in findings if f.kind == "layout-change"])
    lines += _not_evaluated(findings)
    lines += _workarounds(sides, base, cand)
    if base is not None and cand is not None:
        matrix_findings = [f for f in findings if not f.case.startswith(("golden[", "import ", "architecture ", "scale "))]
        lines += [compare.markdown(base, cand, matrix_findings, ("baseline", "candidate"), code=code)
                  .replace("## ckpt-harness compare", "## Matrix"), ""]
    for title, doc in cross_docs:
        lines += [f"## Cross-version: {title}", "", *_results_rows(doc), ""]
    lines += ["## Wall time", "", "| step | s |", "|---|---:|", *[f"| {k} | {v:.0f} |" for k, v in timings.items()]]
    return "\n".join(lines)


def write_verdict(out: Path, sides: list[Any], findings: list[compare.Finding], base: dict | None, cand: dict | None,
                  cross_docs: list[tuple[str, dict]], timings: dict[str, float], error: str | None, code: int,
                  cover: evidence.Coverage | None, head_lines: list[str]) -> str:
    """out/verdict.md and, beside it for a browser, out/verdict.html (harness.gate.verdict_html);
    returns the Markdown."""
    md = verdict_markdown(sides, findings, base, cand, cross_docs, timings, error, code, cover, head_lines)
    (out / "verdict.md").write_text(md + "\n")
    verdict_html.write(out / "verdict.html", md, findings, base, cand, code, cover, error, sides[1].import_problems,
                       names=(sides[0].name, sides[1].name))
    return md


def _workarounds(sides: list[Any], base: dict | None, cand: dict | None) -> list[str]:
    """Which harness.compat workarounds applied on each side, and to how many cases."""
    counts: dict[str, list[int]] = {}
    for i, doc in enumerate((base, cand)):
        for r in (doc or {}).get("results") or []:
            for name in r.get("compat_shims") or []:
                counts.setdefault(name, [0, 0])[i] += 1
    if not counts:
        return []
    def kind(name: str) -> str:
        shim = evidence.shim_record(name)
        return "?" if shim is None else shim.kind

    return ["## Workarounds applied", "", "Each applied because its probe saw the upstream condition it patches "
            "(harness/compat): `adapts` to an API or environment (listed), or `hides` an upstream defect (on the "
            "candidate only: failing, above).", "",
            f"| workaround | kind | {sides[0].name} cases | {sides[1].name} cases |", "|---|---|---:|---:|",
            *[f"| {name} | {kind(name)} | {b} | {c} |" for name, (b, c) in sorted(counts.items())], ""]
