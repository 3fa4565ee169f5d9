"""Compare two runs (baseline vs candidate results.json): what a bump broke, fixed, or moved.

The bump gate's verdict: `ckpt-harness compare BASE CAND` exits 1 when the candidate regresses a
case the baseline had green (or as a named xfail), 0 otherwise, 2 when an input cannot be read.
Everything here is a pure function over parsed results.json documents (report.write_json), so a
verdict can be recomputed from stored reports and tested on hand-made ones.

Classes of finding (one case can have several):

| class | when | fails the gate |
|---|---|---|
| regression | passed -> failed/error; or a check that passed on base fails on the candidate (named), in any case | yes |
| defect-changed | a named defect (xfailed on base) shows another form on the candidate: other checks fail, an error of another type or raised in another module, a failing check's difference grew past `diff_factor` x or became NaN/inf, it is no longer met (xfailed -> failed/error), or it "passes" with a judging check not run | yes (counted apart from regressions: nobody has looked at the new form) |
| check-lost | a judging check (not memory-budget/source-unchanged) that passed on base is absent or not run in the candidate's green case: the candidate is no longer judged on it | yes |
| does-not-import | a package the candidate moved from the pins does not import in the candidate (it imports on the baseline): every user breaks | yes |
| new-refusal | base passed, candidate failed/error and its error or failed-check text names an exception (`...Error`, `...Exception`) that is no programming error (`CRASHES`: an AttributeError or KeyError is a crash, a regression): the candidate refused where the baseline loaded (replaces `regression` for that case) | yes |
| api-break | a candidate case errors or is `not-applicable` because the candidate removed or renamed a public API users call (harness.gate.classify.PUBLIC_APIS) | yes |
| hides-workaround | a harness.compat workaround of kind `hides` (an upstream defect stepped around) applied to a case on the candidate and not on the baseline: the candidate's green results ran with a defect patched that the baseline did not have; its `shown_by` strict xfail shows it unpatched (harness.gate.evidence) | yes |
| new-workaround | a harness.compat workaround of kind `adapts` applied on the candidate only: an API shape or environment the harness adapts to (harness.gate.evidence), listed under Workarounds | no (warning) |
| diff-growth | a toleranced check's max abs diff grew past the tolerance's atol, by more than `diff_factor` x, or from 0 to > 0 | yes |
| memory-growth | a phase's per-rank peak delta grew by more than `memory_pct` % AND more than `memory_mib` MiB | yes |
| flaky | (the gate) a failing finding of a case that did not reproduce when the case ran again on both sides (harness.gate.bump.recheck) | no, but the case is unevaluated: it keeps the verdict from SAFE |
| fixed-upstream | base xfailed -> candidate fails with XPASS(strict), every judging check present and passed (none not run, none of base's missing): the defect is fixed, drop the xfail | no |
| not-evaluated | a candidate case errors or is `not-applicable` for the harness's own limits: an API missing in a package unchanged between the sides, an internal API the harness's driver needs, or a Bridge/Core pair that is no release set (harness.gate.classify): a coverage hole, counted per case kind | no (listed) |
| disappeared | a case on base is absent on the candidate (green on base: an unevaluated case, harness.gate.evidence), or an auxiliary check (memory budget, source store) that passed on base is absent or not run: coverage lost | no (warning; the case's absence keeps SAFE off) |
| workaround-dropped | a workaround applied on the baseline only: the candidate no longer shows what it patches | no (listed) |
| appeared | a case only on the candidate | no |
| fixed | base failed/error -> candidate passed | no |
| not-run | a case ran on base and is `not-run` on the candidate (its reason: the machine lacked CUDA, TE, ...), or the reverse, or `not-applicable` on the base (the base release lacks an API the case needs): coverage moved with the machine or the release, not the code | no (listed) |
| time-growth | phases.total grew > 1.5x and > 5 s | no |
| architecture-removed / -added | an HF architecture the baseline's Megatron-Bridge registers and the candidate's does not / the reverse (harness.gate.archs, the gate only) | removed: yes; added: no (listed) |

A disappeared case is a warning here, but a case green on base with no real result on the candidate
(absent, not-run, not-applicable, a hole) keeps the verdict from SAFE (harness.gate.evidence.decide,
which `compare` and `gate` both call) unless the user accepts it by name (`--accept-unevaluated`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness.core.frames import exception_of, frames, raising_frame
from harness.core.parity import Tolerance
from harness.core.result import (
    api_missing_line,
    shows_diff,  # the one predicate for "this check's diff is toleranced"
)
from harness.gate import classify
from harness.judge.status import KNOWN_FORM, judges

FAILING = ("does-not-import", "architecture-removed", "regression", "new-refusal", "api-break", "hides-workaround",
           "defect-changed", "check-lost", "diff-growth", "memory-growth")
WARNING = ("disappeared", "new-workaround", "layout-change")
ORDER = (*FAILING, "flaky", "fixed-upstream", *WARNING, "not-evaluated", "not-run", "workaround-dropped", "architecture-added",
         "appeared", "fixed", "time-growth")
OK = ("passed", "xfailed")
BAD = ("failed", "error")
MiB = 2**20
TIME_FACTOR, TIME_MIN_S = 1.5, 5.0
_EXCEPTION = re.compile(r"\b([A-Z][A-Za-z0-9_]*(?:Exception|Error))\b")
#: Programming errors: raised where code met what it did not expect, never a loader's clear "no".
#: A candidate raising one where the baseline loaded is a regression, not a refusal.
CRASHES = frozenset({"AttributeError", "TypeError", "NameError", "KeyError", "IndexError", "ImportError",
                     "ModuleNotFoundError", "AssertionError", "UnboundLocalError", "ZeroDivisionError", "RecursionError"})


class CompareInputError(Exception):
    """An input is not a readable results.json; the message names the file."""


@dataclass(frozen=True)
class Thresholds:
    memory_pct: float = 10.0
    memory_mib: float = 32.0
    diff_factor: float = 10.0


@dataclass(frozen=True)
class Finding:
    case: str
    kind: str  # one of ORDER; "class" in compare.json
    detail: str
    base: Any = None
    candidate: Any = None

    @property
    def failing(self) -> bool:
        return self.kind in FAILING

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["class"] = d.pop("kind")
        d["failing"] = self.failing
        return {k: d[k] for k in ("case", "class", "failing", "detail", "base", "candidate")}


def load(path: Path) -> dict[str, Any]:
    """A results.json (or a report dir holding one), checked enough that compare cannot crash on it."""
    file = path / "results.json" if path.is_dir() else path
    try:
        doc = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CompareInputError(f"{file}: not a readable results.json ({exc})") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
        raise CompareInputError(f"{file}: not a results.json (no 'results' list)")
    seen: set[str] = set()
    for i, r in enumerate(doc["results"]):
        if not isinstance(r, dict) or not isinstance(r.get("id"), str) or not isinstance(r.get("status"), str):
            raise CompareInputError(f"{file}: results[{i}] has no string 'id' and 'status'")
        if r["id"] in seen:
            raise CompareInputError(f"{file}: case {r['id']!r} appears twice")
        seen.add(r["id"])
    return doc


def _checks(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in r.get("checks") or [] if isinstance(c, dict) and "name" in c}


def _failure_text(r: dict[str, Any]) -> str:
    parts = [r.get("error") or ""] + [n for n in r.get("notes") or [] if str(n).startswith("failed, but")]
    parts += [c.get("detail") or "" for c in _checks(r).values() if c.get("status") == "failed"]
    return "\n".join(parts)


def _raised(r: dict[str, Any]) -> tuple[str, str] | None:
    """(exception, its line) a failed case reports, if any: the last one named, as a traceback ends
    (a world's "(then rank N failed: ...)" lines are its peers' follow-ons, never the cause)."""
    for line in reversed(_failure_text(r).splitlines()):
        if line.startswith("(then rank "):
            continue
        if names := _EXCEPTION.findall(line):
            return names[-1], _first_line(line)
    return None


def _first_line(text: str | None, limit: int = 160) -> str:
    line = next((ln.strip() for ln in (text or "").splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _status_findings(cid: str, b: dict[str, Any], c: dict[str, Any]) -> list[Finding]:
    bs, cs = b["status"], c["status"]
    if "not-run" in (bs, cs) and bs != cs:
        side, reason = ("candidate", c.get("not_run_reason")) if cs == "not-run" else ("base", b.get("not_run_reason"))
        return [Finding(cid, "not-run", f"{bs} -> {cs}: not run on the {side} ({reason or 'no reason recorded'}); "
                        "neither a regression nor a pass", bs, cs)]
    if cs == "not-applicable" and bs != cs:  # the candidate lacks an API the case needs: classify says whose limit
        return [Finding(cid, "regression", f"{bs} -> {cs}: {_first_line(c.get('not_applicable_reason'), 200)}", bs, cs)]
    if bs == "not-applicable" and bs != cs:
        return [Finding(cid, "not-run", f"{bs} -> {cs}: not applicable to the base ({_first_line(b.get('not_applicable_reason'))}); "
                        "neither a regression nor a pass", bs, cs)]
    bc, cc = _checks(b), _checks(c)
    newly_failed = [n for n, ch in cc.items() if ch.get("status") == "failed" and bc.get(n, {}).get("status") == "passed"]
    named = f" (checks that passed on base now fail: {', '.join(newly_failed)})" if newly_failed else ""
    if bs == "xfailed" and cs == "failed" and "XPASS(strict)" in (c.get("error") or "") and not newly_failed:
        if unproven := _unproven_fix(b, c):
            return [Finding(cid, "defect-changed", f"the known defect no longer fails, but the fix is not shown: {unproven} "
                            f"(was: {b.get('xfail_reason') or 'xfail'})", bs, cs)]
        return [Finding(cid, "fixed-upstream", "known defect no longer reproduces: drop the xfail from the matrix "
                        f"(was: {b.get('xfail_reason') or 'xfail'}); not a regression", bs, cs)]
    api = api_missing_line(c.get("error"))
    if bs in OK and cs in BAD and api:  # not a refusal: the candidate removed or moved an API the stack calls
        return [Finding(cid, "regression", f"{bs} -> {cs}{named}: {_first_line(api, 200)}", bs, cs)]
    at = f" (raised at {frame})" if cs == "error" and (frame := raising_frame(c.get("error") or "")) else ""
    if bs == "passed" and cs in BAD and (raised := _raised(c)) and raised[0] not in CRASHES:
        return [Finding(cid, "new-refusal", f"candidate raises {raised[0]} where base passed{named}: {raised[1]}{at}", bs, cs)]
    if bs == "xfailed" and cs in BAD and not newly_failed:
        # the named defect is no longer met as named: another form of it, or something else; failing either way
        why = next((str(n) for n in c.get("notes") or [] if str(n).startswith("failed, but")), "")
        raised = _raised(c)
        text = why or (raised[1] if raised else _first_line(_failure_text(c)))
        return [Finding(cid, "defect-changed", f"xfailed -> {cs}: the named defect fails another way{at}: {text} "
                        f"(was: {b.get('xfail_reason') or 'xfail'})", bs, cs)]
    if (bs in OK and cs in BAD) or newly_failed:
        raised = _raised(c) if cs in BAD else None
        why = f"{raised[1]}" if raised else _first_line(_failure_text(c)) if cs in BAD else ""
        return [Finding(cid, "regression", f"{bs} -> {cs}{named}" + (f": {why}" if why else "") + at, bs, cs)]
    if bs in BAD and cs == "passed":
        return [Finding(cid, "fixed", f"{bs} -> passed", bs, cs)]
    return []


def _unproven_fix(b: dict[str, Any], c: dict[str, Any]) -> str:
    """Why an XPASS does not show the defect fixed ("" when it does): every judging check of the
    candidate passed, and every judging check the baseline ran is there and passed (a check the
    defect failed on base must now compare something and pass, not vanish or be not-run)."""
    cc = {n: ch for n, ch in _checks(c).items() if judges(n)}
    if not cc:
        return "the candidate recorded no judging check"
    not_passed = sorted(n for n, ch in cc.items() if ch.get("status") != "passed")
    missing = sorted(n for n, ch in _checks(b).items() if judges(n) and ch.get("status") in ("passed", "failed") and n not in cc)
    parts = ([f"check(s) {', '.join(not_passed)} not run"] if not_passed else []) + (
        [f"check(s) {', '.join(missing)} the baseline ran are absent"] if missing else [])
    return "; ".join(parts)


def _error_signature(r: dict[str, Any]) -> tuple[str, str] | None:
    """(exception type, the module of the innermost upstream frame that raised it) of an errored
    case: a known defect that raises is the same defect only as the same error from the same place."""
    if not r.get("error"):
        return None
    exc_type, _ = exception_of(r["error"])
    frames_ = [f for f in frames(r["error"]) if not f.own and not f.path.startswith("<")]
    return (exc_type or "?", frames_[-1].module if frames_ else "?")


def _defect_findings(cid: str, b: dict[str, Any], c: dict[str, Any], t: Thresholds) -> list[Finding]:
    """A named defect on both sides must be the same defect, no worse: the same failed checks (or
    the same error type from the same upstream module), and no failing check's difference grown past
    `diff_factor` x or turned NaN/inf. Anything else is defect-changed (failing)."""
    if not b["status"] == c["status"] == "xfailed":
        return []
    # a form declared for the candidate's release (known_on) has been looked at: only getting worse counts
    declared = any(str(n).startswith(KNOWN_FORM) for n in c.get("notes") or [])
    bc, cc = _checks(b), _checks(c)
    bf = sorted(n for n, ch in bc.items() if ch.get("status") == "failed")
    # a check that passed on base and fails now is a regression already (_status_findings)
    cf = sorted(n for n, ch in cc.items() if ch.get("status") == "failed" and bc.get(n, {}).get("status") != "passed")
    out = []
    if bf != cf and not declared:
        out.append(Finding(cid, "defect-changed", f"the named defect fails other checks: {', '.join(bf) or 'none'} on base, "
                           f"{', '.join(cf) or 'none'} on the candidate", bf, cf))
    be, ce = _error_signature(b), _error_signature(c)
    if be != ce and not declared:
        show = lambda e: f"{e[0]} raised in {e[1]}" if e else "no error"  # noqa: E731
        out.append(Finding(cid, "defect-changed", f"the named defect raises differently: {show(be)} on base, "
                           f"{show(ce)} on the candidate", be, ce))
    for name in sorted(set(bf) & set(cf)):
        bd, cd = bc[name].get("max_abs_diff"), cc[name].get("max_abs_diff")
        if not isinstance(cd, (int, float)):
            continue
        bd = bd if isinstance(bd, (int, float)) else None
        if why := _growth(bd, cd, t.diff_factor):
            out.append(Finding(cid, "defect-changed", f"failing check {name}: max abs diff {'-' if bd is None else f'{bd:.3g}'} "
                               f"-> {cd:.3g}, {why}: the known defect got worse", bd, cd))
    return out


def _growth(before: float | None, after: float, factor: float) -> str:
    """Why a difference got worse ("" when it did not): it became NaN/inf, grew past `factor` x, or
    was 0 on base. One rule for toleranced checks and for a known defect's failing ones."""
    if not math.isfinite(after) and (before is None or math.isfinite(before)):
        return f"became {after}"
    if before is not None and math.isfinite(before) and before > 0 and after > factor * before:
        return f"grew {after / before:.1f}x (> {factor:g}x)"
    if before == 0 and after > 0:
        return "was 0 on base"
    return ""


