"""The cluster scheduler: matrix cells across a cluster (issue 20 item 4). `ckpt-harness cluster run MATRIX` sends the
shards of `run --shard I/N` (schedulers._balance) as the jobs of a submitit executor --
Slurm, or local processes for tests and one box -- waits for them and merges their results
(harness.report.merge) into one report. With `--nodes N` > 1 every shard job holds N nodes and
starts each world of its cases as nodes x ranks: torchrun agents meeting through the c10d
rendezvous (harness.run.nodes), so TP x PP x DP worlds larger than one node run.

submitit is the optional `cluster` extra (`pip install 'ckpt-harness[cluster]'`), imported lazily:
the default paths never import it. NeMo-Run 0.11.1 was the first choice and does not install
beside the pins (docs/cluster.md says exactly why).

Each shard job runs `python -m harness.cli run MATRIX --shard I/N --report PARTS/shard-I` in a
subprocess, so a shard is the same command a CI runner runs; a shard with a failed case (exit 1)
is a finished shard, one that died leaves no complete results.json and the merge names it.

As a scheduler (`run --scheduler cluster --executor slurm --shards N`, or runner.run_cases with it),
the same balanced parts go as jobs of the executor that each run their cases through an inner
scheduler (serial, pool or packing, as the other flags say) and send the CaseResults back, merged
here in matrix order; a part whose job died comes back as `error` results naming the job and its log.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from harness.core.result import CaseResult
from harness.orchestration.schedulers import Scheduler, Settings, inner_of
from harness.orchestration.schedulers._balance import split as balanced_split
from harness.orchestration.schedulers._common import bare
from harness.run.nodes import EXECUTORS, ClusterExtraMissing, import_submitit, template


@dataclass(frozen=True)
class ClusterOptions:
    """Where and how the shards run."""

    executor: str = "local"  # local | slurm
    shards: int = 1
    nodes: int = 1  # nodes per shard job; > 1: every world through harness.run.nodes
    gpus_per_node: int = 0  # what each node asks Slurm for (0: a CPU job)
    cpus_per_node: int | None = None  # slurm: CPUs each node asks for (the shard is one task a node)
    ranks_per_node: int | None = None  # most ranks a node takes (default: gpus_per_node)
    timeout_min: float = 120.0  # a shard job's time limit
    partition: str | None = None
    slurm: dict[str, str] = field(default_factory=dict)  # more sbatch options (--slurm-arg KEY=VALUE)
    max_parallel: int | None = None  # slurm: array jobs at once

    def per_node(self) -> int:
        return self.ranks_per_node or self.gpus_per_node or 1

    def check(self) -> None:
        """ValueError naming the option when it cannot make a run."""
        if self.executor not in EXECUTORS:
            raise ValueError(f"--executor {self.executor!r}: one of {', '.join(EXECUTORS)}")
        for name in ("shards", "nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.gpus_per_node < 0 or (self.ranks_per_node is not None and self.ranks_per_node < 1):
            raise ValueError(f"--gpus-per-node {self.gpus_per_node} / --ranks-per-node {self.ranks_per_node}: "
                             "GPUs >= 0, ranks >= 1")
        if self.nodes > 1 and not (self.ranks_per_node or self.gpus_per_node):
            raise ValueError(f"--nodes {self.nodes}: say how many ranks a node takes (--gpus-per-node or --ranks-per-node)")
        if self.executor == "local" and self.gpus_per_node and self.shards > 1:
            raise ValueError(f"--executor local --shards {self.shards} --gpus-per-node {self.gpus_per_node}: local shards "
                             "share this machine's GPUs; use --shards 1 (it packs its cases onto them)")


def shard_argv(matrix: Path, index: int, total: int, part: Path, opts: ClusterOptions, k: str | None = None,
               max_world: int | None = None, workdir: Path | None = None, run_args: Sequence[str] = (),
               durations: Path | None = None) -> list[str]:
    """The command one shard job runs: `ckpt-harness run` on part `index` of `total`."""
    argv = [sys.executable, "-m", "harness.cli", "run", str(matrix), "--shard", f"{index}/{total}", "--report", str(part)]
    argv += [f"-k={k}"] if k else []  # `=`: a -k may start with "-"
    argv += ["--durations", str(durations)] if durations else []
    argv += ["--max-world", str(max_world)] if max_world else []
    argv += ["--workdir", str(workdir)] if workdir else []
    if opts.nodes > 1:
        argv += ["--launcher", "torchrun", "--torchrun-template", template(opts.executor, opts.per_node(), opts.nodes)]
    elif opts.gpus_per_node:  # one node: the shard packs its cases onto the node's GPUs (the packing scheduler)
        argv += ["--gpus-per-node", str(opts.gpus_per_node)]
    return argv + list(run_args)


def run_shard(argv: list[str], env: dict[str, str | None]) -> int:
    """A shard job's body (pickled by submitit): the shard's `ckpt-harness run`; its exit code (1, a
    failed case, is a finished shard). `env` sets (None: removes) variables of the job's environment."""
    child = dict(os.environ)
    for key, value in env.items():
        if value is None:
            child.pop(key, None)
        else:
            child[key] = value
    print(f"shard: {' '.join(argv)}", flush=True)
    return subprocess.run(argv, env=child, check=False).returncode


