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
4. Compares (harness/gate/compare.py) and writes DIR/verdict.md (regressions first) and DIR/gate.json.
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
from typing import Any

from harness.core.result import API_MISSING, GREEN
from harness.gate import classify, compare, envspec, evidence
from harness.gate.golden import NOT_WRITTEN
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


def _harness(side: Side, args: list[str], log: Path) -> int:
    """`ckpt-harness ARGS` in the side's venv, from this checkout (the same harness code in both)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.run([str(side.venv / "bin" / "python"), "-m", "harness.cli", *args], cwd=ROOT, stdout=out,
                              stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False)
    return proc.returncode


def say(text: str) -> None:
    """One progress line on stderr (the verdict alone goes to stdout): a gate takes minutes a side."""
    print(f"gate: {text}", file=sys.stderr, flush=True)


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
    rc = _harness(side, ["run", str(matrix), "--report", str(out), "--jobs", str(jobs), "--probe-imports", *(["-k", k] if k else []),
                         *([] if reuse else ["--no-reuse"])],
                  out / "run.log")
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


def reuse_baseline(side: Side, results: Path, out: Path) -> None:
    """A baseline run made earlier (a previous gate's DIR/baseline) in place of running it again: only
    when it is a whole run of the same harness code in the same environment, copied into `out`. The
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
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    (out / "reused-from").write_text(f"{results}\n")
    read_imports(side, doc)
    say(f"baseline: reusing {results} ({len(doc['results'])} case(s))")


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


def reason(error: str | None) -> str:
    """The line of an error a reader needs: the 'API not available' line, else the exception a
    rank raised (not the 'rank N of M raised:' header), else the first line."""
    from harness.run.world import exception_of

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


def _release_sets(sides: list[Side]) -> list[str]:
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


def _side_table(sides: list[Side]) -> list[str]:
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


def run_gate(candidates: list[str], baselines: list[str], matrix: Path, k: str | None, out: Path, cache: Path,
             thresholds: compare.Thresholds = compare.Thresholds(), cross: bool = True, corpus: Path | None = None,
             exact: bool = False, jobs: int = 2, reuse: bool = True, trust_pickles: bool = False,
             baseline_results: Path | None = None) -> int:
    if out.exists() and any(out.iterdir()):
        print(f"ckpt-harness: {out} is not empty; the gate writes a new directory (it never overwrites or deletes)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    sides = [Side("baseline", baselines, exact=exact), Side("candidate", candidates, exact=exact)]
    timings: dict[str, float] = {}
    findings: list[compare.Finding] = []
    cross_docs: list[tuple[str, dict]] = []
    base = cand = None
    cover: evidence.Coverage | None = None
    start = time.perf_counter()
    try:
        if not candidates:
            raise GateError("give at least one --candidate SPEC (a version, a VCS URL at a commit, a source tree or a wheel)")
        for s in sides:  # every spec parsed before anything is built: a typo costs nothing
            for spec in s.specs:
                try:
                    envspec.parse_spec(spec)
                except ValueError as exc:
                    raise GateError(f"--{s.name} {spec!r}: {exc}") from None
        for s in sides:
            build_side(s, cache)
        if baseline_results is not None:
            reuse_baseline(sides[0], baseline_results, out / "baseline")
        for s in sides[1 if baseline_results is not None else 0:]:
            timings[f"{s.name} matrix"] = run_matrix(s, matrix, k, out / s.name, jobs, reuse)
        base, cand = compare.load(out / "baseline"), compare.load(out / "candidate")
        same_selection(base, cand)
        findings = compare.compare(base, cand, thresholds)
        if cross:
            for writer, reader, rollback in ((sides[0], sides[1], False), (sides[1], sides[0], True)):
                report, secs = run_cross(writer, reader, out / "cross", rollback)
                timings[f"cross {writer.name}->{reader.name}"] = secs
                doc = compare.load(report)
                cross_docs.append((f"{writer.name} writes, {reader.name} reads" + (" (rollback)" if rollback else ""), doc))
                findings += cross_findings(doc, rollback, sides[0].versions, sides[1].versions)
        if corpus is not None:
            report, timings["stored corpus -> candidate"] = stored_corpus(sides[1], corpus, out / "cross", trust_pickles)
            doc = compare.load(report)
            cross_docs.append((f"stored corpus {corpus} ({doc['results'][0]['notes'][0] if doc['results'] else ''}), candidate reads", doc))
            findings += cross_findings(doc, rollback=False, base_versions=sides[0].versions, cand_versions=sides[1].versions)
        findings = sorted([*findings, *import_findings(sides), *evidence.shim_findings(base, cand)],
                          key=lambda f: (compare.ORDER.index(f.kind), f.case))
        cover = evidence.coverage(base, cand, findings)
        code = evidence.exit_code(findings, cover)
        error = no_evidence(cover) if code == 2 else None
    except (GateError, compare.CompareInputError) as exc:
        code, error = 2, str(exc)
    timings["total"] = time.perf_counter() - start
    for s in sides:
        timings[f"{s.name} env build"] = s.build_s
    md = verdict_markdown(sides, findings, base, cand, cross_docs, timings, error, code, cover)
    (out / "verdict.md").write_text(md + "\n")
    (out / "gate.json").write_text(json.dumps({
        "exit_code": code, "error": error, "sides": [{**asdict(s), "venv": str(s.venv)} for s in sides],
        "coverage": asdict(cover) if cover is not None else None,
        "timings_s": {k: round(v, 1) for k, v in timings.items()}, "findings": [f.to_dict() for f in findings],
    }, indent=2, default=str) + "\n")
    print(md)
    return code


def import_findings(sides: list[Side]) -> list[compare.Finding]:
    """A module the candidate cannot import where the baseline can: every user who bumps breaks."""
    base, cand = sides[0].import_problems, sides[1].import_problems
    return [compare.Finding(f"import {m}", "does-not-import", f"{m} does not import in the candidate (it does in the "
                            f"baseline): {problem.strip().splitlines()[-1]}", "imports", "does not import")
            for m, problem in cand.items() if m not in base]


def no_evidence(cover: evidence.Coverage) -> str:
    """Why exit 2 when nothing failed: what the gate could not evaluate."""
    if not cover.evaluated and cover.baseline_red and len(cover.baseline_red) == cover.selected:
        return (f"the baseline is red on every selected case ({cover.selected} failed or errored on the baseline): "
                "there is nothing to compare the candidate against; fix the baseline or the selection")
    if not cover.evaluated:
        return ("nothing in the candidate could be evaluated on both sides (see the counts above and 'Could not "
                "evaluate'), so this gate says nothing about the candidate")
    return (f"no case of {', '.join(cover.unevaluated_kinds)} was evaluated on both sides: the gate says nothing "
            "about that kind, so it cannot call the candidate safe")


def verdict_markdown(sides: list[Side], findings: list[compare.Finding], base: dict | None, cand: dict | None,
                     cross_docs: list[tuple[str, dict]], timings: dict[str, float], error: str | None,
                     code: int | None = None, cover: evidence.Coverage | None = None) -> str:
    """verdict.md: the head and what could not be evaluated first, then what failed (an import the
    candidate broke with its traceback before anything else), then the evidence in detail."""
    code = code if code is not None else 2 if error else compare.exit_code(findings)
    failing = [f for f in findings if f.failing]
    if code == 2:
        head = "# Bump gate: COULD NOT RUN (exit 2)" if cover is None else "# Bump gate: NOT EVALUATED (exit 2)"
    elif code == 1:
        head = f"# Bump gate: NOT SAFE, {len(failing)} failing finding(s) (exit 1)"
    else:
        head = "# Bump gate: SAFE TO BUMP (exit 0)"
    lines = [head, ""]
    if cover is not None:
        lines += [*cover.lines(), ""]
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
    regressions = [f for f in failing if f.kind not in ("api-break", "does-not-import")]
    lines += _findings_section("Regressions", "a check that passed now fails, or the candidate raises where the "
                               "baseline loaded", regressions)
    lines += _findings_section("Breaking API changes", "the candidate removed or renamed an API users call: whoever "
                               "bumps hits it too (counted as failing)", [f for f in findings if f.kind == "api-break"])
    lines += _not_evaluated(findings)
    lines += _workarounds(sides, base, cand)
    if base is not None and cand is not None:
        matrix_findings = [f for f in findings if not f.case.startswith(("golden[", "import "))]
        lines += [compare.markdown(base, cand, matrix_findings, ("baseline", "candidate")).replace("## ckpt-harness compare", "## Matrix"), ""]
    for title, doc in cross_docs:
        lines += [f"## Cross-version: {title}", "", *_results_rows(doc), ""]
    lines += ["## Wall time", "", "| step | s |", "|---|---:|", *[f"| {k} | {v:.0f} |" for k, v in timings.items()]]
    return "\n".join(lines)


def _workarounds(sides: list[Side], base: dict | None, cand: dict | None) -> list[str]:
    """Which harness.compat workarounds applied on each side, and to how many cases."""
    counts: dict[str, list[int]] = {}
    for i, doc in enumerate((base, cand)):
        for r in (doc or {}).get("results") or []:
            for name in r.get("compat_shims") or []:
                counts.setdefault(name, [0, 0])[i] += 1
    if not counts:
        return []
    return ["## Workarounds applied", "", "Each applied because its probe saw the upstream condition it patches "
            "(harness/compat); one that applied on one side only is listed under Matrix.", "",
            f"| workaround | {sides[0].name} cases | {sides[1].name} cases |", "|---|---:|---:|",
            *[f"| {name} | {b} | {c} |" for name, (b, c) in sorted(counts.items())], ""]