def _lost_checks(cid: str, b: dict[str, Any], c: dict[str, Any]) -> list[Finding]:
    """Checks a green candidate case no longer runs (a failed or errored case is a regression
    already): a judging one is failing (the candidate is no longer judged on it), an auxiliary
    one (memory budget, source store) a warning."""
    if c["status"] not in OK:
        return []
    cc = _checks(c)
    lost = [n for n, ch in _checks(b).items() if ch.get("status") == "passed" and cc.get(n, {}).get("status") in (None, "not-run")]
    return [Finding(cid, "check-lost" if judges(n) else "disappeared", f"check {n} passed on base, "
                    f"{'absent' if n not in cc else 'not run'} on the candidate"
                    + (f" ({cc[n].get('detail')})" if n in cc and cc[n].get("detail") else "") + ": coverage lost", "passed",
                    cc.get(n, {}).get("status")) for n in lost]


def _diff_findings(cid: str, b: dict[str, Any], c: dict[str, Any], t: Thresholds) -> list[Finding]:
    """Toleranced checks only: a bitwise check with any diff is already a failed check."""
    out = []
    bc = _checks(b)
    for name, ch in _checks(c).items():
        d, tol = ch.get("max_abs_diff"), Tolerance.from_json(ch.get("tolerance"))  # old string form read too
        if not isinstance(d, (int, float)) or not shows_diff(name, tol) or tol.kind in ("bitwise", "exact"):
            continue
        bd = bc.get(name, {}).get("max_abs_diff")
        bd = bd if isinstance(bd, (int, float)) else None
        if bd is not None and d <= bd:
            continue  # not growth, whatever its size (an over-atol diff on base is base's problem)
        atol = tol.atol if tol.toleranced else None
        if why := f"exceeds atol={atol:g}" if atol is not None and d > atol else _growth(bd, d, t.diff_factor):
            out.append(Finding(cid, "diff-growth", f"check {name} ({tol.label.split(' (')[0]}): max abs diff "
                               f"{'-' if bd is None else f'{bd:.1e}'} -> {d:.1e}, {why}", bd, d))
    return out


