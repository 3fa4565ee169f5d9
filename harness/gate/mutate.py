"""`ckpt-harness mutate`: how much of a change to the installed upstream code the matrix would catch.

    ckpt-harness mutate --target megatron.core.dist_checkpointing.mapping[,MODULE...] [--sample N]
                        [--seed S] [-k SLICE] [--matrix M] [--jobs J] [--timeout S] --out DIR

1. The mutants (harness/faults/mutants.py) of each target module as installed; `--sample N` of them,
   the same for the same seed (DIR/mutants.json).
2. One instrumented run of the slice (DIR/clean): the cases' unmutated outcomes, and which target
   lines each case ran (harness/faults/coverage_hook.py, in every rank). A mutant no case runs is
   **not covered**: a blind spot of the selection, never counted as killed.
3. Each covered mutant runs only the cases that run its span (`--jobs` mutants at once, each its own
   work unit), in a fresh `run` whose every process
   loads the mutant (harness/faults/mutant_hook.py; the installed file is only read). It is
   **killed** when a case's outcome changed as the gate judges it (a failing finding of
   harness.gate.compare: a new failure or error, a check that passed failing, a named xfail failing
   in other checks); **killed by timeout** when a case ran past --timeout; otherwise it **survived**.
   A mutant that compiles to the same instructions as the original is **equivalent**, and not run.
4. DIR/mutate.json, DIR/mutate.md and DIR/mutate.png (mutate_report.py). Each mutant's outcome is
   written as it ends (DIR/mutants/<n>/outcome.json): a campaign run again with the same --out
   goes on where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.faults import coverage_hook, mutant_hook
from harness.faults.mutants import Mutant, generate, sample
from harness.gate import baseline_cache, compare
from harness.gate.progress import say

ROOT = Path(__file__).resolve().parents[2]


class MutateError(Exception):
    """The campaign cannot go on (its clean run failed, an --out of another campaign); exit 2."""


def _run(args: list[str], env: dict[str, str], log: Path, timeout_s: float | None = None) -> tuple[int, bool]:
    """`python -m harness.cli run ...` from this checkout; (exit code, timed out)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        try:
            done = subprocess.run([sys.executable, "-m", "harness.cli", "run", *args], cwd=ROOT, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, check=False, timeout=timeout_s)
            return done.returncode, False
        except subprocess.TimeoutExpired:
            return -1, True


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in (coverage_hook.ENV, coverage_hook.CONTEXT_ENV, mutant_hook.ENV)}


def mutants_of(targets: list[str], n: int | None, seed: int, out: Path) -> list[Mutant]:
    """The campaign's mutants; a campaign started before in `out` keeps the ones it chose."""
    saved = out / "mutants.json"
    if saved.exists():
        doc = json.loads(saved.read_text())
        if doc["targets"] != targets or doc["sample"] != n or doc["seed"] != seed:
            raise MutateError(f"{out} holds a campaign of {doc['targets']} (sample {doc['sample']}, seed {doc['seed']}): "
                              "use another --out")
        return [Mutant.from_dict(m) for m in doc["mutants"]]
    every = [m for t in targets for m in generate(t)]
    chosen = sample(every, n, seed)
    out.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps({"targets": targets, "sample": n, "seed": seed, "generated": len(every),
                                 "mutants": [m.to_dict() for m in chosen]}, indent=1))
    return chosen


def clean_run(matrix: Path, k: str | None, files: list[str], out: Path) -> dict[str, Any]:
    """The unmutated outcomes of the slice, measured: DIR/clean/results.json and DIR/coverage."""
    report, cov = out / "clean", out / "coverage"
    if (report / "results.json").exists():
        doc = compare.load(report)
        if doc.get("complete"):
            return doc
    cov.mkdir(parents=True, exist_ok=True)
    for old in cov.glob(".coverage*"):
        old.unlink()  # a clean run that died part-way: its lines go with it
    env = {**_clean_env(), coverage_hook.ENV: json.dumps({"dir": str(cov), "include": files})}
    say(f"mutate: the clean run of {matrix}{f' -k {k!r}' if k else ''}, measured (log: {report / 'run.log'})")
    # one case at a time in the parent: each case's lines carry its own name (coverage_hook.case)
    code, _ = _run([str(matrix), *(["-k", k] if k else []), "--report", str(report), "--jobs", "1"], env,
                   report / "run.log")
    if code not in (0, 1) or not (report / "results.json").exists():
        raise MutateError(f"the clean run failed (exit {code}); see {report / 'run.log'}")
    return compare.load(report)