def make_executor(opts: ClusterOptions, folder: Path):
    """The submitit executor of `opts` (job files and logs under `folder`)."""
    submitit = import_submitit()
    if opts.executor == "local":
        executor = submitit.LocalExecutor(folder=folder)
        executor.update_parameters(timeout_min=opts.timeout_min)
        return executor
    try:
        executor = submitit.SlurmExecutor(folder=folder)
    except RuntimeError as exc:  # no srun on PATH
        raise ValueError(f"--executor slurm: {exc} (run `cluster run` where sbatch and srun are)") from None
    params: dict = {"nodes": opts.nodes, "ntasks_per_node": 1, "time": max(1, int(opts.timeout_min)),
                    "job_name": "ckpt-harness", "use_srun": False}  # the shard runs once, on the first node
    if opts.gpus_per_node:
        params["gpus_per_node"] = opts.gpus_per_node
    if opts.cpus_per_node:
        params["cpus_per_task"] = opts.cpus_per_node  # one task a node: its ranks share these
    if opts.partition:
        params["partition"] = opts.partition
    if opts.max_parallel:
        params["array_parallelism"] = opts.max_parallel
    if opts.slurm:
        params["additional_parameters"] = dict(opts.slurm)
    executor.update_parameters(**params)
    return executor


def _job_env(opts: ClusterOptions) -> dict[str, str | None]:
    """The environment a shard gets beyond the executor's: locally, the GPUs this process sees
    (the LocalExecutor hides them all); on Slurm, what the allocation sets."""
    if opts.executor == "local":
        return {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}
    return {}


