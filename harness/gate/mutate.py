"""`ckpt-harness mutate`: how much of a change to the installed upstream code the matrix would catch.

    ckpt-harness mutate --target MODULE[:FUNCTIONS][,MODULE...] [--sample N] [--seed S] [-k SLICE]
                        [--matrix M] [--jobs J] [--timeout S] [--max-cases N] [--cold]
                        [--prepare | --shard I/N | --shards N --executor local|slurm | --merge DIR... | --report] --out DIR

1. The mutants (harness/faults/mutants.py) of each target module as installed; `--sample N` of them,
   the same for the same seed (DIR/mutants.json).
2. One instrumented run of the slice (DIR/clean): the cases' unmutated outcomes, and which target
   lines each case ran (harness/faults/coverage_hook.py, in every rank). A mutant no case runs is
   **not covered**: a blind spot of the selection, never counted as killed.
3. Each covered mutant runs only the cases that run its span (`--jobs` mutants at once, each its own
   work unit), in batches that stop at the first kill (mutate_cases.py), each a `run` forked from a
   warm parent (mutate_warm.py; `--cold`: a fresh interpreter) whose every process
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

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.faults import coverage_hook, mutant_hook
from harness.faults.mutants import Mutant, generate, in_functions, sample
from harness.gate import baseline_cache, compare, mutate_cases
from harness.gate.progress import say

ROOT = Path(__file__).resolve().parents[2]


class MutateError(Exception):
    """The campaign cannot go on (its clean run failed, an --out of another campaign); exit 2."""


def _run(args: list[str], env: dict[str, str], log: Path, timeout_s: float | None = None) -> tuple[int, bool]:
    """`python -m harness.cli ARGS` from this checkout (`run ...`, `golden check ...`); (exit code, timed out)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        try:
            done = subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=ROOT, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, check=False, timeout=timeout_s)
            return done.returncode, False
        except subprocess.TimeoutExpired:
            return -1, True


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in (coverage_hook.ENV, coverage_hook.CONTEXT_ENV, mutant_hook.ENV)}


def target_mutants(target: str) -> list[Mutant]:
    """Every mutant of a target, `MODULE` or `MODULE:FUNCTIONS` (fnmatch on the qualified function
    name, `|` between alternatives: `megatron.core.optimizer.distrib_optimizer:*state*|*load*`)."""
    module, _, functions = target.partition(":")
    every = generate(module.strip())
    if functions:
        every = in_functions(every, functions)
        if not every:
            raise MutateError(f"--target {target}: no mutant of {module} is in a function matching {functions!r}")
    return every


def mutants_of(targets: list[str], n: int | None, seed: int, out: Path) -> list[Mutant]:
    """The campaign's mutants; a campaign started before in `out` keeps the ones it chose."""
    saved = out / "mutants.json"
    if saved.exists():
        doc = json.loads(saved.read_text())
        if doc["targets"] != targets or doc["sample"] != n or doc["seed"] != seed:
            raise MutateError(f"{out} holds a campaign of {doc['targets']} (sample {doc['sample']}, seed {doc['seed']}): "
                              "use another --out")
        return [Mutant.from_dict(m) for m in doc["mutants"]]
    every = [m for t in targets for m in target_mutants(t)]
    chosen = sample(every, n, seed)
    out.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps({"targets": targets, "sample": n, "seed": seed, "generated": len(every),
                                 "mutants": [m.to_dict() for m in chosen]}, indent=1))
    return chosen


def measured(cov: Path, files: list[str]) -> dict[str, str]:
    """The environment of a clean run measuring `files` into `cov`, emptied first (a run that died
    part-way: its lines go with it)."""
    cov.mkdir(parents=True, exist_ok=True)
    for old in cov.glob(".coverage*"):
        old.unlink()
    return {**_clean_env(), coverage_hook.ENV: json.dumps({"dir": str(cov), "include": files})}


def clean_run(matrix: Path, k: str | None, files: list[str], out: Path, jobs: int = 1) -> dict[str, Any]:
    """The unmutated outcomes of the slice, measured: DIR/clean/results.json and DIR/coverage. `jobs`
    cases at once (the pool's forked workers: each measures itself, and names each case it runs as
    that case's coverage context, as the serial parent does; lines the pool's parent runs before it forks
    are every case's)."""
    report, cov = out / "clean", out / "coverage"
    if (report / "results.json").exists():
        doc = compare.load(report)
        if doc.get("complete"):
            return doc
    env = measured(cov, files)
    say(f"mutate: the clean run of {matrix}{f' -k {k!r}' if k else ''}, measured (log: {report / 'run.log'})")
    code, _ = _run(["run", str(matrix), *([f"-k={k}"] if k else []), "--report", str(report), "--jobs", str(max(1, jobs))],
                   env, report / "run.log")
    if code not in (0, 1) or not (report / "results.json").exists():
        raise MutateError(f"the clean run failed (exit {code}); see {report / 'run.log'}")
    return compare.load(report)


