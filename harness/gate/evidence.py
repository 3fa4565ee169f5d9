"""What a gate really saw: the evidence a verdict may count, and what it must say it could not use.

A verdict's exit 0 is earned only when (`decide`, which `gate` and `compare` both call):
- both runs finished (`complete: true`) and hold every selected case (`complete_problem`, the gate);
- the candidate's own packages import (else every user breaks: exit 1, bump.py checks it);
- no failing finding (exit 1);
- every case green on the baseline has a real result on the candidate (`evaluated_ids`): one that
  is absent, not-run, not-applicable or a coverage hole there is *unevaluated* and keeps the verdict
  from SAFE (exit 2), named first with its cause, unless the user accepts it by pattern
  (`--accept-unevaluated`, recorded in the verdict);
- every selected case kind has at least one evaluated case (exit 2).
Baseline-red cases (failed or errored on the pins: evidence the gate cannot use) are counted in the
verdict's first lines, never hidden below SAFE. Pure functions over results.json documents and
compare's findings.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from harness.core.result import GREEN, HOLES
from harness.gate.classify import case_kind
from harness.gate import compare
from harness.gate.compare import FAILING, WARNING, Finding

#: how the first screen names each failing class, in its order (compare.FAILING)
CLASS_TITLES = {
    "does-not-import": "packages that do not import", "architecture-removed": "architectures removed",
    "regression": "regressions (green -> red)", "new-refusal": "new refusals (green -> a named refusal)",
    "api-break": "API breaks", "hides-workaround": "hides-workarounds needed", "defect-changed": "defects changed",
    "check-lost": "judging checks lost", "diff-growth": "difference growth", "memory-growth": "memory growth",
}

REAL = ("passed", "failed", "xfailed", "error")


def complete_problem(doc: dict[str, Any], side: str) -> str | None:
    """Why a side's results.json is not a whole run (None when it is): a run that died part-way
    (`complete` false), or a selected case missing from its results. Names the cases it died in."""
    selected = doc.get("selected")
    ids = [r["id"] for r in doc.get("results") or []]
    missing = [c for c in selected or [] if c not in ids]
    if doc.get("complete") is not True or missing:
        total = len(selected) if selected is not None else "?"
        where = (f"; it died in or before {missing[0]}" + (f" (missing too: {', '.join(missing[1:4])}"
                 f"{' ...' if len(missing) > 4 else ''})" if len(missing) > 1 else "")) if missing else ""
        return f"the {side} run did not finish: {len(ids)} of {total} selected case(s) have a result{where}"
    if selected is None:
        return f"the {side} results name no selection (`selected`): the gate cannot tell a whole run from part of one"
    return None


def baseline_red(base: dict[str, Any]) -> list[str]:
    """Baseline cases that failed or errored on the pins: no evidence about the candidate either way."""
    return [r["id"] for r in base.get("results") or [] if r["status"] in ("failed", "error")]


def evaluated_ids(base: dict[str, Any], cand: dict[str, Any], findings: list[Finding]) -> list[str]:
    """Cases both sides really evaluated: green on the baseline, and on the candidate passed, failed,
    xfailed or an error it is to blame for (not a coverage hole, not a result its rerun did not
    reproduce), or a public API it removed."""
    base_green = {r["id"] for r in base.get("results") or [] if r["status"] in GREEN}
    holes = {f.case for f in findings if f.kind in ("not-evaluated", "flaky")}
    breaks = {f.case for f in findings if f.kind == "api-break"}
    return [r["id"] for r in cand.get("results") or [] if r["id"] in base_green and r["id"] not in holes
            and (r["status"] in REAL or r["id"] in breaks)]


@dataclass
class Coverage:
    """The verdict's first lines: what was selected, what counted, and what did not and why."""

    selected: int
    evaluated: list[str]
    baseline_red: list[str]
    holes: list[str]  # the candidate's case is a harness limit (not-evaluated)
    not_run: list[str]  # not-run (the machine lacks what it needs) or not-applicable on a side, holes and unevaluated apart
    kinds: dict[str, int] = field(default_factory=dict)  # case kind -> evaluated cases
    #: case kinds selected with no evaluated case: the gate says nothing about them
    unevaluated_kinds: list[str] = field(default_factory=list)
    #: case green on the baseline -> why the candidate gave no real result (absent, not-run, a hole):
    #: each keeps the verdict from SAFE unless `accepted`
    unevaluated: dict[str, str] = field(default_factory=dict)
    #: unevaluated case -> the --accept-unevaluated pattern that accepted it
    accepted: dict[str, str] = field(default_factory=dict)
    #: failing class -> findings of it, in compare.FAILING's order
    failing: dict[str, int] = field(default_factory=dict)
    #: warning class -> findings of it
    warnings: dict[str, int] = field(default_factory=dict)

    @property
    def blocking(self) -> dict[str, str]:
        """The unevaluated cases nobody accepted: these keep the verdict from SAFE."""
        return {c: why for c, why in self.unevaluated.items() if c not in self.accepted}

    def lines(self) -> list[str]:
        """Ranked: failing findings by class, then what could not be evaluated, then warnings."""
        out = [f"- **{len(self.evaluated)} of {self.selected} selected case(s) evaluated on both sides** "
               f"(green on the baseline, a real result on the candidate)."]
        if self.failing:
            out.append(f"- **{sum(self.failing.values())} failing finding(s)**: "
                       + ", ".join(f"{CLASS_TITLES.get(k, k)} {n}" for k, n in self.failing.items()) + ".")
        if blocking := self.blocking:
            by_cause: dict[str, list[str]] = {}
            for c, why in blocking.items():
                by_cause.setdefault(why, []).append(c)
            out.append(f"- **{len(blocking)} case(s) green on the baseline with no real result on the candidate** "
                       "(they keep the verdict from SAFE; accept named holes with `--accept-unevaluated PATTERN`):")
            out += [f"  - {len(ids)}: {why}: {_ids(ids)}" for why, ids in sorted(by_cause.items(), key=lambda x: -len(x[1]))]
        if self.unevaluated_kinds:
            out.append(f"- **No evidence for {len(self.unevaluated_kinds)} case kind(s)**: "
                       f"{', '.join(self.unevaluated_kinds)}: no case of theirs was evaluated on both sides.")
        if self.accepted:
            pats: dict[str, list[str]] = {}
            for c, pat in self.accepted.items():
                pats.setdefault(pat, []).append(c)
            out += [f"- **{len(ids)} unevaluated case(s) accepted** by `--accept-unevaluated {pat!r}` (no evidence, "
                    f"by the user's choice): {_ids(ids)}." for pat, ids in pats.items()]
        if self.baseline_red:
            out.append(f"- **{len(self.baseline_red)} baseline-red case(s)** (failed or errored on the baseline: "
                       f"evidence the gate could not use): {_ids(self.baseline_red)}.")
        if self.holes:
            out.append(f"- **{len(self.holes)} coverage hole(s)** (the harness cannot drive this release there; "
                       f"see 'Could not evaluate'): {_ids(self.holes)}.")
        if self.not_run:
            out.append(f"- **{len(self.not_run)} case(s) not run or not applicable on a side** (the reasons are "
                       f"in each side's results): {_ids(self.not_run)}.")
        if self.warnings:
            out.append(f"- {sum(self.warnings.values())} warning(s): "
                       + ", ".join(f"{k} {n}" for k, n in self.warnings.items()) + " (listed below).")
        return out