def _log_tail(job, lines: int = 20) -> str:
    try:
        text = (job.stderr() or "") + (job.stdout() or "")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def run_matrix(matrix: Path, out: Path, opts: ClusterOptions, k: str | None = None, max_world: int | None = None,
               workdir: Path | None = None, run_args: Sequence[str] = (), durations: Path | None = None,
               log=print) -> tuple[int, dict | None]:
    """Send the shards, wait, merge into OUT (results.json/.md, junit.xml, report.html: what `merge`
    writes). Returns (exit code,
    merged document): 0 all green, 1 a case failed or errored, 2 a shard died or bad input, 3 a
    shard's `--fail-on-not-run` tripped, 4 no case matches `k` (as `ckpt-harness run`)."""
    from harness.orchestration.matrix import load_matrix
    from harness.orchestration.schedulers import _balance as shard
    from harness.report import merge as merging

    opts.check()
    import_submitit()  # before anything is written: the extra missing is a clear error, not a half-made OUT
    matrix, out = Path(matrix).resolve(), Path(out).resolve()
    loaded = load_matrix(matrix, max_world)
    specs = loaded.select(k)
    ids = [s.id for s in specs]
    if not ids:
        log(f"ckpt-harness cluster: no case of {matrix} matches -k {k!r}")
        return 4, None
    durations = Path(durations).resolve() if durations else None
    total = opts.shards  # the split each shard computes again; an empty part (cases sharing a source stay together) gets no job
    split = shard.split(specs, total, shard.durations_of(durations) if durations else None)
    numbers = [i for i in range(1, total + 1) if split[i - 1]]
    if workdir is None and opts.executor == "slurm" and opts.nodes > 1:
        workdir = out / "work"  # ranks on other nodes write their results there: a shared filesystem
    parts = [out / "parts" / f"shard-{i}" for i in numbers]
    argvs = [shard_argv(matrix, i, total, part, opts, k, max_world, workdir, run_args, durations) for i, part in zip(numbers, parts)]
    executor = make_executor(opts, out / "jobs")
    start = time.perf_counter()
    jobs = executor.map_array(run_shard, argvs, [_job_env(opts)] * len(argvs))
    log(f"{len(ids)} case(s) of {matrix.name} in {len(jobs)} shard job(s) on {opts.executor}"
        f" ({opts.nodes} node(s) each): {', '.join(j.job_id for j in jobs)}; logs in {out / 'jobs'}")
    codes: list[int | None] = []
    for i, job in zip(numbers, jobs):
        try:
            # with several nodes only task 0 reports (the other tasks' results never come)
            codes.append((job.task(0) if opts.nodes > 1 else job).result())
        except Exception as exc:  # submitit: the job died, timed out or was cancelled
            codes.append(None)
            log(f"shard {i}/{total} (job {job.job_id}) did not finish: {type(exc).__name__}: {str(exc)[:500]}\n{_log_tail(job)}")
    wall = time.perf_counter() - start
    record = {"options": asdict(opts), "matrix": str(matrix), "k": k, "wall_s": wall,
              "jobs": [{"shard": f"{i}/{total}", "job_id": j.job_id, "exit_code": c, "part": str(part),
                        "stdout": str(j.paths.stdout), "stderr": str(j.paths.stderr)}
                       for i, part, j, c in zip(numbers, parts, jobs, codes)]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    try:
        doc = merging.merge([merging.read_part(p / "results.json") for p in parts], ids)
        files = merging.render(doc, f"{loaded.name} ({matrix})")  # all of it before any is written, as `merge`
    except merging.MergeError as exc:
        for i, job, c in zip(numbers, jobs, codes):
            if c not in (None, 0, 1, 3):  # None: told above
                log(f"shard {i}/{total} (job {job.job_id}) exited {c}:\n{_log_tail(job)}")
        log(f"ckpt-harness cluster: the shards do not make one run: {exc}")
        return 2, None
    merging.write(files, out)
    log(f"merged {len(parts)} shard(s), {len(doc['results'])} cases in {wall:.0f} s: {doc['summary']} -> {out} ({', '.join(files)})")
    bad = doc["summary"].get("failed", 0) + doc["summary"].get("error", 0)
    return (1 if bad else 3 if 3 in codes else 0), doc  # 3: a shard's `run --fail-on-not-run` found a case not run


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (an sbatch option without its dashes), got {text!r}")
    return key.replace("-", "_"), value


def add_parser(sub) -> argparse.ArgumentParser:
    """`ckpt-harness cluster run|template` (registered by harness.cli)."""
    p = sub.add_parser("cluster", help="run a matrix's shards as Slurm (or local) jobs and merge them; "
                       "worlds beyond one node (the cluster extra)")
    verbs = p.add_subparsers(dest="cluster_command", required=True)
    run = verbs.add_parser("run", help="send the shards of a matrix as jobs, wait, merge their results into one report")
    run.add_argument("matrix", type=Path)
    run.add_argument("--out", type=Path, required=True, help="the merged report (as `merge`), cluster.json, parts/, jobs/ "
                     "(on Slurm: a directory every node sees)")
    run.add_argument("-k", default=None, help="only cases whose id contains every word of this")
    run.add_argument("--max-world", type=int, default=None, metavar="N", help="as `run --max-world`")
    run.add_argument("--workdir", type=Path, default=None, help="parent of the cases' scratch dirs (Slurm multi-node "
                     "default: OUT/work; it must be on a shared filesystem)")
    _add_placement(run)
    run.add_argument("--shards", type=int, default=1, help="jobs to split the matrix into (run --shard I/N)")
    run.add_argument("--durations", type=Path, default=None, metavar="RESULTS",
                     help="balance the shards by the case durations of a previous results.json (as run --durations)")
    run.add_argument("--timeout-min", type=float, default=120.0, help="a shard job's time limit in minutes")
    run.add_argument("--partition", default=None, help="slurm: the partition")
    run.add_argument("--cpus-per-node", type=int, default=None, help="slurm: CPUs each node asks for (default: the "
                     "partition's, often 1 for a job of one task a node; or --slurm-arg exclusive=)")
    run.add_argument("--slurm-arg", action="append", type=_key_value, default=[], metavar="KEY=VALUE",
                     help="slurm: one more sbatch option, e.g. account=proj, qos=high, mem=0 (repeatable)")
    run.add_argument("--max-parallel", type=int, default=None, help="slurm: shard jobs running at once")
    run.add_argument("--run-args", default="", metavar="'ARGS'", help="more options for every shard's `ckpt-harness run`, "
                     "one string: --run-args='--jobs 2 --fail-on-not-run'")
    tpl = verbs.add_parser("template", help="print the --torchrun-template that starts each world as nodes x ranks "
                           "(inside an allocation: ckpt-harness run --launcher torchrun --torchrun-template ...)")
    _add_placement(tpl)
    p.set_defaults(func=run_cli)
    return p


def _add_placement(p: argparse.ArgumentParser) -> None:
    p.add_argument("--executor", choices=EXECUTORS, default="local", help="slurm, or local processes (tests, one box)")
    p.add_argument("--nodes", type=int, default=1, help="nodes per shard job; > 1: worlds as nodes x ranks (c10d rendezvous)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs each node asks for (0: CPU/gloo)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="most ranks of a world on one node (default: --gpus-per-node)")


def run_cli(args: argparse.Namespace) -> int:
    opts = ClusterOptions(
        executor=args.executor, nodes=args.nodes, gpus_per_node=args.gpus_per_node, ranks_per_node=args.ranks_per_node,
        **({} if args.cluster_command == "template" else dict(
            shards=args.shards, timeout_min=args.timeout_min, partition=args.partition, slurm=dict(args.slurm_arg),
            cpus_per_node=args.cpus_per_node,
            max_parallel=args.max_parallel)))
    try:
        opts.check()
        if args.cluster_command == "template":
            print(template(opts.executor, opts.per_node(), opts.nodes))
            return 0
        code, _ = run_matrix(args.matrix, args.out, opts, args.k, args.max_world, args.workdir, shlex.split(args.run_args),
                             args.durations)
        return code
    except (ValueError, ClusterExtraMissing) as exc:
        print(f"ckpt-harness cluster: {exc}", file=sys.stderr)
        return 2


def run_part(inner: Scheduler, specs: list, options: Any, run_one, env: dict[str, str | None]) -> list[CaseResult]:
    """A part's job body (pickled by submitit): its cases through the inner scheduler, results back."""
    for key, value in env.items():
        os.environ.pop(key, None) if value is None else os.environ.update({key: value})
    return inner.run(specs, options, run_one, None)


class Cluster(Scheduler):
    """Balanced parts (as `--shard I/N` of `opts.shards`) as jobs of a submitit executor."""

    name = "cluster"

    def __init__(self, opts: ClusterOptions, inner: Scheduler, durations: dict[str, float] | None = None):
        self.opts, self.inner, self.durations = opts, inner, durations

    def parts(self, specs) -> list[list]:
        return [p for p in balanced_split(list(specs), self.opts.shards, self.durations) if p]

    def options(self, options: Any) -> Any:
        """`options` as a part's job runs them: with `--nodes` > 1 every world as nodes x ranks."""
        if self.opts.nodes == 1:
            return options
        return replace(options, launcher="torchrun", torchrun_template=template(self.opts.executor, self.opts.per_node(), self.opts.nodes))

    def check(self, specs, options) -> None:
        self.opts.check()
        import_submitit()
        for part in self.parts(specs):
            self.inner.check(part, self.options(options))

    def run(self, specs, options, run_one, on_result=None) -> list[CaseResult]:
        specs, options = list(specs), self.options(options)
        parts = self.parts(specs)
        folder = Path(tempfile.mkdtemp(prefix="ckpt-harness-cluster-", dir=options.workdir))  # on Slurm: a shared fs
        n, lost = len(parts), False
        jobs = make_executor(self.opts, folder).map_array(run_part, [self.inner] * n, parts, [options] * n, [run_one] * n,
                                                          [_job_env(self.opts)] * n)
        by_id: dict[str, CaseResult] = {}
        for i, (part, job) in enumerate(zip(parts, jobs), 1):
            try:  # a multi-node job runs its part once, as task 0 (use_srun False): the other nodes' tasks never report
                got = (job.task(0) if self.opts.nodes > 1 else job).result()
            except Exception as exc:  # submitit: the job died, timed out or was cancelled
                lost = True
                why = f"part {i}/{n} (job {job.job_id} on {self.opts.executor}) did not finish: {type(exc).__name__}: {str(exc)[:500]}"
                got = [bare(s, "error", error=f"{why}\n{_log_tail(job)}\n(job files in {folder})") for s in part]
            for r in got:
                r.notes.append(f"ran in job {job.job_id} ({self.opts.executor}, part {i}/{n})")
                by_id[r.id] = r
                if on_result:
                    on_result(r)
        if not (options.keep or lost):
            shutil.rmtree(folder, ignore_errors=True)  # our own mkdtemp
        return [by_id[s.id] for s in specs]


def make(settings: Settings) -> Cluster:
    given = settings.cluster or {}
    opts = given if isinstance(given, ClusterOptions) else ClusterOptions(**given)
    if settings.gpus_per_node and not opts.gpus_per_node:
        opts = replace(opts, gpus_per_node=settings.gpus_per_node)
    return Cluster(opts, inner_of(settings, "cluster"), settings.durations)
