"""The bump gate: is a candidate Megatron-Bridge / Megatron-Core safe to bump to?

    ckpt-harness gate --candidate megatron-core==0.19.0 [--candidate SPEC ...] [--baseline SPEC ...]
                      [MATRIX] [-k WORDS] --out DIR

1. Builds (or reuses) the baseline environment (the pins, plus any --baseline overrides) and the
   candidate (the pins plus --candidate overrides) through harness/gate/envspec.py, and imports
   megatron-core and Megatron-Bridge in each. A candidate that does not install or import ends the
   gate: exit 2, the pip or import error tail in DIR/verdict.md.
2. Runs the same matrix, with the same harness code, in each (DIR/baseline, DIR/candidate): each run
   writes its results.json case by case, and a case whose upstream API moved is an `error` naming the
   package and version, not the end of the run.
3. Cross-version (DIR/cross): the baseline writes the golden corpus and the candidate loads it
   (must be bit-exact); the candidate writes one and the baseline loads it (a rollback: a refusal
   is allowed if it is a named exception, a crash or a wrong value is not).
4. Compares (harness/gate/compare.py) and writes DIR/verdict.md (regressions first), verdict.html and gate.json.
Exit 0: safe to bump; 1: regressions (listed first); 2: could not run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from harness.core.result import GREEN
from harness.gate import archs, baseline_cache, classify, compare, envspec, evidence, progress, scale
from harness.gate.golden import NOT_WRITTEN
from harness.gate.progress import say
from harness.gate.verdict import reason, verdict_markdown, write_verdict  # noqa: F401  (bump.reason, bump.verdict_markdown)
from harness.report.results import code_digest

ROOT = Path(__file__).resolve().parents[2]


class GateError(Exception):
    """The gate could not run (an environment, a matrix, a subprocess); exit 2 with this message."""


@dataclass
class Side:
    name: str  # baseline | candidate
    specs: list[str]
    venv: Path | None = None
    build_s: float = 0.0
    versions: dict[str, Any] = field(default_factory=dict)
    #: what the release set moved with the named specs (harness.gate.releases), from the env's ckpt-env.json
    release_set: dict[str, Any] | None = None
    exact: bool = False  # --exact: only the named specs move, no companions
    #: module -> import traceback tail, for megatron.core, megatron.bridge and every moved package's
    #: modules that do not import here: on the candidate (importing on the baseline) a failing finding
    import_problems: dict[str, str] = field(default_factory=dict)


def _tail(text: str, n: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


def _harness(side: Side, args: list[str], log: Path, on_line: Callable[[str], Any] | None = None) -> int:
    """`ckpt-harness ARGS` in the side's venv, from this checkout (the same harness code in both);
    its output goes to `log`, each line also to `on_line` as it comes (the gate's progress)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd, env = [str(side.venv / "bin" / "python"), "-m", "harness.cli", *args], {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        if on_line is None:
            return subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, check=False).returncode
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                                errors="replace", bufsize=1)
        for line in proc.stdout:
            out.write(line)
            out.flush()
            on_line(line)
        return proc.wait()


def build_side(side: Side, cache: Path) -> None:
    say(f"{side.name}: building or reusing the environment ({' '.join(side.specs) or 'the pins'})")
    start = time.perf_counter()
    try:
        side.venv = envspec.ensure(side.specs, cache, ROOT, companions=not side.exact)
        env = json.loads((side.venv / envspec.ENV_JSON).read_text())
        side.release_set = env.get("release_set")
    except envspec.UnsolvableReleaseSet as exc:
        raise GateError(f"the {side.name} release set ({' '.join(side.specs)}) cannot be installed:\n"
                        + "\n".join(f"  {ln}" for ln in exc.lines)) from None
    except (envspec.EnvBuildError, ValueError, LookupError) as exc:
        raise GateError(f"the {side.name} environment ({' '.join(side.specs) or 'the pins'}) could not be built:\n{exc}") from None
    side.build_s = time.perf_counter() - start
    r = subprocess.run([str(side.venv / "bin" / "python"), "-c", "import json; from harness.report.results import versions; print(json.dumps(versions()))"],
                       cwd=ROOT, capture_output=True, text=True, check=False)
    side.versions = json.loads(r.stdout) if r.returncode == 0 else {}