def clean_corpus(files: list[str], out: Path) -> dict[str, Any]:
    """The gate's cross-version half, unmutated and measured: `golden make` writes DIR/corpus
    (DIR/coverage-make: which target lines each artefact's write runs), `golden check` reads it
    (DIR/clean-corpus, DIR/coverage-corpus: each artefact's load). A mutant on a load's lines then
    also reads the clean-written corpus, as a candidate reads the baseline's in the gate; one on a
    write's lines writes a corpus the clean code reads, as the gate's rollback has the baseline read
    the candidate's."""
    report, corpus, read_cov, make_cov = out / "clean-corpus", out / "corpus", out / "coverage-corpus", out / "coverage-make"

    if not any(make_cov.glob(".coverage.*")):
        into = corpus if not (corpus / "manifest.json").exists() else out / "corpus-measured"  # a corpus made unmeasured before
        shutil.rmtree(into, ignore_errors=True)
        say(f"mutate: the clean code writes the golden corpus, measured (log: {out / 'corpus-make.log'})")
        code, _ = _run(["golden", "make", str(into)], measured(make_cov, files), out / "corpus-make.log")
        if not (into / "manifest.json").exists():
            raise MutateError(f"golden make failed (exit {code}); see {out / 'corpus-make.log'}")
        if into != corpus:
            shutil.rmtree(into)
    if (report / "results.json").exists():
        return compare.load(report)
    say(f"mutate: the clean code reads the corpus, measured (log: {out / 'clean-corpus.log'})")
    code, _ = _run(corpus_args(corpus, report), measured(read_cov, files), out / "clean-corpus.log")
    if code not in (0, 1) or not (report / "results.json").exists():
        raise MutateError(f"golden check of the clean corpus failed (exit {code}); see {out / 'clean-corpus.log'}")
    return compare.load(report)


@dataclass(frozen=True)
class CorpusPlan:
    """A mutant's part of the corpus: the clean read of the clean-written corpus, the artefacts whose
    load runs its span (`reads`) and those whose write does (`writes`)."""

    read: dict[str, Any]
    reads: list[str]
    writes: list[str] = field(default_factory=list)


def rollback(plan: CorpusPlan, where: Path, env: dict[str, str], runner, timeout_s: float) -> tuple[str, list[dict]]:
    """The mutant writes the artefacts of `plan.writes` (`golden make --id`), the clean code reads them
    (`golden check --allow-refusal`: as the gate's rollback, a clean refusal passes, a crash or a silent
    misread fails); judged against the clean read of the clean-written corpus."""
    written, part = where / "written", where / "written-read"
    shutil.rmtree(written, ignore_errors=True)
    ids = [a for i in plan.writes for a in ("--id", i)]
    _, timed_out = runner(["golden", "make", str(written), *ids], env, where / "written.log", timeout_s * len(plan.writes))
    if timed_out:
        return "killed-timeout", []
    if not (written / "manifest.json").exists():
        return "killed", [{"case": "", "class": "error", "detail": "the mutated `golden make` wrote no corpus"}]
    _, timed_out = runner([*corpus_args(written, part), *ids, "--allow-refusal"], {}, where / "written-read.log",
                          timeout_s * len(plan.writes))
    ran = compare.load(part) if (part / "results.json").exists() else None
    shutil.rmtree(written, ignore_errors=True)  # judged: its bytes are not kept
    return judge(plan.read, ran, plan.writes, timed_out)


def corpus_args(corpus: Path, report: Path, ids: list[str] = ()) -> list[str]:
    # the campaign wrote this corpus itself, in its own directory: not a user's files
    return ["golden", "check", str(corpus), "--report", str(report), "--trust-pickles", *(a for i in ids for a in ("--id", i))]


def judge(clean: dict[str, Any], ran: dict[str, Any] | None, cases: list[str], timed_out: bool) -> tuple[str, list[dict]]:
    """(killed | killed-timeout | survived, the failing findings) of one mutant's run of `cases`
    (`clean`: their unmutated run, a matrix run or a corpus read)."""
    if timed_out:
        return "killed-timeout", []
    if ran is None:
        return "killed", [{"case": "", "class": "error", "detail": "the mutated run wrote no results.json"}]
    timeouts = [r["id"] for r in ran["results"] if "WorldTimeout" in (r.get("error") or "")]
    if timeouts:
        return "killed-timeout", [{"case": c, "class": "timeout", "detail": "ran past the world's timeout"} for c in timeouts]
    keep = set(cases)
    lost = [c for c in cases if c not in {r["id"] for r in ran["results"]}]
    if lost:  # the clean run judged each of them: a run that died before one is no survivor
        return "killed", [{"case": c, "class": "error", "detail": "no result: the mutated run ended before it"} for c in lost]
    clean = {**clean, "selected": clean.get("selected") or [r["id"] for r in clean["results"]]}
    base = baseline_cache.restricted(clean, cases, Path("clean"))
    ran = {**ran, "selected": list(cases), "results": [r for r in ran["results"] if r["id"] in keep]}
    failing = [f.to_dict() for f in compare.compare(base, ran) if f.failing]
    return ("killed" if failing else "survived"), failing