def _ids(ids: list[str], n: int = 5) -> str:
    return ", ".join(f"`{i}`" for i in ids[:n]) + (f" and {len(ids) - n} more" if len(ids) > n else "")


def _why_unevaluated(cid: str, c: dict[str, Any] | None, holes: dict[str, str]) -> str:
    """The cause of a baseline-green case's missing result on the candidate, in a few words."""
    if c is None:
        return "absent from the candidate's run"
    if cid in holes:
        return holes[cid]
    reason = c.get("not_run_reason") or c.get("not_applicable_reason") or ""
    return f"{c['status']} on the candidate" + (f" ({reason.splitlines()[0][:160]})" if reason else "")


def accepted_by(ids: Iterable[str], patterns: Iterable[str]) -> dict[str, str]:
    """case id -> the first pattern (an fnmatch glob over the id, or a substring of it) that accepts it."""
    pats = list(patterns)
    out = {}
    for cid in ids:
        for pat in pats:
            if pat and (pat in cid or fnmatch.fnmatchcase(cid, pat)):
                out[cid] = pat
                break
    return out


def coverage(base: dict[str, Any], cand: dict[str, Any], findings: list[Finding],
             accept: Iterable[str] = ()) -> Coverage:
    """What the verdict could count, per case and per case kind, over the baseline's selection."""
    ids = list(base.get("selected") or [r["id"] for r in base.get("results") or []])
    evaluated = evaluated_ids(base, cand, findings)
    kinds = {case_kind(i): 0 for i in ids}
    for i in evaluated:
        kinds[case_kind(i)] = kinds.get(case_kind(i), 0) + 1
    hole_detail = {f.case: f"a coverage hole of the harness ({f.detail.split(': ', 1)[-1][:160]})"
                   for f in findings if f.kind == "not-evaluated"}
    hole_detail.update({f.case: "flaky: its failing finding did not reproduce on a rerun" for f in findings if f.kind == "flaky"})
    cand_cases = {r["id"]: r for r in cand.get("results") or []}
    done = set(evaluated)
    unevaluated = {r["id"]: _why_unevaluated(r["id"], cand_cases.get(r["id"]), hole_detail)
                   for r in base.get("results") or [] if r["status"] in GREEN and r["id"] not in done}
    accepted = accepted_by(unevaluated, accept)
    # a kind with nothing evaluated says nothing, unless every case of it was accepted by name
    silent = sorted(k for k, n in kinds.items() if n == 0 and not all(i in accepted for i in ids if case_kind(i) == k))
    failing: dict[str, int] = {k: 0 for k in FAILING}
    warnings: dict[str, int] = {}
    for f in findings:
        if f.failing:
            failing[f.kind] += 1
        elif f.kind in WARNING:
            warnings[f.kind] = warnings.get(f.kind, 0) + 1
    return Coverage(
        selected=len(ids), evaluated=evaluated, baseline_red=baseline_red(base),
        holes=sorted({f.case for f in findings if f.kind == "not-evaluated" and not f.case.startswith("golden[")}),
        not_run=sorted({r["id"] for doc in (base, cand) for r in doc.get("results") or [] if r["status"] in HOLES}
                       - {f.case for f in findings if f.kind == "not-evaluated"} - set(unevaluated)),
        kinds=kinds, unevaluated_kinds=silent, unevaluated=unevaluated, accepted=accepted,
        failing={k: n for k, n in failing.items() if n}, warnings=warnings,
    )


