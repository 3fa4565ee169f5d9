"""A mutation campaign written up: DIR/mutate.json, DIR/mutate.md, DIR/mutate.png.

The kill rate counts killed (timeouts included) over covered mutants, equivalent ones left out; the
coverage rate counts covered over sampled mutants. Both overall, per module and per function. Every
survivor is listed with its diff, its file:line and the cases that ran it; the mutants no case ran
come next (the selection's blind spots), then the equivalent ones.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

OUTCOMES = ("killed", "killed-timeout", "survived", "unconfirmed", "equivalent", "not-covered")


def rates(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Counts, kill rate (killed / covered, equivalent left out) and coverage rate (covered / sampled)."""
    records = list(records)
    n = {o: sum(r["outcome"] == o for r in records) for o in OUTCOMES}
    covered = n["killed"] + n["killed-timeout"] + n["survived"] + n["unconfirmed"]
    sampled = len(records) - n["equivalent"]
    beyond = sum(r["outcome"] == "not-covered" and bool(r.get("reach")) for r in records)  # GPU-only code (mutate_triage)
    dead = sum(r["outcome"] == "not-covered" and bool(r.get("uncalled")) and not r.get("reach") for r in records)  # mutate_callers
    return {"sampled": len(records), **n, "covered": covered,
            "kill_rate": round((n["killed"] + n["killed-timeout"]) / covered, 4) if covered else None,
            "coverage_rate": round(covered / sampled, 4) if sampled else None,
            "not-covered-out-of-reach": beyond,
            "cpu_coverage_rate": round(covered / (sampled - beyond), 4) if sampled - beyond else None,
            "not-covered-uncalled": dead,
            "reachable_coverage_rate": round(covered / (sampled - beyond - dead), 4) if sampled - beyond - dead else None}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def confirmed(records: list[dict[str, Any]], stable: dict[str, bool]) -> list[dict[str, Any]]:
    """The records with every kill whose killing cases all change outcome without the mutant too
    (mutate.confirm) turned `unconfirmed`: covered, never counted as killed."""
    out = []
    for r in records:
        cases = [f["case"] for f in r.get("findings", []) if f.get("case")]
        if r["outcome"] == "killed" and cases and not any(stable.get(c, False) for c in cases):
            r = {**r, "outcome": "unconfirmed"}
        out.append(r)
    return out