def _memory_findings(cid: str, b: dict[str, Any], c: dict[str, Any], t: Thresholds) -> list[Finding]:
    out = []
    bm = b.get("memory") or {}
    for phase, ranks in sorted((c.get("memory") or {}).items()):
        for rank, m in sorted((ranks or {}).items()):
            bv = ((bm.get(phase) or {}).get(rank) or {}).get("peak_delta")
            cv = (m or {}).get("peak_delta")
            if not isinstance(bv, (int, float)) or not isinstance(cv, (int, float)):
                continue
            grew = cv - bv
            if grew > t.memory_mib * MiB and grew > abs(bv) * t.memory_pct / 100:
                pct = f"+{100 * grew / bv:.0f}%" if bv > 0 else "from <= 0"
                out.append(Finding(cid, "memory-growth", f"{phase}@rank{rank} peak RSS delta {bv / MiB:.1f} -> "
                                   f"{cv / MiB:.1f} MiB (+{grew / MiB:.1f} MiB, {pct})", bv, cv))
    return out


def _time_findings(cid: str, b: dict[str, Any], c: dict[str, Any]) -> list[Finding]:
    bt, ct = (b.get("phases") or {}).get("total"), (c.get("phases") or {}).get("total")
    if isinstance(bt, (int, float)) and isinstance(ct, (int, float)) and ct > TIME_FACTOR * bt and ct - bt > TIME_MIN_S:
        return [Finding(cid, "time-growth", f"total {bt:.1f} s -> {ct:.1f} s (reported, never failing)", bt, ct)]
    return []