def shim_findings(base: dict[str, Any], cand: dict[str, Any]) -> list[Finding]:
    """One finding per workaround (harness.compat shim, applied because its probe saw the upstream
    condition) that applied to some cases on one side and not the other, naming how many and which.
    Applied on the candidate only: those green results ran patched (an API shape the harness adapts
    to, or a defect the patch hides): a warning counted in the first lines. Applied on the baseline
    only: the candidate no longer shows the condition (fixed or changed upstream; listed)."""
    b = {r["id"]: set(r.get("compat_shims") or []) for r in base.get("results") or []}
    new: dict[str, list[str]] = {}
    dropped: dict[str, list[str]] = {}
    for r in cand.get("results") or []:
        if r["id"] in b:
            c = set(r.get("compat_shims") or [])
            for name in c - b[r["id"]]:
                new.setdefault(name, []).append(r["id"])
            for name in b[r["id"]] - c:
                dropped.setdefault(name, []).append(r["id"])
    out = [Finding(f"workaround {name}", "hides-workaround" if _hides(name) else "new-workaround",
                   f"applied on the candidate only, in {len(ids)} case(s) ({_ids(ids, 3)}): the candidate shows the "
                   f"condition it patches, which the baseline did not{_shim_kind(name)}", None, len(ids))
           for name, ids in sorted(new.items())]
    out += [Finding(f"workaround {name}", "workaround-dropped", f"applied on the baseline only, in {len(ids)} case(s) "
                    f"({_ids(ids, 3)}): the candidate no longer shows the condition it patches (fixed or changed upstream)"
                    f"{_shim_kind(name)}", len(ids), None) for name, ids in sorted(dropped.items())]
    return out