def judge(clean: dict[str, Any], ran: dict[str, Any] | None, cases: list[str], timed_out: bool) -> tuple[str, list[dict]]:
    """(killed | killed-timeout | survived, the failing findings) of one mutant's run of `cases`."""
    if timed_out:
        return "killed-timeout", []
    if ran is None:
        return "killed", [{"case": "", "class": "error", "detail": "the mutated run wrote no results.json"}]
    timeouts = [r["id"] for r in ran["results"] if "WorldTimeout" in (r.get("error") or "")]
    if timeouts:
        return "killed-timeout", [{"case": c, "class": "timeout", "detail": "ran past the world's timeout"} for c in timeouts]
    base = baseline_cache.restricted(clean, cases, Path("clean"))
    failing = [f.to_dict() for f in compare.compare(base, ran) if f.failing]
    return ("killed" if failing else "survived"), failing


def run_mutant(m: Mutant, index: int, text: str, cases: list[str], matrix: Path, out: Path, timeout_s: float,
               clean: dict[str, Any]) -> dict[str, Any]:
    """One mutant's outcome (DIR/mutants/<index>/outcome.json), from its file when it ran before."""
    where = out / "mutants" / f"{index:04d}"
    done = where / "outcome.json"
    if done.exists():
        return json.loads(done.read_text())
    start = time.perf_counter()
    record: dict[str, Any] = {**m.to_dict(), "index": index, "cases": cases, "diff": m.diff(text)}
    if m.equivalent(text):  # the same instructions: nothing to run, no blind spot either way
        record.update(outcome="equivalent", findings=[])
    elif not cases:
        record.update(outcome="not-covered", findings=[])
    else:
        env = {**_clean_env(), mutant_hook.ENV: json.dumps(m.to_dict())}
        args = [str(matrix), *(a for c in cases for a in ("--id", c)), "--report", str(where / "run"), "--jobs", "1"]
        _, timed_out = _run(args, env, where / "run.log", timeout_s * max(1, len(cases)))
        ran = compare.load(where / "run") if (where / "run" / "results.json").exists() else None
        outcome, findings = judge(clean, ran, cases, timed_out)
        record.update(outcome=outcome, findings=findings[:5])
    record["seconds"] = round(time.perf_counter() - start, 1)
    where.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(record, indent=1))
    return record


def campaign(targets: list[str], matrix: Path, k: str | None, out: Path, n: int | None = None, seed: int = 0,
             jobs: int = 1, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Every mutant's record, in mutant order (harness.gate.mutate_report writes them up)."""
    mutants = mutants_of(targets, n, seed, out)
    files = sorted({m.path for m in mutants})
    clean = clean_run(matrix, k, files, out)
    ids = list(clean.get("selected") or [r["id"] for r in clean["results"]])
    by_file = coverage_hook.lines(out / "coverage")
    texts = {f: Path(f).read_text() for f in files}
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> dict[str, Any]:
        m = mutants[i]
        cases = coverage_hook.covering(by_file.get(m.path, {}), m.line, m.end_line, ids, m.at_import)
        rec = run_mutant(m, i, texts[m.path], cases, matrix, out, timeout_s, clean)
        say(f"mutate [{i + 1}/{len(mutants)}] {rec['outcome'].upper():14} {m.id} ({len(cases)} case(s), {rec['seconds']}s)")
        return rec

    # mutants are independent work units: `jobs` mutant runs at once (threads that wait on subprocesses)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, range(len(mutants))))


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("mutate", help="mutants of installed upstream modules against a matrix slice: the kill "
                              "rate and the blind spots (docs/mutate.md)")
    p.add_argument("--target", required=True, help="MODULE[,MODULE...] as installed (e.g. megatron.core.dist_checkpointing.mapping)")
    p.add_argument("--sample", type=int, default=None, metavar="N", help="this many of the mutants (default: all)")
    p.add_argument("--seed", type=int, default=0, help="which N: the same seed gives the same mutants")
    p.add_argument("-k", default=None, help="only matrix cases whose id contains every word of this")
    p.add_argument("--matrix", type=Path, default=Path("matrices/gate.yaml"), help="default: the gate's selection")
    p.add_argument("--jobs", "-j", type=int, default=1, metavar="J", help="mutant runs at once (each runs its cases one "
                   "at a time; a fresh interpreter's imports overlap another mutant's cases)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S", help="seconds per case before a mutant counts as "
                   "killed by timeout")
    p.add_argument("--out", type=Path, required=True, help="the campaign's directory (run again to resume)")
    p.set_defaults(func=run_cli)
    return p


def run_cli(args: argparse.Namespace) -> int:
    from harness.gate import mutate_report

    targets = [t.strip() for t in args.target.split(",") if t.strip()]
    try:
        records = campaign(targets, args.matrix, args.k, args.out.resolve(), args.sample, args.seed, args.jobs, args.timeout)
    except (MutateError, ValueError) as exc:
        print(f"ckpt-harness mutate: {exc}", file=sys.stderr)
        return 2
    summary = mutate_report.write(records, args.out.resolve(), targets)
    print((args.out / "mutate.md").read_text().split("\n## ")[0])
    return 0 if summary["covered"] else 2
