"""What a campaign's directory holds, read back and made into evidence: the outcomes (records_of),
other directories' outcomes of the same campaign (merge), the kills confirmed by running each killing
case again without a mutant (confirm), the coverage of every mutant of each target (population), and a
follow-up campaign joined with the one before it (follow_up, union).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.faults import coverage_hook
from harness.gate import compare
from harness.gate.mutate import MutateError, cold, corpus_args, judge, target_mutants
from harness.gate.progress import say


def records_of(out: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(every outcome DIR holds, in mutant order; the mutants of mutants.json with none yet)."""
    doc = json.loads((out / "mutants.json").read_text())
    have, missing = [], []
    for i, m in enumerate(doc["mutants"]):
        f = out / "mutants" / f"{i:04d}" / "outcome.json"
        (have.append(json.loads(f.read_text())) if f.exists() else missing.append({**m, "index": i}))
    return have, missing


def same_mutants(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two mutants.json documents hold the same campaign's mutants, in the same order (merge, follow_up)."""
    return [m["id"] for m in a["mutants"]] == [m["id"] for m in b["mutants"]]


#: outcomes a follow-up does not run again: the campaign before it settled them
SETTLED = ("killed", "killed-timeout", "equivalent")
#: which of two outcomes of one mutant under two selections the union keeps: the first in this order
UNION = ("killed", "killed-timeout", "unconfirmed", "survived", "equivalent", "not-covered")


def follow_up(out: Path, before: Path) -> frozenset[int]:
    """Make `out` a follow-up of the campaign in `before`: the same mutants (its mutants.json, copied:
    a later mutant generator may sample others), and the numbers of those it settled, which `out` skips."""
    theirs = before / "mutants.json"
    if not theirs.exists():
        raise MutateError(f"--after {before}: no campaign there (no mutants.json)")
    mine = out / "mutants.json"
    if mine.exists():
        if not same_mutants(json.loads(mine.read_text()), json.loads(theirs.read_text())):
            raise MutateError(f"--after {before}: {out} holds another campaign's mutants")
    else:
        out.mkdir(parents=True, exist_ok=True)
        mine.write_text(theirs.read_text())
    return frozenset(r["index"] for r in records_of(before)[0] if r["outcome"] in SETTLED)


def union(mine: list[dict[str, Any]], theirs: list[dict[str, Any]], before: Path) -> list[dict[str, Any]]:
    """One record per mutant over both selections: the outcome first in UNION (a kill in either
    selection is a kill of their union), its covering and run cases from both; `campaign` says which
    directory's outcome it is."""
    by = {r["index"]: {**r, "campaign": str(before)} for r in theirs}
    for r in mine:
        other = by.get(r["index"])
        if other is None or UNION.index(r["outcome"]) <= UNION.index(other["outcome"]):
            keep, rest = r, other
        else:
            keep, rest = other, r
        if rest is not None:
            keep = {**keep, "cases": sorted(set(keep["cases"]) | set(rest["cases"])),
                    "ran": list(dict.fromkeys([*keep.get("ran", []), *rest.get("ran", [])]))}
        by[r["index"]] = keep
    return [by[i] for i in sorted(by)]


def merge(out: Path, others: list[Path]) -> None:
    """Copy into `out` the outcomes of the same campaign run elsewhere (shards without a shared
    filesystem); a directory of another campaign (targets, sample, seed, mutants) is refused."""
    import shutil

    mine = json.loads((out / "mutants.json").read_text())
    for other in others:
        theirs = json.loads((Path(other) / "mutants.json").read_text())
        if not same_mutants(theirs, mine):
            raise MutateError(f"--merge {other}: another campaign's mutants ({theirs['targets']}, sample "
                              f"{theirs['sample']}, seed {theirs['seed']}) than {out}'s")
        for f in sorted(Path(other).glob("mutants/*/outcome.json")):
            dest = out / f.relative_to(other)
            if not dest.exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, dest)


def confirm(out: Path, matrix: Path, clean: dict[str, Any], records: list[dict[str, Any]], runner=None) -> dict[str, bool]:
    """{case: it keeps its clean outcome when run again without a mutant} for every case that killed a
    mutant (DIR/confirm.json; cases confirmed before are not run again): a matrix case by `run --id`,
    a corpus artefact by reading the corpus again. A kill by a case that changes its outcome on its
    own (a flaky check, a memory peak near its threshold) is no evidence: the report counts such a
    mutant as covered, not killed."""
    path = out / "confirm.json"
    stable: dict[str, bool] = json.loads(path.read_text()) if path.exists() else {}
    killers = sorted({f["case"] for r in records if r["outcome"] == "killed" for f in r.get("findings", []) if f.get("case")})
    todo = [c for c in killers if c not in stable]
    if not todo:
        return stable
    run = runner or cold
    read = compare.load(out / "clean-corpus") if (out / "clean-corpus" / "results.json").exists() else {"results": []}
    artefacts = {r["id"] for r in read["results"]}
    n = len(list((out / "confirm").glob("*.log"))) if (out / "confirm").exists() else 0
    for base_doc, ids, what in ((clean, [c for c in todo if c not in artefacts], "run"),
                                (read, [c for c in todo if c in artefacts], "corpus")):
        if not ids:
            continue
        part = out / "confirm" / f"{what}-{n}"
        say(f"mutate: {len(ids)} killing case(s) run again without a mutant (log: {part}.log)")
        args = (["run", str(matrix), *(a for c in ids for a in ("--id", c)), "--report", str(part), "--jobs", "1"]
                if what == "run" else corpus_args(out / "corpus", part, ids))
        run(args, {}, part.with_suffix(".log"), None)
        ran = compare.load(part) if (part / "results.json").exists() else None
        for c in ids:
            stable[c] = ran is not None and judge(base_doc, ran, [c], False)[0] == "survived"
    path.write_text(json.dumps(stable, indent=1, sort_keys=True))
    return stable


def population(targets: list[str], out: Path, befores: list[Path] = ()) -> dict[str, dict[str, int]]:
    """{target: {"generated": every mutant of it, "run": those on lines some selected case runs}}: the
    coverage of the whole population the sample was drawn from (DIR/population.json), no sampling
    error, equivalent mutants not told apart; with `befores` (a follow-up), lines any of the selections runs."""
    path = out / "population.json"
    if path.exists():
        return json.loads(path.read_text())
    runs = []
    for d in [out, *befores]:
        clean = compare.load(d / "clean")
        runs.append((list(clean.get("selected") or [r["id"] for r in clean["results"]]), coverage_hook.lines(d / "coverage")))
    doc = {}
    for t in targets:
        every = target_mutants(t)
        doc[t] = {"generated": len(every), "run": sum(any(coverage_hook.covering(by_file.get(m.path, {}), m.line, m.end_line,
                                                                                  ids, m.at_import) for ids, by_file in runs)
                                                      for m in every)}
    path.write_text(json.dumps(doc, indent=1))
    return doc