def cold(args: list[str], env: dict[str, str], log: Path, timeout_s: float | None) -> tuple[int, bool]:
    """A mutant's `run` in a fresh interpreter (`--cold`, and where no warm parent can start)."""
    return _run(args, {**_clean_env(), **env}, log, timeout_s)


def run_mutant(m: Mutant, index: int, text: str, cases: list[str], matrix: Path, out: Path, timeout_s: float,
               clean: dict[str, Any], runner=cold, max_cases: int | None = None,
               corpus: CorpusPlan | None = None, rare: dict[str, float] | None = None) -> dict[str, Any]:
    """One mutant's outcome (DIR/mutants/<index>/outcome.json), from its file when it ran before.
    Its cases run in batches, likeliest killers first (mutate_cases), until one is killed; then, while
    every one kept its outcome, it reads the clean-written corpus, then writes one the clean code reads
    (`corpus`: the artefacts whose load or write runs its span)."""
    where = out / "mutants" / f"{index:04d}"
    done = where / "outcome.json"
    if done.exists():
        return json.loads(done.read_text())
    start = time.perf_counter()
    artefacts = corpus.reads if corpus else []
    writes = corpus.writes if corpus else []
    record: dict[str, Any] = {**m.to_dict(), "index": index, "cases": cases + artefacts + [f"written {w}" for w in writes],
                              "diff": m.diff(text)}
    if m.equivalent(text):  # the same instructions: nothing to run, no blind spot either way
        record.update(outcome="equivalent", findings=[], ran=[])
    elif not cases and not artefacts and not writes:
        record.update(outcome="not-covered", findings=[], ran=[])
    else:
        env = {mutant_hook.ENV: json.dumps(m.to_dict())}
        todo = mutate_cases.order(cases, clean, rare)[:max_cases or None]
        ran_ids: list[str] = []
        outcome, findings = "survived", []
        for n, batch in enumerate(mutate_cases.batches(todo)):
            part = where / f"run-{n}"
            args = ["run", str(matrix), *(a for c in batch for a in ("--id", c)), "--report", str(part), "--jobs", "1"]
            _, timed_out = runner(args, env, where / f"run-{n}.log", timeout_s * len(batch))
            ran = compare.load(part) if (part / "results.json").exists() else None
            ran_ids += batch
            outcome, findings = judge(clean, ran, batch, timed_out)
            if outcome != "survived":
                break
        if outcome == "survived" and artefacts:
            part = where / "corpus"
            _, timed_out = runner(corpus_args(out / "corpus", part, artefacts), env, where / "corpus.log", timeout_s * len(artefacts))
            ran = compare.load(part) if (part / "results.json").exists() else None
            ran_ids += artefacts
            outcome, findings = judge(corpus.read, ran, artefacts, timed_out)
        if outcome == "survived" and writes:
            ran_ids += [f"written {w}" for w in writes]
            outcome, findings = rollback(corpus, where, env, runner, timeout_s)
        # a survivor under --max-cases never ran these covering cases: said in the report, never a kill
        record.update(outcome=outcome, findings=findings[:5], ran=ran_ids,
                      unrun=len(cases) + len(artefacts) + len(writes) - len(ran_ids) if outcome == "survived" else 0)
    record["seconds"] = round(time.perf_counter() - start, 1)
    where.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(record, indent=1))
    return record


def interleaved(indices: list[int], modules: list[str], chunk: int = 3) -> list[int]:
    """The order mutants run in: `chunk` of one module, then `chunk` of the next, round the modules,
    so a campaign stopped part-way has measured every module a little (its report then still has a
    row per module), and a worker's warm parent serves a few mutants of its module before the next."""
    by: dict[str, list[int]] = {}
    for i in indices:
        by.setdefault(modules[i], []).append(i)
    queues, out = list(by.values()), []
    while any(queues):
        for q in queues:
            out += q[:chunk]
            del q[:chunk]
    return out


def shard_of(text: str | None) -> tuple[int, int] | None:
    """`I/N` as (I, N), 1 <= I <= N; None for none."""
    if not text:
        return None
    i, sep, n = text.partition("/")
    if not (sep and i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n)):
        raise MutateError(f"--shard {text!r}: expected I/N with 1 <= I <= N")
    return int(i), int(n)


