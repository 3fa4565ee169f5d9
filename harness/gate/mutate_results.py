"""What a campaign's directory holds, read back and made into evidence: the outcomes (records_of),
other directories' outcomes of the same campaign (merge), the kills confirmed by running each killing
case again without a mutant (confirm), and the coverage of every mutant of each target (population).
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


def merge(out: Path, others: list[Path]) -> None:
    """Copy into `out` the outcomes of the same campaign run elsewhere (shards without a shared
    filesystem); a directory of another campaign (targets, sample, seed, mutants) is refused."""
    import shutil

    mine = json.loads((out / "mutants.json").read_text())
    for other in others:
        theirs = json.loads((Path(other) / "mutants.json").read_text())
        if [m["id"] for m in theirs["mutants"]] != [m["id"] for m in mine["mutants"]]:
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


def population(targets: list[str], out: Path) -> dict[str, dict[str, int]]:
    """{target: {"generated": every mutant of it, "run": those on lines some selected case runs}}: the
    coverage of the whole population the sample was drawn from (DIR/population.json), no sampling
    error, equivalent mutants not told apart."""
    path = out / "population.json"
    if path.exists():
        return json.loads(path.read_text())
    clean = compare.load(out / "clean")
    ids = list(clean.get("selected") or [r["id"] for r in clean["results"]])
    by_file = coverage_hook.lines(out / "coverage")
    doc = {}
    for t in targets:
        every = target_mutants(t)
        doc[t] = {"generated": len(every), "run": sum(bool(coverage_hook.covering(by_file.get(m.path, {}), m.line, m.end_line,
                                                                                   ids, m.at_import)) for m in every)}
    path.write_text(json.dumps(doc, indent=1))
    return doc