def run_matrix(side: Side, matrix: Path, k: str | None, out: Path, jobs: int = 2, reuse: bool = True) -> float:
    """One side's matrix run, in its own environment: `run --jobs` and save once, load many as
    smoke runs them (a stored source is that run's, so it is never shared across sides)."""
    start = time.perf_counter()
    say(f"{side.name}: running {matrix}{f' -k {k!r}' if k else ''} (log: {out / 'run.log'})")
    progress.start(side.name, None)
    try:
        rc = _harness(side, ["run", str(matrix), "--report", str(out), "--jobs", str(jobs), "--probe-imports",
                             *([f"-k={k}"] if k else []), *([] if reuse else ["--no-reuse"])],
                      out / "run.log", on_line=lambda line: progress.case_line(side.name, line))
    finally:
        progress.finish(side.name)
    log = _tail((out / "run.log").read_text(errors="replace"))
    if not (out / "results.json").exists():
        raise GateError(f"the {side.name} matrix run exited {rc} without results:\n{log}")
    doc = compare.load(out)
    if problem := evidence.complete_problem(doc, side.name):  # a run that died is no verdict
        raise GateError(f"{problem} (exit {rc}); the end of {out / 'run.log'}:\n{log}")
    if rc not in (0, 1):
        raise GateError(f"the {side.name} matrix run exited {rc}:\n{log}")
    read_imports(side, doc)
    say(f"{side.name}: {len(doc['results'])} case(s) in {time.perf_counter() - start:.0f} s")
    return time.perf_counter() - start


def read_imports(side: Side, doc: dict[str, Any]) -> None:
    """The side's import problems as its run probed them (`run --probe-imports`); megatron.core not
    importing on the baseline leaves nothing to compare against."""
    side.import_problems = {m: _tail(tb, 12) for m, tb in (doc.get("import_problems") or {}).items()}
    if side.name == "baseline" and "megatron.core" in side.import_problems:
        raise GateError(f"megatron.core does not import in the baseline ({' '.join(side.specs) or 'the pins'}):\n"
                        f"{side.import_problems['megatron.core']}")


def reuse_baseline(side: Side, results: Path, out: Path, ids: list[str] | None = None,
                   matrix: Path | None = None) -> dict[str, Any]:
    """A baseline run made earlier (a previous gate's DIR/baseline) in place of running it again: only
    when it is a whole run of the same harness code in the same environment, copied into `out`; with
    `ids` (the gate's selection of `matrix`) cut down to them (baseline_cache.restricted). The
    selection is checked against the candidate's run once it exists (`same_selection`)."""
    doc = compare.load(results)
    if problem := evidence.complete_problem(doc, f"reused baseline ({results})"):
        raise GateError(problem)
    env = json.loads((side.venv / envspec.ENV_JSON).read_text())
    if doc.get("environment") != env:
        raise GateError(f"--baseline-results {results} was run in another environment than the baseline's "
                        f"{side.venv.name}: run the gate without it")
    if doc.get("harness") != (digest := code_digest()):
        raise GateError(f"--baseline-results {results} was run by other harness code ({doc.get('harness')}, this "
                        f"checkout is {digest}): run the gate without it")
    if ids is not None:  # baseline_cache.Refused, naming what, ends the gate as a GateError does
        doc = baseline_cache.restricted(doc, ids, results, matrix)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    (out / "reused-from").write_text(f"{results}\n")
    read_imports(side, doc)
    say(f"baseline: reusing {results} ({len(doc['results'])} case(s), of {doc.get('restricted_from', len(doc['results']))} run)")
    return doc


def same_selection(base: dict[str, Any], cand: dict[str, Any]) -> None:
    """Both sides ran the same cases (a reused baseline could have run another matrix or -k)."""
    if base.get("selected") != cand.get("selected"):
        raise GateError("the baseline and the candidate ran different selections (a --baseline-results of another "
                        "matrix or -k?): the gate compares only the same cases")