def compare(base: dict[str, Any], cand: dict[str, Any], thresholds: Thresholds = Thresholds()) -> list[Finding]:
    """Every finding, in ORDER (failing classes first), then by case id."""
    b = {r["id"]: r for r in base["results"]}
    c = {r["id"]: r for r in cand["results"]}
    out: list[Finding] = []
    for cid in sorted(b.keys() | c.keys()):
        if cid not in c:
            out.append(Finding(cid, "disappeared", f"case ran on base ({b[cid]['status']}) but not on the candidate: "
                               "coverage lost (renamed? check the matrix)", b[cid]["status"], None))
        elif cid not in b:
            out.append(Finding(cid, "appeared", f"new case on the candidate: {c[cid]['status']}", None, c[cid]["status"]))
        else:
            bb, cc = b[cid], c[cid]
            out += _status_findings(cid, bb, cc) + _defect_findings(cid, bb, cc, thresholds) + _lost_checks(cid, bb, cc)
            out += _diff_findings(cid, bb, cc, thresholds) + _memory_findings(cid, bb, cc, thresholds)
            out += _time_findings(cid, bb, cc)
    return sorted(classify.reclassify(out, base, cand), key=lambda f: (ORDER.index(f.kind), f.case))


def exit_code(findings: list[Finding]) -> int:
    """1 on a failing finding, else 0: the findings' part of a verdict (harness.gate.evidence.decide
    adds what could not be evaluated, exit 2)."""
    return 1 if any(f.failing for f in findings) else 0


