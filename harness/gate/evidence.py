"""What a gate really saw: the evidence a verdict may count, and what it must say it could not use.

A gate's exit 0 is earned only when (harness.gate.bump.run_gate asks `exit_code` here):
- both runs finished (`complete: true`) and hold every selected case (`complete_problem`);
- the candidate's own packages import (else every user breaks: exit 1, bump.py checks it);
- every selected case kind has at least one evaluated case: the baseline green on it and the
  candidate with a real result (`evaluated_ids`); a kind with none is named first (exit 2);
- no failing finding (exit 1).
Baseline-red cases (failed or errored on the pins: evidence the gate cannot use) and coverage
holes are counted in the verdict's first lines, never hidden below SAFE. Pure functions over
results.json documents and compare's findings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.core.result import GREEN, HOLES
from harness.gate.classify import case_kind
from harness.gate.compare import Finding

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
    xfailed or an error it is to blame for (not a coverage hole), or a public API it removed."""
    base_green = {r["id"] for r in base.get("results") or [] if r["status"] in GREEN}
    holes = {f.case for f in findings if f.kind == "not-evaluated"}
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
    not_run: list[str]  # not-run (the machine lacks what it needs) or not-applicable on a side, holes apart
    kinds: dict[str, int] = field(default_factory=dict)  # case kind -> evaluated cases
    #: case kinds selected with no evaluated case: the gate says nothing about them
    unevaluated_kinds: list[str] = field(default_factory=list)
    #: workaround name -> cases it applied to on the candidate only (a green case there ran patched)
    new_workarounds: dict[str, int] = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = [f"- **{len(self.evaluated)} of {self.selected} selected case(s) evaluated on both sides** "
               f"(green on the baseline, a real result on the candidate)."]
        if self.unevaluated_kinds:
            out.append(f"- **No evidence for {len(self.unevaluated_kinds)} case kind(s)**: "
                       f"{', '.join(self.unevaluated_kinds)}: no case of theirs was evaluated on both sides.")
        if self.baseline_red:
            out.append(f"- **{len(self.baseline_red)} baseline-red case(s)** (failed or errored on the baseline: "
                       f"evidence the gate could not use): {_ids(self.baseline_red)}.")
        if self.holes:
            out.append(f"- **{len(self.holes)} coverage hole(s)** (the harness cannot drive this release there; "
                       f"see 'Could not evaluate'): {_ids(self.holes)}.")
        for name, n in sorted(self.new_workarounds.items()):
            out.append(f"- **Workaround on the candidate only**: {name}, in {n} case(s): those ran patched (see "
                       "'Workarounds applied'); whether it adapts to an API or hides a defect, read its reason")
        if self.not_run:
            out.append(f"- **{len(self.not_run)} case(s) not run or not applicable on a side** (the reasons are "
                       f"in each side's results): {_ids(self.not_run)}.")
        return out


def _ids(ids: list[str], n: int = 5) -> str:
    return ", ".join(f"`{i}`" for i in ids[:n]) + (f" and {len(ids) - n} more" if len(ids) > n else "")


def coverage(base: dict[str, Any], cand: dict[str, Any], findings: list[Finding]) -> Coverage:
    """What the gate could count, per case and per case kind, over the baseline's selection."""
    ids = list(base.get("selected") or [r["id"] for r in base.get("results") or []])
    evaluated = evaluated_ids(base, cand, findings)
    kinds = {case_kind(i): 0 for i in ids}
    for i in evaluated:
        kinds[case_kind(i)] = kinds.get(case_kind(i), 0) + 1
    return Coverage(
        selected=len(ids), evaluated=evaluated, baseline_red=baseline_red(base),
        holes=sorted({f.case for f in findings if f.kind == "not-evaluated" and not f.case.startswith("golden[")}),
        not_run=sorted({r["id"] for doc in (base, cand) for r in doc.get("results") or [] if r["status"] in HOLES}
                       - {f.case for f in findings if f.kind == "not-evaluated"}),
        kinds=kinds, unevaluated_kinds=sorted(k for k, n in kinds.items() if n == 0),
        new_workarounds={f.case.removeprefix("workaround "): f.candidate for f in findings if f.kind == "new-workaround"},
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
    out = [Finding(f"workaround {name}", "new-workaround", f"applied on the candidate only, in {len(ids)} case(s) "
                   f"({_ids(ids, 3)}): the candidate shows the condition it patches, which the baseline did not"
                   f"{_shim_kind(name)}", None, len(ids)) for name, ids in sorted(new.items())]
    out += [Finding(f"workaround {name}", "workaround-dropped", f"applied on the baseline only, in {len(ids)} case(s) "
                    f"({_ids(ids, 3)}): the candidate no longer shows the condition it patches (fixed or changed upstream)"
                    f"{_shim_kind(name)}", len(ids), None) for name, ids in sorted(dropped.items())]
    return out


def _shim_kind(label: str) -> str:
    """What the record behind a result's shim name says it is (harness.compat.registry): it adapts an
    API or environment, or it hides an upstream defect (and which strict xfail shows it)."""
    from harness.compat import registry

    shim = registry.by_label(label)
    if shim is None:
        return ""
    if shim.kind == "hides":
        return f"; it hides an upstream defect ({shim.upstream}), shown without it by {shim.shown_by}"
    return f"; it adapts to an API or environment ({shim.upstream})"


def exit_code(findings: list[Finding], cover: Coverage | None) -> int:
    """1 on a failing finding; else 2 when the evidence does not cover the selection (no green
    baseline case, or a case kind with nothing evaluated); else 0."""
    if any(f.failing for f in findings):
        return 1
    if cover is None or not cover.evaluated or cover.unevaluated_kinds:
        return 2
    return 0