def run_cross(writer: Side, reader: Side, out: Path, rollback: bool, corpus: Path | None = None) -> tuple[Path, float]:
    """`writer` makes a corpus (or `corpus`, when one it wrote is already there: a sweep writes each
    release's corpus once for all its readers), `reader` checks it; returns the reader's report dir."""
    start = time.perf_counter()
    corpus = corpus or out / f"written-by-{writer.name}"
    report = out / f"{writer.name}-to-{reader.name}"
    if not (corpus / "manifest.json").exists():
        say(f"cross-version: the {writer.name} writes the golden corpus")
        rc = _harness(writer, ["golden", "make", str(corpus)], out / f"make-{writer.name}.log")
        if rc not in (0, 1) or not (corpus / "manifest.json").exists():
            raise GateError(f"the {writer.name} could not write the golden corpus (exit {rc}):\n"
                            f"{_tail((out / f'make-{writer.name}.log').read_text(errors='replace'))}")
    say(f"cross-version: the {reader.name} reads the {writer.name}'s corpus" + (" (rollback)" if rollback else ""))
    # the gate wrote this corpus itself, in its own directory: not a user's files (Core 0.15's .metadata
    # pickles its own MCoreMetadata class, which the weights-only screen for user corpora refuses)
    args = ["golden", "check", str(corpus), "--report", str(report), "--direction", f"{writer.name}->{reader.name}",
            "--trust-pickles"]
    rc = _harness(reader, args + (["--allow-refusal"] if rollback else []), out / f"check-{reader.name}.log")
    if rc not in (0, 1) or not (report / "results.json").exists():
        raise GateError(f"the {reader.name} could not check the {writer.name}'s corpus (exit {rc}):\n"
                        f"{_tail((out / f'check-{reader.name}.log').read_text(errors='replace'))}")
    return report, time.perf_counter() - start


def cross_findings(doc: dict[str, Any], rollback: bool, base_versions: dict | None = None,
                   cand_versions: dict | None = None) -> list[compare.Finding]:
    """A cross-version artefact that does not load green is a regression of the bump: the
    candidate cannot read what the baseline wrote, or (rollback) the baseline crashes on or
    silently misreads what the candidate wrote."""
    what = "rollback: the baseline reading candidate-written files" if rollback else "the candidate reading baseline-written files"
    out = []
    for r in doc["results"]:
        if r["status"] in GREEN:
            continue
        if (r.get("error") or "").startswith(NOT_WRITTEN):
            # the writer's failure; when the writer is the candidate, its matrix run already shows it
            kind = "disappeared" if rollback else "regression"
            out.append(compare.Finding(r["id"], kind, f"{what}: {r['error'].splitlines()[0]}", "written", "not written"))
            continue
        failed = [c["name"] for c in r.get("checks", []) if c["status"] == "failed"]
        detail = f"{what}: {r['status']}" + (f" (checks {', '.join(failed)})" if failed else "") + (
            f": {reason(r.get('error'))}" if r.get("error") else "")
        found = None if rollback else classify.cause(r, base_versions or {}, cand_versions or {})
        out.append(compare.Finding(r["id"], found[0] if found else "regression",
                                   f"{what}: {found[1]}" if found else detail, "loads", r["status"]))
    return out


def stored_corpus(reader: Side, corpus: Path, out: Path, trust_pickles: bool = False) -> tuple[Path, float]:
    """The candidate reads a corpus written earlier (CI caches one per baseline pin hash). The corpus
    is a user's directory: its pickles are read weights_only unless `trust_pickles` (--trust-pickles)."""
    start = time.perf_counter()
    report = out / f"stored-to-{reader.name}"
    args = ["golden", "check", str(corpus), "--report", str(report), "--direction", f"stored->{reader.name}"]
    rc = _harness(reader, args + (["--trust-pickles"] if trust_pickles else []), out / f"check-stored-{reader.name}.log")
    if rc not in (0, 1) or not (report / "results.json").exists():
        raise GateError(f"the {reader.name} could not check the stored corpus {corpus} (exit {rc}):\n"
                        f"{_tail((out / f'check-stored-{reader.name}.log').read_text(errors='replace'))}")
    return report, time.perf_counter() - start