class Runners:
    """Where each worker thread's runs go: forked from a warm parent for its current mutant's module
    (mutate_warm.py; one a worker, started again when the module changes), or a fresh interpreter
    (`warm` False). A run without a mutant (a rollback's clean read) goes to the worker's current
    parent, which holds no target module, so it runs the installed code."""

    def __init__(self, out: Path, warm: bool = True, make_parent=None):
        import threading

        self.out, self.warm = out, warm
        self.make_parent = make_parent or self._parent
        self.local, self.parents, self.lock = threading.local(), [], threading.Lock()

    def _parent(self, module: str):
        from harness.gate.mutate_warm import WarmParent

        parent = WarmParent([module], _clean_env(), self.out / "warm.log")
        say(f"mutate: a warm parent for {module} holds {', '.join(parent.kept) or 'nothing'}")
        return parent

    def __call__(self, args: list[str], env: dict[str, str], log: Path, timeout: float | None) -> tuple[int, bool]:
        if not self.warm:
            return cold(args, env, log, timeout)
        current = getattr(self.local, "parent", None)
        if mutant_hook.ENV not in env:
            return cold(args, env, log, timeout) if current is None else current.run(args, env, log, timeout)
        module = json.loads(env[mutant_hook.ENV])["module"]
        if getattr(self.local, "module", None) != module:
            if current is not None:
                current.close()
            self.local.parent, self.local.module = self.make_parent(module), module
            with self.lock:
                self.parents.append(self.local.parent)
        return self.local.parent.run(args, env, log, timeout)

    def close(self) -> None:
        for parent in self.parents:
            parent.close()


def campaign(targets: list[str], matrix: Path, k: str | None, out: Path, n: int | None = None, seed: int = 0,
             jobs: int = 1, timeout_s: float = 300.0, max_cases: int | None = None, warm: bool = True,
             shard: tuple[int, int] | None = None, prepare_only: bool = False, corpus: bool = True,
             skip: frozenset[int] = frozenset()) -> list[dict[str, Any]]:
    """Every mutant's record, in mutant order (harness.gate.mutate_report writes them up); a shard
    runs the mutants whose number is I modulo N, and needs the clean run made before (`--prepare`),
    so shards sharing DIR never make it twice; their records are the ones this shard ran. `skip`: the
    mutants a follow-up leaves to the campaign before it (mutate_results.follow_up)."""
    mutants = mutants_of(targets, n, seed, out)
    files = sorted({m.path for m in mutants})
    if shard and not clean_done(out):
        raise MutateError(f"--shard: {out / 'clean'} holds no complete clean run; run the same command with --prepare first")
    clean = clean_run(matrix, k, files, out, jobs)
    read = clean_corpus(files, out) if corpus else None
    if prepare_only:
        return []
    read_ids = [r["id"] for r in read["results"]] if read else []
    read_lines = coverage_hook.lines(out / "coverage-corpus") if read else {}
    write_lines = coverage_hook.lines(out / "coverage-make") if read else {}
    ids = list(clean.get("selected") or [r["id"] for r in clean["results"]])
    by_file = coverage_hook.lines(out / "coverage")
    texts = {f: Path(f).read_text() for f in files}
    rare = {f: mutate_cases.rarity(by_file.get(f, {})) for f in files}
    mine = interleaved([i for i in range(len(mutants)) if (shard is None or i % shard[1] == shard[0] - 1) and i not in skip],
                       [m.module for m in mutants])
    from concurrent.futures import ThreadPoolExecutor

    runner = Runners(out, warm)

    def one(i: int) -> dict[str, Any]:
        m = mutants[i]
        cases = coverage_hook.covering(by_file.get(m.path, {}), m.line, m.end_line, ids, m.at_import)
        plan = CorpusPlan(read, *(coverage_hook.covering(lines.get(m.path, {}), m.line, m.end_line, read_ids, m.at_import)
                                  for lines in (read_lines, write_lines))) if read else None
        rec = run_mutant(m, i, texts[m.path], cases, matrix, out, timeout_s, clean, runner, max_cases, plan, rare[m.path])
        say(f"mutate [{i + 1}/{len(mutants)}] {rec['outcome'].upper():14} {m.id} "
            f"({len(rec.get('ran', []))} of {len(cases)} case(s), {rec['seconds']}s)")
        return rec

    # mutants are independent work units: `jobs` mutant runs at once (threads that wait on subprocesses)
    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            return sorted(pool.map(one, mine), key=lambda r: r["index"])
    finally:
        runner.close()


def clean_done(out: Path) -> bool:
    return (out / "clean" / "results.json").exists() and bool(compare.load(out / "clean").get("complete"))
