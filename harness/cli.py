"""`ckpt-harness`: run a matrix for CI or by hand.

Exit codes: 0 every case passed or failed as a named xfail (cases the machine cannot run are
`not-run`, cases the release under test lacks an API for are `not-applicable`, both counted apart,
listed with their reason); 1 a case failed or errored; 2 bad input (a
matrix, a results file); 3 `--fail-on-not-run` and some case was not run; 4 no case matches `-k`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape


def _cmd_list(args: argparse.Namespace) -> int:
    from harness.orchestration.matrix import load_matrix
    from harness.orchestration.schedulers._flags import scheduler_of

    m = load_matrix(args.matrix, args.max_world)
    try:
        specs = scheduler_of(args).select(m.select(args.k))
    except ValueError as exc:
        print(f"ckpt-harness list: {exc}", file=sys.stderr)
        return 2
    if args.gpus_per_node:
        return _print_plan(specs, args)
    for spec in specs:
        print(spec.id + "".join(f"  # {n}" for n in spec.notes))
    return 0


def _print_plan(specs: list, args: argparse.Namespace) -> int:
    from harness.orchestration.schedulers import _balance, packing

    jobs = packing.jobs_of(specs, _balance.durations_of(args.durations) if args.durations else None)
    print("\n".join(packing.plan_lines(jobs, packing.plan(jobs, args.gpus_per_node))))
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    from harness.report import merge

    try:
        expected, title = None, None
        if args.matrix:
            from harness.orchestration.matrix import load_matrix

            matrix = load_matrix(args.matrix, args.max_world)
            expected, title = [s.id for s in matrix.select(args.k)], f"{matrix.name} ({args.matrix})"
        doc = merge.merge([merge.read_part(p) for p in args.parts], expected)
        files = merge.render(doc, title or str(doc.get("matrix")))  # all of it before any is written
    except ValueError as exc:  # MergeError, or a matrix that does not load
        print(f"ckpt-harness merge: {exc}", file=sys.stderr)
        return 2
    merge.write(files, args.out)
    print(f"merged {len(args.parts)} part(s), {len(doc['results'])} cases: {doc['summary']} -> {args.out} ({', '.join(files)})")
    bad = doc["summary"].get("failed", 0) + doc["summary"].get("error", 0)
    return 1 if bad else 0


def _cmd_run(args: argparse.Namespace) -> int:
    """`run`; -v sets CKPT_HARNESS_VERBOSE (ranks, workers and noise filters read it) for this run only."""
    from harness.run import ranklog

    before = os.environ.get(ranklog.VERBOSE_ENV)
    os.environ.update({ranklog.VERBOSE_ENV: "1"} if args.verbose else {})
    try:
        return _run(args)
    finally:  # an in-process caller's later runs stay quiet
        os.environ.pop(ranklog.VERBOSE_ENV, None) if before is None else os.environ.update({ranklog.VERBOSE_ENV: before})


def _run(args: argparse.Namespace) -> int:
    from harness.orchestration.matrix import load_matrix
    from harness.orchestration.runner import RunOptions, run_cases
    from harness.orchestration.schedulers._flags import scheduler_of
    from harness.report import results as report
    from harness.run import ranklog

    console = _console()
    matrix = load_matrix(args.matrix, args.max_world)
    try:  # the scheduler by name (--scheduler, else what --shard, --gpus-per-node, --jobs imply)
        scheduler, selected = scheduler_of(args), matrix.select(args.k, args.id)
        specs = scheduler.select(selected)
    except ValueError as exc:
        console.print(f"[red]{escape(str(exc))}[/]")
        return 2
    if not specs:
        console.print(f"[red]no case of {args.matrix} matches -k {args.k!r}[/]")
        return 4
    part = f" (shard {args.shard})" if args.shard else ""
    console.print(f"[bold]{matrix.name}[/]: {len(specs)} case(s) from {args.matrix}{part}")
    log_root, temporary_logs = ranklog.run_root(args.report, args.workdir)
    options = RunOptions(
        dist_backend=args.dist_backend, workdir=args.workdir, keep=args.keep,
        launcher=args.launcher, torchrun_template=args.torchrun_template, start_method=args.start_method,
        rank_hooks=tuple(args.rank_hook), reuse=not args.no_reuse, log_dir=log_root,
    )
    start = time.perf_counter()
    finished = []
    report_path = Path(args.report) / "results.json" if args.report else None

    def progress(r) -> None:
        finished.append(r)
        if report_path:  # after every case: a run killed half-way keeps what it finished
            report.write_json(finished, report_path, str(args.matrix), time.perf_counter() - start, complete=False, **about)
        style = {"passed": "green", "xfailed": "yellow", "not-run": "cyan", "not-applicable": "cyan"}.get(r.status, "bold red")
        console.print(f"[{len(finished)}/{len(specs)}] [{style}]{r.status.upper():8}[/] {escape(r.id)}  {r.phases.get('total', 0):.1f}s"
                      + (f"  gpus {','.join(map(str, r.placement['gpus']))}" if r.placement else "")
                      + (f"  ({escape(r.hole_reason or '')})" if r.hole_reason else ""), highlight=False)

    # Plain lines, no live display: a refresh thread in the parent is unsafe when ranks fork.
    if args.jobs < 1:
        console.print(f"[red]--jobs must be >= 1, got {args.jobs}[/]")
        return 2
    about = {"selected": [s.id for s in specs], "harness": report.code_digest()}
    if args.probe_imports:  # what fails goes into results.json (the gate reads it)
        from harness.run.preload import import_problems
        about["import_problems"] = import_problems(report.moved_from_pins())
        from harness.gate import archs  # the HF architectures the Bridge registers (the gate diffs them)
        about[archs.KEY] = archs.probe()
        for module in about["import_problems"]:
            console.print(f"[bold red]{module} does not import in this environment[/] (its traceback is in results.json)")
    if report_path:  # before any case: a run that dies in its first case still names what it was asked
        report.write_json([], report_path, str(args.matrix), 0.0, complete=False, **about)
    try:
        results = run_cases(selected, options, on_result=progress, scheduler=scheduler)
    except ValueError as exc:  # jobs > 1 with NCCL or torchrun; a node bigger than the GPUs seen
        console.print(f"[red]{escape(str(exc))}[/]")
        return 2
    finally:
        logs = ranklog.finish_run(log_root, temporary_logs, keep=args.keep or any(r.status in ("failed", "error") for r in finished))
    wall = time.perf_counter() - start
    code = _summarize(results, f"{matrix.name} ({args.matrix})", wall, report_path, str(args.matrix), console,
                      fail_on_not_run=args.fail_on_not_run, about=about)
    if logs:
        console.print(f"logs: {logs}", highlight=False)
    if args.html:
        from harness.report import html as html_report

        doc = report.document(results, str(args.matrix), wall)
        console.print(f"html: {html_report.write(doc, args.html, f'{matrix.name} ({args.matrix})')}")
    if args.junit:
        console.print(f"junit: {report.write_junit(results, args.junit, f'{matrix.name} ({args.matrix})', wall)}")
    return code


def _console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 200)


def _summarize(results, title: str, wall: float, report_path: Path | None, label: str, console: Console | None = None,
               fail_on_not_run: bool = False, about: dict | None = None) -> int:
    """The summary table, results.json when asked, and the exit code: 0 when every case is green,
    not-run or not-applicable (1 on a failure or error; 3 when a case was not run and `fail_on_not_run`)."""
    from harness.core.result import GREEN, HOLES
    from harness.report import results as report

    console = console or _console()
    report.print_summary(results, title, wall, console)
    if report_path:
        console.print(f"results: {report.write_json(results, report_path, label, wall, **(about or {}))}")
    if any(r.status not in (*GREEN, *HOLES) for r in results):
        return 1
    if fail_on_not_run and any(r.status == "not-run" for r in results):
        console.print("[bold red]--fail-on-not-run: this machine could not run every case (reasons above)[/]")
        return 3
    return 0


def _cmd_golden(args: argparse.Namespace) -> int:
    from harness.gate import golden
    from harness.orchestration.runner import RunOptions

    start = time.perf_counter()
    options = RunOptions(dist_backend=args.dist_backend)
    try:
        if args.action == "make":
            results = golden.make(args.dir, options, args.k, ids=args.id)
        else:
            results = golden.check(args.dir, options, args.k, args.allow_refusal, args.direction, trust_pickles=args.trust_pickles,
                                   ids=args.id)
    except golden.CorpusError as exc:
        print(f"ckpt-harness: {exc}", file=sys.stderr)
        return 2
    title = f"golden {args.action} {args.dir}"
    return _summarize(results, title, time.perf_counter() - start, args.report / "results.json" if args.report else None, title)


def _cmd_gate(args: argparse.Namespace) -> int:
    from harness.gate import envspec
    from harness.gate import scale
    from harness.gate.bump import run_gate

    cache = args.cache or envspec._default_cache()
    return run_gate(args.candidate, args.baseline, args.matrix, args.k, args.out, cache, _thresholds(args), cross=not args.skip_cross,
                    corpus=args.corpus, exact=args.exact, jobs=args.jobs, reuse=not args.no_reuse, trust_pickles=args.trust_pickles,
                    baseline_results=args.baseline_results, fresh_baseline=args.fresh_baseline, concurrent=args.concurrent,
                    scale_plans=() if args.no_scale else scale.PLANS, accept=args.accept_unevaluated,
                    rerun=not args.no_rerun)


def _cmd_sweep(args: argparse.Namespace) -> int:
    from harness.gate import sweep
    from harness.gate.sweep import driver as sweep_driver

    def driver(specs, matrix, k, out_dir):
        return sweep_driver.driver(specs, matrix, k, out_dir, cache=args.cache, jobs=args.jobs)

    def cross_driver(writer, reader, rollback, out_dir):
        return sweep_driver.cross_driver(writer, reader, rollback, out_dir, cache=args.cache)

    return sweep.run_cli(args, driver, cross_driver)


def _cmd_show(args: argparse.Namespace) -> int:
    import json

    from harness.report import results as report

    try:
        doc = json.loads(args.results.read_text())
        if args.html:
            from harness.report import html as html_report

            title = f"ckpt-harness: {doc.get('matrix') or args.results}"
            print(f"html: {html_report.write(doc, args.html, title)}")
            return 0
        print(report.markdown(doc))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"ckpt-harness: {args.results} is not a readable results.json: {exc!r}", file=sys.stderr)
        return 2
    return 0


def _add_max_world(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-world", type=int, default=None, metavar="N",
                   help="cut every topology above N ranks to fit (dp first, then cp, pp, tp; harness/core/cut.py); "
                        "cases that collapse run once, each notes the pair it was written as")


def _add_thresholds(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-pct", type=float, default=10.0, help="memory growth must exceed this %% ...")
    p.add_argument("--memory-mib", type=float, default=32.0, help="... and this many MiB to fail")
    p.add_argument("--diff-factor", type=float, default=10.0, help="toleranced diff growth factor that fails")


def _add_accept(p: argparse.ArgumentParser) -> None:
    p.add_argument("--accept-unevaluated", action="append", default=[], metavar="PATTERN",
                   help="accept, by name, cases green on the baseline that have no real result on the candidate (an "
                        "fnmatch glob or a substring of the case id; repeatable): listed in the verdict, no longer "
                        "keeping it from SAFE. Without it every such case does (exit 2)")


def _thresholds(args: argparse.Namespace):
    from harness.gate import compare

    return compare.Thresholds(args.memory_pct, args.memory_mib, args.diff_factor)


def _cmd_envs(args: argparse.Namespace) -> int:
    from harness.gate import envs, envspec
    from harness.gate.bump import ROOT

    return envs.run_cli(args.action, args.cache or envspec._default_cache(), ROOT, args.older_than, args.dry_run)


def _cmd_compare(args: argparse.Namespace) -> int:
    from harness.gate import compare, evidence

    try:
        code, md = evidence.run_compare(args.base, args.candidate, args.out, _thresholds(args), args.accept_unevaluated)
        if args.out is not None:  # compare.html beside compare.md: the gate's verdict.html page
            from harness.gate import verdict_html

            verdict_html.write_compare(args.out)
    except compare.CompareInputError as exc:
        print(f"ckpt-harness compare: {exc}", file=sys.stderr)
        return 2
    print(md)
    return code


def _cmd_explore(args: argparse.Namespace) -> int:
    """Exit 0 when every drawn triple passed, 1 when one failed (the minimal one is printed)."""
    from harness.orchestration.explore import explore

    def progress(n, ex) -> None:
        extra = (f" {ex.options}" if ex.options else "") + (f" (known: {ex.excused})" if ex.excused else "")
        print(f"[{n}] {ex.status.upper():7} {ex.model['name']} {ex.source} -> {ex.target}  {ex.seconds:.1f}s{extra}", flush=True)

    rep = explore(args.budget, args.seed, args.max_world, args.report, on_example=progress, kind=args.kind,
                  hf_pad_vocab=not args.no_hf_pad_vocab, lora_known_defects=args.lora_known_defects)
    print(f"explore: {len(rep.examples)} example(s) in {rep.wall_s:.0f} s (stopped by {rep.stopped_by}), "
          f"{len(rep.failures)} failing; report {args.report or 'a temp dir'}")
    if rep.minimal is None:
        return 0
    m = rep.minimal
    print(f"minimal failing triple: {m.source} -> {m.target} with {m.model}\n{m.failure}")
    print(f"add to harness/core/zoo.py ZOO:\n    {rep.zoo_entry}\nthen this matrix entry reproduces it:\n{rep.matrix_entry}")
    return 1


def main(argv: list[str] | None = None) -> int:
    from harness.compat.cuda import guard_megatron_import

    guard_megatron_import()  # before anything imports megatron.core (see its reason)
    from harness.orchestration.schedulers._flags import add_flags as add_scheduling_flags

    parser = argparse.ArgumentParser(prog="ckpt-harness", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a matrix and print a summary")
    run.add_argument("matrix", type=Path)
    run.add_argument("-k", default=None, help="only cases whose id contains every word of this")
    run.add_argument("--id", action="append", default=[], metavar="CASE_ID",
                     help="only this exact case id (repeatable; an id the matrix lacks is an error)")
    run.add_argument("--report", type=Path, default=None, help="write DIR/results.json")
    run.add_argument("--dist-backend", choices=("auto", "gloo", "nccl"), default="auto")
    run.add_argument("--workdir", type=Path, default=None, help="parent of per-case scratch dirs (default: system temp)")
    run.add_argument("--keep", action="store_true", help="keep checkpoints and scratch dirs")
    run.add_argument("-v", "--verbose", action="store_true", help="rank output, library logs and warnings on the terminal "
                     "(as CKPT_HARNESS_VERBOSE=1); else each case's go to files under --report DIR/logs (no --report: "
                     "a ckpt-harness-logs-* temp dir, kept when a case fails)")
    run.add_argument("--launcher", choices=("mp", "torchrun"), default="mp",
                     help="start ranks with torch.multiprocessing (default) or torchrun")
    run.add_argument("--torchrun-template", default=None,
                     help="multi-node: e.g. 'srun -N2 torchrun --nnodes 2 --nproc-per-node {nproc_per_node} "
                          "--rdzv-backend c10d --rdzv-endpoint HEAD:29500' (set CKPT_HARNESS_NODES; --workdir on a shared fs)")
    run.add_argument("--html", type=Path, default=None, help="also write one self-contained HTML report to this file")
    run.add_argument("--junit", type=Path, default=None, help="also write JUnit XML to this file (CI test views)")
    run.add_argument("--start-method", choices=("auto", "fork", "spawn", "forkserver"), default="auto",
                     help="how mp ranks start (auto: fork for gloo, measured fastest; spawn for NCCL)")
    run.add_argument("--rank-hook", action="append", default=[], metavar="MODULE:FUNCTION",
                     help="run this function in every rank before the case (fault injection, plugins; repeatable)")
    _add_max_world(run)
    run.add_argument("--jobs", "-j", type=int, default=1, metavar="N",
                     help="run N cases at once in forked workers (gloo + mp launcher only; scripts/smoke uses 2)")
    run.add_argument("--no-reuse", action="store_true",
                     help="every case runs its own source worlds (default: a source several cases share is saved once per run)")
    run.add_argument("--probe-imports", action="store_true", help="first import megatron.core/.bridge and every moved package")
    run.add_argument("--fail-on-not-run", action="store_true",
                     help="exit 3 when a case is not-run (the machine lacks CUDA devices, NCCL, TE, memory): a GPU job whose runner lost its GPUs goes red")
    add_scheduling_flags(run)
    run.set_defaults(func=_cmd_run)
    ls = sub.add_parser("list", help="list the case ids of a matrix")
    ls.add_argument("matrix", type=Path)
    ls.add_argument("-k", default=None)
    _add_max_world(ls)
    add_scheduling_flags(ls, run=False)
    mg = sub.add_parser("merge", help="one report (results.json/.md, junit.xml, report.html) from the results of a matrix's shards")
    mg.add_argument("parts", type=Path, nargs="+", help="the shards' results.json files or report dirs")
    mg.add_argument("--out", type=Path, required=True,
                    help="write DIR/results.json, results.md, junit.xml and report.html (nothing when the parts are refused)")
    mg.add_argument("--matrix", type=Path, default=None, help="check every case the matrix selects is in exactly one part")
    mg.add_argument("-k", default=None)
    _add_max_world(mg)
    mg.set_defaults(func=_cmd_merge)
    ls.set_defaults(func=_cmd_list)
    from harness.gate import gate_args

    gate = gate_args.add_parser(sub)
    _add_thresholds(gate)
    _add_accept(gate)
    gate.set_defaults(func=_cmd_gate)
    from harness.gate import sweep

    sweep.add_parser(sub).set_defaults(func=_cmd_sweep)
    gold = sub.add_parser("golden", help="write (make) or load and check (check) the golden corpus of on-disk artefacts")
    gold.add_argument("action", choices=("make", "check"))
    gold.add_argument("dir", type=Path, help="make: a new directory to write; check: a corpus made earlier")
    gold.add_argument("-k", default=None, help="only artefacts whose id contains every word of this")
    gold.add_argument("--id", action="append", default=None, metavar="ID", help="only the artefact of this check id, "
                      "as `check` names it without --direction (repeatable)")
    gold.add_argument("--report", type=Path, default=None, help="write DIR/results.json")
    gold.add_argument("--dist-backend", choices=("auto", "gloo", "nccl"), default="auto")
    gold.add_argument("--allow-refusal", action="store_true",
                      help="check: a load that raises a named exception passes as a clean refusal (a rollback)")
    gold.add_argument("--direction", default="", help="check: a suffix for the case ids (the gate names its directions)")
    gold.add_argument("--trust-pickles", action="store_true",
                      help="check: unpickle the corpus in full (megatron-core's loader does) even where weights_only loading "
                           "refuses a file; only for a corpus you trust, a pickle can run code")
    gold.set_defaults(func=_cmd_golden)
    show = sub.add_parser("show", help="print a results.json as a Markdown table")
    show.add_argument("results", type=Path)
    show.add_argument("--html", type=Path, default=None, help="write the results as one self-contained HTML report instead")
    show.set_defaults(func=_cmd_show)
    cmp = sub.add_parser("compare", help="baseline vs candidate results, judged as the gate judges: exit 1 on a failing "
                         "finding, 2 when the evidence does not cover the baseline's green cases")
    cmp.add_argument("base", type=Path, help="baseline results.json or report dir")
    cmp.add_argument("candidate", type=Path, help="candidate results.json or report dir")
    cmp.add_argument("--out", type=Path, default=None, help="write DIR/compare.json, DIR/compare.md and DIR/compare.html")
    _add_thresholds(cmp)
    _add_accept(cmp)
    cmp.set_defaults(func=_cmd_compare)
    from harness.gate import bisect as bisect_cmd

    bisect_cmd.add_parser(sub).set_defaults(func=lambda args: bisect_cmd.run_cli(args))
    from harness.gate import mutate_cli as mutate

    mutate.add_parser(sub)  # sets its own func (mutate.run_cli)
    env = sub.add_parser("envs", help="list the built environments (own disk, shared store) or prune them")
    env.add_argument("action", choices=("list", "prune"))
    env.add_argument("--cache", type=Path, default=None, help="default: $CKPT_HARNESS_HOME or ~/.cache/ckpt-harness")
    env.add_argument("--older-than", type=float, default=0.0, metavar="DAYS", help="prune: keep envs used more recently")
    env.add_argument("--dry-run", action="store_true", help="prune: say what would go, remove nothing")
    env.set_defaults(func=_cmd_envs)
    exp = sub.add_parser("explore", help="hypothesis search of (model shape, S, D) triples through reshard-weights")
    exp.add_argument("--budget", type=float, default=60.0, help="seconds of wall time to draw examples in (shrinking gets as much again)")
    exp.add_argument("--seed", type=int, default=None, help="hypothesis seed: the same seed draws the same triples")
    exp.add_argument("--max-world", type=int, default=4, help="largest world size a topology may have")
    exp.add_argument("--report", type=Path, default=None, help="DIR/explore.json and DIR/hypothesis (the example database)")
    exp.add_argument("--kind", choices=("gpt", "hf", "lora"), default="gpt",
                     help="gpt: GPT shapes through reshard-weights; hf: HF fixtures through hf-roundtrip; lora: LoRA layouts, peft-export")
    exp.add_argument("--no-hf-pad-vocab", action="store_true",
                     help="hf: never draw pad_vocab (look past the known Bridge export defect, docs/explore.md)")
    exp.add_argument("--lora-known-defects", action="store_true", help="lora: draw and count the defects the matrices name")
    exp.set_defaults(func=_cmd_explore)
    from harness.orchestration.schedulers import cluster

    cluster.add_parser(sub)  # the `cluster` extra, imported only when the command runs
    from harness.orchestration import bench
    bench.add_parser(sub)  # sets its own func (bench.run_cli)
    from harness.plan import cli as plan_cli
    plan_cli.add_parser(sub)  # sets its own func (plan_cli.run_cli)
    from harness.inspect import cli as inspect_cli
    inspect_cli.add_parsers(sub)  # `inspect` and `check-load` (their own funcs)
    args = parser.parse_args(argv)
    from harness.orchestration.matrix import MatrixError

    try:
        return args.func(args)
    except MatrixError as exc:
        print(f"ckpt-harness: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