def shim_record(label: str) -> Any:
    """The harness.compat record behind a result's shim name (None where none has that label)."""
    from harness.compat import registry

    return registry.by_label(label)


def _hides(label: str) -> bool:
    """Whether the record behind a result's shim name steps around an upstream defect: a candidate
    that needs one has a defect the baseline did not, and its green results ran with it patched."""
    shim = shim_record(label)
    return shim is not None and shim.kind == "hides"


def _shim_kind(label: str) -> str:
    """What the record behind a result's shim name says it is (harness.compat.registry): it adapts an
    API or environment, or it hides an upstream defect (and which strict xfail shows it)."""
    shim = shim_record(label)
    if shim is None:
        return ""
    if shim.kind == "hides":
        return f"; it hides an upstream defect ({shim.upstream}), shown without it by {shim.shown_by}"
    return f"; it adapts to an API or environment ({shim.upstream})"


def exit_code(findings: list[Finding], cover: Coverage | None) -> int:
    """1 on a failing finding; else 2 when the evidence does not cover the selection (no green
    baseline case, a baseline-green case with no real result on the candidate that nobody
    accepted, or a case kind with nothing evaluated); else 0."""
    if any(f.failing for f in findings):
        return 1
    if cover is None or not cover.evaluated or cover.blocking or cover.unevaluated_kinds:
        return 2
    return 0


def decide(base: dict[str, Any], cand: dict[str, Any], findings: list[Finding],
           accept: Iterable[str] = ()) -> tuple[int, Coverage]:
    """(exit code, coverage): the one decision `gate` and `compare` both make over their findings."""
    cover = coverage(base, cand, findings, accept)
    return exit_code(findings, cover), cover


def run_compare(base_path: Path, cand_path: Path, out: Path | None = None,
                thresholds: compare.Thresholds = compare.Thresholds(), accept: Iterable[str] = ()) -> tuple[int, str]:
    """`ckpt-harness compare`: load, compare, decide as the gate decides (`decide`), write
    DIR/compare.{json,md} when asked: (exit code, Markdown). Raises compare.CompareInputError."""
    base, cand = compare.load(base_path), compare.load(cand_path)
    findings = sorted(compare.compare(base, cand, thresholds) + shim_findings(base, cand),
                      key=lambda f: (compare.ORDER.index(f.kind), f.case))
    code, cover = decide(base, cand, findings, accept)
    md = compare.markdown(base, cand, findings, (str(base_path), str(cand_path)), cover.lines(), code)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        doc = compare.to_json(str(base_path), str(cand_path), base, cand, findings, thresholds, code, asdict(cover))
        (out / "compare.json").write_text(json.dumps(doc, indent=2, default=str))
        (out / "compare.md").write_text(md + "\n")
    return code, md


def no_evidence(cover: Coverage) -> str:
    """Why exit 2 when nothing failed: what the gate could not evaluate."""
    if cover.evaluated and (blocking := cover.blocking):
        return (f"{len(blocking)} case(s) green on the baseline have no real result on the candidate (listed first): the "
                "gate saw nothing of them on the candidate, so it cannot call it safe; accept named holes with "
                "--accept-unevaluated PATTERN")
    if not cover.evaluated and cover.baseline_red and len(cover.baseline_red) == cover.selected:
        return (f"the baseline is red on every selected case ({cover.selected} failed or errored on the baseline): "
                "there is nothing to compare the candidate against; fix the baseline or the selection")
    if not cover.evaluated:
        return ("nothing in the candidate could be evaluated on both sides (see the counts above and 'Could not "
                "evaluate'), so this gate says nothing about the candidate")
    return (f"no case of {', '.join(cover.unevaluated_kinds)} was evaluated on both sides: the gate says nothing "
            "about that kind, so it cannot call the candidate safe")