def run_scale(sides: list[Side], plan: "scale.ScalePlan", out: Path, timings: dict[str, float],
              entry: baseline_cache.Entry | None = None) -> list[compare.Finding]:
    """One production shape planned in each side's environment (harness.gate.scale), diffed; the
    baseline's plan comes from (or goes into) its verified cache `entry`."""
    docs, logs = [], []
    for s in sides:
        where = out / s.name / plan.name.replace(" ", "_").replace(">", "")
        log = where.parent / f"{where.name}.log"
        cached = f"scale/{where.name}"
        if s.name == "baseline" and entry is not None and baseline_cache.restore_part(entry, cached, where):
            say(f"scale: the baseline's plan of {plan.name} comes from the cache ({entry.path / cached})")
        else:
            say(f"scale: {s.name} plans {plan.name}")
            start = time.perf_counter()
            _harness(s, plan.args(where), log)
            timings[f"scale {plan.name} {s.name}"] = time.perf_counter() - start
            if s.name == "baseline" and entry is not None:
                baseline_cache.store_part(entry, cached, where, "plan.json")
        docs.append(scale.load(where / "plan.json"))
        logs.append(log.read_text(errors="replace") if log.exists() else "")
    return scale.diff(plan, docs[0], docs[1], logs[0], logs[1])


