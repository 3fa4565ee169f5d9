"""`ckpt-harness mutate`'s command line: one campaign here, its shards, or its shards' outcomes merged.

- plain: the whole campaign in this process (mutate.campaign), resumable with the same --out;
- `--prepare`: the mutants and the measured clean run only, for shards to share;
- `--shard I/N`: the mutants numbered I modulo N, against a prepared --out (a shared filesystem);
- `--shards N --executor local|slurm`: prepare here, send N `--shard I/N` jobs through submitit
  (the cluster scheduler's executor: Slurm arrays, or local processes), wait, report;
- `--merge DIR...`: copy the outcomes of the same campaign run in other directories into --out, report;
- `--report`: the report of what --out holds, nothing run but the kills' confirmation;
- `--after DIR...`: a follow-up of the campaigns in DIR... (the same mutants): only the mutants none of
  them settled run, over this --matrix, and the report joins them all: what the union of the
  selections catches (a selection grown by new cases, measured without running the old ones again).

The report (mutate_report.py) always reads every outcome --out holds, and says first how many
mutants have none yet (a shard not run, or one that died).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from harness.gate import mutate, mutate_results
from harness.gate.progress import say


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("mutate", help="mutants of installed upstream modules against a matrix slice: the kill "
                              "rate and the blind spots (docs/mutate.md)")
    p.add_argument("--target", required=True, help="MODULE[:FUNCTIONS][,MODULE...] as installed (e.g. "
                   "megatron.core.dist_checkpointing.mapping, or megatron.core.optimizer.distrib_optimizer:*state*|*load*)")
    p.add_argument("--sample", type=int, default=None, metavar="N", help="this many of the mutants, shared equally "
                   "between the target modules (default: all)")
    p.add_argument("--seed", type=int, default=0, help="which N: the same seed gives the same mutants")
    p.add_argument("-k", default=None, help="only matrix cases whose id contains every word of this")
    p.add_argument("--matrix", type=Path, default=Path("matrices/gate.yaml"), help="default: the gate's selection")
    p.add_argument("--jobs", "-j", type=int, default=1, metavar="J", help="mutant runs at once (each runs its cases one "
                   "at a time)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S", help="seconds per case before a mutant counts as "
                   "killed by timeout")
    p.add_argument("--max-cases", type=int, default=None, metavar="N", help="run at most N of a mutant's covering cases "
                   "(a survivor then says how many it never ran; default: all)")
    p.add_argument("--no-corpus", action="store_true", help="no cross-version half: a mutant that keeps every case's "
                   "outcome does not also read the corpus the clean code wrote")
    p.add_argument("--cold", action="store_true", help="each mutant run in a fresh interpreter, not forked from a warm parent")
    p.add_argument("--triage", type=Path, default=None, metavar="FILE", help="a person's judgement of survivors "
                   "(equivalent / out-of-reach, one line why each); default harness/gate/mutant_triage.yaml; 'none': no triage")
    p.add_argument("--after", type=Path, nargs="+", default=None, metavar="DIR", help="a follow-up of the campaigns in DIR... "
                   "(same --target/--sample/--seed): run only the mutants none of them settled, over --matrix; report the union")
    p.add_argument("--out", type=Path, required=True, help="the campaign's directory (run again to resume)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--prepare", action="store_true", help="only the mutants and the measured clean run (for --shard)")
    how.add_argument("--shard", default=None, metavar="I/N", help="only the mutants numbered I modulo N (after --prepare)")
    how.add_argument("--shards", type=int, default=None, metavar="N", help="prepare, then N --shard jobs on --executor")
    how.add_argument("--merge", type=Path, nargs="+", default=None, metavar="DIR", help="the outcomes of the same "
                     "campaign in these directories, copied into --out, then the report")
    how.add_argument("--report", action="store_true", help="only the report of the outcomes --out holds (a campaign "
                     "stopped part-way says how many mutants have none); the kills are confirmed")
    p.add_argument("--executor", choices=("local", "slurm"), default="local", help="where --shards jobs run")
    p.add_argument("--partition", default=None, help="slurm: the partition")
    p.add_argument("--timeout-min", type=float, default=720.0, help="a shard job's time limit in minutes")
    p.add_argument("--slurm-arg", action="append", default=[], metavar="KEY=VALUE", help="slurm: one more sbatch option")
    p.set_defaults(func=run_cli)
    return p


def shard_argv(args: argparse.Namespace, index: int, total: int) -> list[str]:
    """The `mutate --shard I/N` command a shard job runs: this campaign's own options."""
    argv = [sys.executable, "-m", "harness.cli", "mutate", "--target", args.target, "--seed", str(args.seed),
            "--matrix", str(Path(args.matrix).resolve()), "--jobs", str(args.jobs), "--timeout", str(args.timeout),
            "--shard", f"{index}/{total}", "--out", str(args.out.resolve())]
    for flag, value in (("--sample", args.sample), ("-k", args.k), ("--max-cases", args.max_cases)):
        if value is not None:
            argv.append(f"{flag}={value}")  # `=`: a value may start with "-" (-k "->tp2pp1dp1cp1")
    return argv + (["--cold"] if args.cold else []) + (["--no-corpus"] if args.no_corpus else [])