def write(records: list[dict[str, Any]], out: Path, targets: list[str],
          missing: list[dict[str, Any]] = (), stable: dict[str, bool] | None = None,
          whole: dict[str, dict[str, int]] | None = None, triage: dict[str, dict[str, str]] | None = None) -> dict[str, Any]:
    """Writes the three files; returns the overall rates. `missing`: the campaign's mutants with no
    outcome yet (a shard not run or dead), said first and counted nowhere. `stable`: mutate.confirm's
    answer for the killing cases (None: not confirmed yet, said so). `whole`: mutate.population, the
    coverage of every mutant of each target, beside the sample's. `triage`: a person's judgement of
    survivors (mutate_triage: equivalent ones leave the rates, out-of-reach ones stay with their reason)."""
    from harness.gate import mutate_triage

    if stable is not None:
        records = confirmed(records, stable)
    records, wrong = mutate_triage.apply(records, triage or {})
    overall = rates(records)
    by_module: dict[str, list] = defaultdict(list)
    by_function: dict[str, list] = defaultdict(list)
    for r in records:
        by_module[r["module"]].append(r)
        by_function[f"{r['module']}:{r['function'] or '<module>'}"].append(r)
    doc = {"targets": targets, "overall": overall, "modules": {m: rates(rs) for m, rs in by_module.items()},
           "functions": {f: rates(rs) for f, rs in by_function.items()}, "mutants": records,
           "no_outcome": [m["id"] for m in missing], "population": whole}
    (out / "mutate.json").write_text(json.dumps(doc, indent=1))
    lines = [f"# Mutation campaign: {_pct(overall['kill_rate'])} of covered mutants killed, "
             f"{_pct(overall['coverage_rate'])} of sampled mutants covered",
             ""]
    if missing:
        lines += [f"**{len(missing)} of the campaign's {len(records) + len(missing)} mutants have no outcome yet** (a shard "
                  "not run, or one that died): nothing below counts them.", ""]
    if stable is None and any(r["outcome"] == "killed" for r in records):
        lines += ["The kills are not confirmed yet (a shard's report): the campaign's own report runs each killing "
                  "case again without a mutant.", ""]
    elif overall["unconfirmed"]:
        lines += [f"{overall['unconfirmed']} kill(s) unconfirmed: their killing cases changed outcome without the "
                  "mutant too; counted as covered, not killed.", ""]
    joined = sorted({r["campaign"] for r in records if r.get("campaign")})
    if joined:
        lines += [f"A follow-up joined with the campaign in {', '.join(joined)}: the outcome of each mutant is the union's "
                  f"(a kill in either selection kills it); {sum(bool(r.get('campaign')) for r in records)} outcome(s) come "
                  "from there (its kills are not run again here).", ""]
    if wrong:
        lines += [f"**{len(wrong)} mutant(s) judged equivalent were killed** (the judgement is wrong, the kill counts): "
                  f"{', '.join(wrong)}", ""]
    judged = sum(bool(r.get("judged")) for r in records)
    reach = [r for r in records if r["outcome"] == "survived" and r.get("reach")]
    if judged or reach:
        lines += [f"Judged by a person (mutant_triage.yaml): {judged} survivor(s) equivalent, left out of both rates; "
                  f"{len(reach)} survivor(s) out of the CPU harness's reach, still counted as survived.", ""]
    if overall["not-covered-out-of-reach"]:
        lines += [f"Of the {overall['not-covered']} not covered, {overall['not-covered-out-of-reach']} are in code the CPU "
                  "harness cannot reach (a GPU, Transformer-Engine; mutant_triage.yaml names what would reach each), still "
                  "counted as not covered: the "
                  f"coverage of the rest, what CPU cases could still close, is {_pct(overall['cpu_coverage_rate'])}.", ""]
    if overall["not-covered-uncalled"]:
        lines += [f"{overall['not-covered-uncalled']} of the not covered lie in functions nothing installed calls "
                  "(mutate_callers: no file of the stacks names them outside themselves), still counted as not covered: "
                  f"the coverage of what a user's stack can reach on CPU is {_pct(overall['reachable_coverage_rate'])}.", ""]
    capped = [r for r in records if r["outcome"] == "survived" and r.get("unrun")]
    if capped:
        lines += [f"{len(capped)} survivor(s) stopped at --max-cases with {sum(r['unrun'] for r in capped)} covering case "
                  "run(s) not made: a kill among those would only raise the kill rate.", ""]
    lines += [f"{overall['sampled']} mutant(s) sampled of {', '.join(targets)}: {overall['killed']} killed, "
             f"{overall['killed-timeout']} killed by timeout, **{overall['survived']} survived**, "
             f"{overall['unconfirmed']} unconfirmed, "
             f"**{overall['not-covered']} not covered** (no selected case runs them: blind spots of the selection), "
             f"{overall['equivalent']} equivalent (left out of both rates).",
             "", "## Per module", "", "| module | sampled | covered | killed | survived | not covered | equivalent | kill rate | coverage |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m, rs in sorted(doc["modules"].items()):
        lines.append(f"| {m} | {rs['sampled']} | {rs['covered']} | {rs['killed'] + rs['killed-timeout']} | {rs['survived']} | "
                     f"{rs['not-covered']} | {rs['equivalent']} | {_pct(rs['kill_rate'])} | {_pct(rs['coverage_rate'])} |")
    if whole:
        lines += ["", "## The whole population", "", "Every mutant of each target, not only the sample: how many lie on "
                  "lines some selected case runs.", "", "| target | mutants | on run lines | coverage |", "|---|---|---|---|"]
        for t, w in whole.items():
            lines.append(f"| {t} | {w['generated']} | {w['run']} | {_pct(w['run'] / w['generated'] if w['generated'] else None)} |")
    lines += ["", "## Per function", "", "| function | sampled | killed | survived | not covered | kill rate |", "|---|---|---|---|---|---|"]
    for f, rs in sorted(doc["functions"].items()):
        lines.append(f"| {f} | {rs['sampled']} | {rs['killed'] + rs['killed-timeout']} | {rs['survived']} | "
                     f"{rs['not-covered']} | {_pct(rs['kill_rate'])} |")
    for title, outcome in (("Survivors", "survived"), ("Unconfirmed kills", "unconfirmed"), ("Not covered", "not-covered"),
                           ("Equivalent", "equivalent")):
        picked = [r for r in records if r["outcome"] == outcome]
        lines += ["", f"## {title} ({len(picked)})"]
        for r in picked:
            shown, every = r.get("ran") or r["cases"], len(r["cases"])
            of = f" of {every} covering" if len(shown) < every else ""
            ran = f"; ran by {len(shown)} case(s){of}: {', '.join(shown[:4])}{' ...' if len(shown) > 4 else ''}" if every else ""
            why = (f" **Judged equivalent**: {r['judged']}." if r.get("judged") else "") + (
                f" **Out of reach on CPU**: {r['reach']}." if r.get("reach") else "") + (
                f" **No caller**: {r['uncalled']}." if r.get("uncalled") and not r.get("reach") else "")
            lines += ["", f"- `{r['id']}` {r['operator']} in {r['function'] or '<module>'}, {r['path']}:{r['line']}{ran}{why}",
                      "", "```diff", r["diff"].rstrip(), "```"]
    (out / "mutate.md").write_text("\n".join(lines) + "\n")
    _plot(doc["modules"], out / "mutate.png")
    return overall


def _plot(modules: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(modules)
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * max(1, len(names))))
    kill = [100 * (modules[n]["kill_rate"] or 0) for n in names]
    cover = [100 * (modules[n]["coverage_rate"] or 0) for n in names]
    y = range(len(names))
    ax.barh([i + 0.2 for i in y], kill, height=0.4, label="killed / covered")
    ax.barh([i - 0.2 for i in y], cover, height=0.4, label="covered / sampled")
    ax.set_yticks(list(y), [n.removeprefix("megatron.") for n in names], fontsize=8)
    ax.set_xlim(0, 100)
    ax.set_xlabel("%")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