def verdict(findings: list[Finding], code: int | None = None) -> str:
    """The verdict's last line; `code` the decided exit code (evidence.decide), else the findings'."""
    code = exit_code(findings) if code is None else code
    failing = [f for f in findings if f.failing]
    fixed = sum(f.kind == "fixed-upstream" for f in findings)
    warn = sum(f.kind in WARNING for f in findings)
    not_run = sum(f.kind == "not-run" for f in findings)
    tail = "".join([f", {fixed} fixed upstream defect(s) (drop their xfail)" if fixed else "",
                    f", {warn} warning(s)" if warn else "",
                    f", {not_run} case(s) run on one side only (not-run, listed)" if not_run else ""])
    if failing:
        cases = len({f.case for f in failing})
        return f"**NOT SAFE**: {len(failing)} failing finding(s) in {cases} case(s){tail}."
    if code == 2:
        return f"**NOT EVALUATED**: no failing finding, but the evidence does not cover the selection (see the first lines){tail}."
    return f"**SAFE**: no regression{tail}."


def _versions_table(base: dict[str, Any], cand: dict[str, Any]) -> list[str]:
    bv, cv = base.get("versions") or {}, cand.get("versions") or {}
    rows = ["| package | base | candidate |", "|---|---|---|"]
    for name in list(dict.fromkeys([*bv, *cv])):
        x, y = bv.get(name), cv.get(name)
        mark = " **(changed)**" if x != y else ""
        rows.append(f"| {name} | {x or '-'} | {y or '-'}{mark} |")
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(base: dict[str, Any], cand: dict[str, Any], findings: list[Finding], names: tuple[str, str] = ("base", "candidate"),
             head: list[str] | tuple[str, ...] = (), code: int | None = None) -> str:
    """The verdict for people: `head` (the ranked first lines, evidence.Coverage.lines), versions
    compared, failing findings first, fixed upstream defects, the rest."""
    lines = [f"## ckpt-harness compare: `{names[0]}` vs `{names[1]}`", "", *head, *([""] if head else []),
             *_versions_table(base, cand), ""]
    lines.append(f"{len(base['results'])} base cases, {len(cand['results'])} candidate cases.")
    sections = (
        ("Failing findings", [f for f in findings if f.failing]),
        ("Fixed upstream defects (drop the xfail; not regressions)", [f for f in findings if f.kind == "fixed-upstream"]),
        ("Other findings (not failing)", [f for f in findings if not f.failing and f.kind != "fixed-upstream"]),
    )
    for title, items in sections:
        if items:
            lines += ["", f"### {title}", "", "| case | class | detail |", "|---|---|---|"]
            lines += [f"| `{f.case}` | {f.kind} | {_cell(f.detail)} |" for f in items]
    lines += ["", verdict(findings, code)]
    return "\n".join(lines)


def to_json(base_path: str, cand_path: str, base: dict[str, Any], cand: dict[str, Any], findings: list[Finding],
            t: Thresholds, code: int, coverage: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "base": {"path": base_path, "versions": base.get("versions"), "matrix": base.get("matrix")},
        "candidate": {"path": cand_path, "versions": cand.get("versions"), "matrix": cand.get("matrix")},
        "thresholds": asdict(t),
        "exit_code": code,
        "verdict": verdict(findings, code),
        "coverage": coverage,
        "findings": [f.to_dict() for f in findings],
    }