def run_gate(candidates: list[str], baselines: list[str], matrix: Path, k: str | None, out: Path, cache: Path,
             thresholds: compare.Thresholds = compare.Thresholds(), cross: bool = True, corpus: Path | None = None,
             exact: bool = False, jobs: int = 2, reuse: bool = True, trust_pickles: bool = False,
             baseline_results: Path | None = None, fresh_baseline: bool = False, concurrent: bool | None = None,
             scale_plans: tuple = (), accept: tuple[str, ...] | list[str] = (), rerun: bool = True) -> int:
    """The gate. The baseline's run comes from the cache (harness.gate.baseline_cache) when one was
    made under the same key, else it runs (beside the candidate when `concurrent`, by default when
    the machine has 4 cores or more) and is cached; `fresh_baseline` runs it again. `accept`: the
    --accept-unevaluated patterns (evidence.decide); `rerun`: run each regressed case again on both
    sides before reporting it (`recheck`)."""
    if out.exists() and any(out.iterdir()):
        print(f"ckpt-harness: {out} is not empty; the gate writes a new directory (it never overwrites or deletes)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    sides = [Side("baseline", baselines, exact=exact), Side("candidate", candidates, exact=exact)]
    timings: dict[str, float] = {}
    findings: list[compare.Finding] = []
    cross_docs: list[tuple[str, dict]] = []
    base = cand = arch_problem = None
    cover: evidence.Coverage | None = None
    notes: list[str] = []
    start = time.perf_counter()
    try:
        if not candidates:
            raise GateError("give at least one --candidate SPEC (a version, a VCS URL at a commit, a source tree or a wheel)")
        for s in sides:  # every spec parsed before anything is built: a typo costs nothing
            for spec in s.specs:
                try:
                    envspec.parse_spec(spec, cache=cache)
                except ValueError as exc:
                    raise GateError(f"--{s.name} {spec!r}: {exc}") from None
        for s in sides:
            build_side(s, cache)
        entry = key = None
        if baseline_results is not None:
            cut = reuse_baseline(sides[0], baseline_results, out / "baseline", baseline_cache.selection(matrix, k),
                                 matrix).get("restricted_from")
            notes.append(f"- Baseline: the run given as --baseline-results `{baseline_results}` (not run by this gate"
                         + (f"; its {cut} cases cut down to this gate's selection)." if cut else ")."))
        else:
            entry, key = cached_baseline(sides[0], matrix, k, out, cache, fresh_baseline, notes)
        to_run = [s for s in sides if s.name == "candidate" or (baseline_results is None and entry is None)]
        timings.update(run_sides(to_run, matrix, k, out, jobs, reuse, concurrent, notes))
        if key is not None and entry is None:
            entry = baseline_cache.store(cache, key, out / "baseline" / "results.json", out)
            if entry is not None:
                say(f"baseline: cached as {entry.path} (key {key.digest}): the next gate with this key reuses it")
        base, cand = compare.load(out / "baseline"), compare.load(out / "candidate")
        same_selection(base, cand)
        findings = compare.compare(base, cand, thresholds) + archs.diff(base, cand)
        if rerun:
            findings = recheck(sides, matrix, findings, thresholds, out / "rerun", jobs, timings)
        arch_problem = archs.problem(base, cand)
        if cross:
            if entry is not None and baseline_cache.restore_corpus(entry, out / "cross" / "written-by-baseline"):
                say(f"cross-version: the baseline's golden corpus comes from the cache ({entry.path / 'corpus'})")
            for writer, reader, rollback in ((sides[0], sides[1], False), (sides[1], sides[0], True)):
                report, secs = run_cross(writer, reader, out / "cross", rollback)
                timings[f"cross {writer.name}->{reader.name}"] = secs
                doc = compare.load(report)
                cross_docs.append((f"{writer.name} writes, {reader.name} reads" + (" (rollback)" if rollback else ""), doc))
                findings += cross_findings(doc, rollback, sides[0].versions, sides[1].versions)
            if entry is not None:
                baseline_cache.store_corpus(entry, out / "cross" / "written-by-baseline")
        for plan in scale_plans:
            findings += run_scale(sides, plan, out / "scale", timings, entry)
        if corpus is not None:
            report, timings["stored corpus -> candidate"] = stored_corpus(sides[1], corpus, out / "cross", trust_pickles)
            doc = compare.load(report)
            cross_docs.append((f"stored corpus {corpus} ({doc['results'][0]['notes'][0] if doc['results'] else ''}), candidate reads", doc))
            findings += cross_findings(doc, rollback=False, base_versions=sides[0].versions, cand_versions=sides[1].versions)
        findings = sorted([*findings, *import_findings(sides), *evidence.shim_findings(base, cand)],
                          key=lambda f: (compare.ORDER.index(f.kind), f.case))
        code, cover = evidence.decide(base, cand, findings, accept)
        error = evidence.no_evidence(cover) if code == 2 else None
        if archs.exit_code(code, arch_problem) != code:  # "no change" is evidence only when there is a registry
            code, error = 2, f"the Megatron-Bridge architecture registry gives no evidence: {arch_problem}"
    except (GateError, compare.CompareInputError, baseline_cache.Refused) as exc:
        code, error = 2, str(exc)
    timings["total"] = time.perf_counter() - start
    for s in sides:
        timings[f"{s.name} env build"] = s.build_s
    head = [*(archs.lines(findings, arch_problem, base, cand) if base is not None and cand is not None else []), *notes]
    md = write_verdict(out, sides, findings, base, cand, cross_docs, timings, error, code, cover, head)  # .md and .html
    (out / "gate.json").write_text(json.dumps({
        "exit_code": code, "error": error, "sides": [{**asdict(s), "venv": str(s.venv)} for s in sides],
        "coverage": asdict(cover) if cover is not None else None, "notes": notes,
        "timings_s": {k: round(v, 1) for k, v in timings.items()}, "findings": [f.to_dict() for f in findings],
    }, indent=2, default=str) + "\n")
    print(md)
    return code


def cached_baseline(side: Side, matrix: Path, k: str | None, out: Path, cache: Path, fresh: bool,
                    notes: list[str]) -> tuple[baseline_cache.Entry | None, baseline_cache.Key | None]:
    """(the cache entry whose run stands in for the baseline's, copied into out/baseline | None, the key
    this gate's baseline has); what was used and why goes into `notes` (the verdict's first lines)."""
    ids = baseline_cache.selection(matrix, k)
    if ids is None or side.venv is None:
        notes.append("- Baseline: run by this gate (its selection could not be read here, so it is not cached).")
        return None, None
    key = baseline_cache.key_for(side.venv.name.removeprefix("venv-"), matrix, k, ids, code_digest(), ROOT)
    if fresh:
        notes.append(f"- Baseline: run by this gate (--fresh-baseline), cached under key `{key.digest}` ({key.describe()}).")
        return None, key
    try:  # the entry's files are checked against its sha256.json and copied into the gate's directory
        entry, why = baseline_cache.lookup(cache, key, out / baseline_cache.STAGE)
    except baseline_cache.Refused as exc:  # a changed cache is exit 2, neither used nor silently run again
        raise GateError(str(exc)) from None
    if entry is not None:
        try:
            reuse_baseline(side, entry.results, out / "baseline")
        except GateError as exc:  # the entry's env or code is not this gate's after all: run it
            entry, why = None, str(exc).split(":")[0]
    if entry is None:
        say(f"baseline: {why}; running it")
        notes.append(f"- Baseline: run by this gate ({why}), cached under key `{key.digest}` ({key.describe()}).")
        return None, key
    notes.append(f"- Baseline: **reused from the cache**, {entry.describe()}: {key.describe()}. "
                 "`--fresh-baseline` runs it again.")
    return entry, key


def run_sides(sides: list[Side], matrix: Path, k: str | None, out: Path, jobs: int, reuse: bool,
              concurrent: bool | None, notes: list[str]) -> dict[str, float]:
    """Each side's matrix run: at once when `concurrent` (None: when this machine has >= 4 cores),
    else one after the other; {'<side> matrix': seconds}."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    together = len(sides) > 1 and (concurrent if concurrent is not None else cores >= 4)
    if len(sides) > 1:
        how = (f"at once ({'--concurrent' if concurrent else f'{cores} cores'})" if together else
               f"one after the other ({'--no-concurrent' if concurrent is False else f'{cores} core(s) < 4; --concurrent overlaps them'})")
        say(f"the baseline and candidate runs go {how}")
        notes.append(f"- Sides: the baseline and candidate matrix runs went {how}.")
    if not together:
        return {f"{s.name} matrix": run_matrix(s, matrix, k, out / s.name, jobs, reuse) for s in sides}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(sides)) as pool:
        futures = {s.name: pool.submit(run_matrix, s, matrix, k, out / s.name, jobs, reuse) for s in sides}
        return {f"{name} matrix": f.result() for name, f in futures.items()}  # the baseline's error first


#: the classes a first run may owe to chance (a race, a slow rank, the allocator): confirmed by a rerun
RERUN = ("regression", "new-refusal", "defect-changed", "check-lost", "diff-growth", "memory-growth")


def recheck(sides: list[Side], matrix: Path, findings: list[compare.Finding], thresholds: compare.Thresholds,
            out: Path, jobs: int, timings: dict[str, float]) -> list[compare.Finding]:
    """Each matrix case with a finding of RERUN's classes runs again on both sides (`run --id`), and the
    two reruns are compared: a case whose rerun shows no failing finding did not reproduce, so its
    findings become one `flaky` finding (never failing, never evidence: evidence.coverage keeps it
    from SAFE). The baseline reruns too, as its green may have been a first run's luck."""
    ids = sorted({f.case for f in findings if f.kind in RERUN and "[" in f.case and not f.case.startswith("golden[")})
    if not ids:
        return findings
    docs = []
    for s in sides:
        where = out / s.name
        say(f"rerun: {s.name} runs the {len(ids)} regressed case(s) again (log: {where / 'run.log'})")
        start = time.perf_counter()
        rc = _harness(s, ["run", str(matrix), "--report", str(where), "--jobs", str(jobs),
                          *(a for i in ids for a in ("--id", i))], where / "run.log")
        timings[f"rerun {s.name}"] = time.perf_counter() - start
        if not (where / "results.json").exists():
            raise GateError(f"the {s.name}'s rerun of the regressed cases wrote no results (exit {rc}):\n"
                            f"{_tail((where / 'run.log').read_text(errors='replace'))}")
        docs.append(compare.load(where))
    again = compare.compare(docs[0], docs[1], thresholds)
    reproduced = {f.case for f in again if f.failing}
    status = [{r["id"]: r["status"] for r in d["results"]} for d in docs]
    kept, flaky = [], {}
    for f in findings:
        if f.case in ids and f.case not in reproduced and f.kind in RERUN:
            flaky.setdefault(f.case, f)
        else:
            kept.append(f)
    return kept + [compare.Finding(cid, "flaky", f"{f.kind} on the first run ({f.detail[:300]}), not reproduced on a rerun "
                                   f"(baseline {status[0].get(cid, 'absent')}, candidate {status[1].get(cid, 'absent')}): "
                                   "neither a regression nor evidence", f.base, status[1].get(cid))
                   for cid, f in sorted(flaky.items())]


def import_findings(sides: list[Side]) -> list[compare.Finding]:
    """A module the candidate cannot import where the baseline can: every user who bumps breaks."""
    base, cand = sides[0].import_problems, sides[1].import_problems
    return [compare.Finding(f"import {m}", "does-not-import", f"{m} does not import in the candidate (it does in the "
                            f"baseline): {problem.strip().splitlines()[-1]}", "imports", "does not import")
            for m, problem in cand.items() if m not in base]