def send_shards(args: argparse.Namespace) -> list[int | None]:
    """The shard jobs through the cluster scheduler's submitit executor; each one's exit code (None: died)."""
    from harness.orchestration.schedulers.cluster import ClusterOptions, make_executor, run_shard

    slurm = dict(a.partition("=")[::2] for a in args.slurm_arg)
    opts = ClusterOptions(executor=args.executor, shards=args.shards, timeout_min=args.timeout_min,
                          partition=args.partition, slurm=slurm)
    opts.check()
    executor = make_executor(opts, args.out.resolve() / "jobs")
    argvs = [shard_argv(args, i, args.shards) for i in range(1, args.shards + 1)]
    jobs = executor.map_array(run_shard, argvs, [{}] * len(argvs))
    say(f"mutate: {len(jobs)} shard job(s) on {args.executor}: {', '.join(j.job_id for j in jobs)}")
    codes: list[int | None] = []
    for i, job in enumerate(jobs, 1):
        try:
            codes.append(job.result())
        except Exception as exc:  # submitit: the job died, timed out or was cancelled
            codes.append(None)
            say(f"mutate: shard {i}/{args.shards} (job {job.job_id}) did not finish: {type(exc).__name__}: {str(exc)[:300]}")
    return codes


def run_cli(args: argparse.Namespace) -> int:
    from harness.gate import mutate_callers, mutate_report, mutate_triage

    targets = [t.strip() for t in args.target.split(",") if t.strip()]
    out = args.out.resolve()
    try:
        triage = mutate_triage.load(None if str(args.triage) == "none" else (args.triage or mutate_triage.DEFAULT))
        befores = [d.resolve() for d in args.after or []]
        skip = frozenset().union(*(mutate_results.follow_up(out, d) for d in befores))
        if args.report or args.merge:
            if not (out / "mutants.json").exists():
                raise mutate.MutateError(f"{out} holds no campaign (no mutants.json)")
            mutate.mutants_of(targets, args.sample, args.seed, out)  # the same campaign, or refused
            if args.merge:
                mutate_results.merge(out, args.merge)
        elif args.shards:
            mutate.campaign(targets, args.matrix, args.k, out, args.sample, args.seed, prepare_only=True,
                            corpus=not args.no_corpus)
            send_shards(args)
        else:
            mutate.campaign(targets, args.matrix, args.k, out, args.sample, args.seed, args.jobs, args.timeout,
                            args.max_cases, warm=not args.cold, shard=mutate.shard_of(args.shard), prepare_only=args.prepare,
                            corpus=not args.no_corpus, skip=skip)
            if args.prepare:
                print(f"prepared {out}: its mutants and clean run; now `--shard I/N` with the same options")
                return 0
    except (mutate.MutateError, ValueError) as exc:
        print(f"ckpt-harness mutate: {exc}", file=sys.stderr)
        return 2
    records, missing = mutate_results.records_of(out)
    missing = [m for m in missing if m["index"] not in skip]
    stable, whole = None, None
    if not args.shard and mutate.clean_done(out):  # shards share DIR: the campaign's own report confirms, once
        stable = mutate_results.confirm(out, args.matrix, mutate.compare.load(out / "clean"), records)
        whole = mutate_results.population(targets, out, befores)
    for before in befores:  # each side's kills confirmed by its own runs (DIR/confirm.json), then joined
        earlier = json.loads((before / "confirm.json").read_text()) if (before / "confirm.json").exists() else {}
        stable = {**earlier, **stable} if stable is not None else None
        records = mutate_results.union(records, mutate_results.records_of(before)[0], before)
    records = mutate_callers.mark(records)
    summary = mutate_report.write(records, out, targets, missing, stable, whole, triage)
    print((out / "mutate.md").read_text().split("\n## ")[0])
    return 0 if summary["covered"] else 2
