"""`ckpt-harness bench`: checkpoint throughput per strategy, beside torch DCP as the reference.

    ckpt-harness bench --out DIR [--models gpt-gqa gpt-25m] [--worlds 1 2 4] [--repeats 3]
                       [--strategies dcp sync fully_parallel async]

A benchmark, not a test: for each zoo model, world size (data parallel, every rank holding the
whole model, gloo on CPU) and strategy, one world (harness.orchestration.runner.case_envelope)
saves and loads the model `repeats` times (harness.orchestration.bench_rank) and the medians go
into one table: the save's blocking time (what training waits for; for an async save the time
until save() returns, before finalize), its total time (finalize included), the load time, the
bytes written, GB/s both ways and the largest rank's peak host RSS. torch DCP saving the same
model runs in the same run, and every figure is also given as a ratio to it. Writes DIR/bench.md,
DIR/bench.json and DIR/bench.png (harness.report.bench) and prints the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from harness.core.memory import MiB
from harness.core.topology import Topology, TopologyError
from harness.report.bench import REFERENCE, markdown, plot

if TYPE_CHECKING:  # the rank side, the runner and torch load when a benchmark runs, not with the CLI's parser
    from harness.orchestration.runner import RunOptions

DCP = REFERENCE  # the reference's engine: torch DCP itself (harness.orchestration.bench_rank)

#: strategy name -> (engine, backend options); `dcp` is the reference every run includes
STRATEGIES: dict[str, tuple[str, dict[str, Any]]] = {
    REFERENCE: (DCP, {}),
    "sync": ("mcore_dist", {}),
    "fully_parallel": ("mcore_dist", {"save_strategy": "fully_parallel", "load_strategy": "fully_parallel"}),
    "async": ("mcore_dist", {"async_save": "mcore"}),
    # Megatron-FSDP's fsdp_dtensor (backend mcore_fsdp: Bridge's save/load_fsdp_dtensor_checkpoint), each rank its shard
    "fsdp_dtensor": ("mcore_fsdp", {}),
    # Megatron-LM's defaults together (--ckpt-fully-parallel-save/-load with --async-save)
    "fully_parallel+async": ("mcore_dist", {"save_strategy": "fully_parallel", "load_strategy": "fully_parallel",
                                            "async_save": "mcore"}),
}
DEFAULT_STRATEGIES = ("dcp", "sync", "fully_parallel", "async", "fsdp_dtensor")
DEFAULT_MODELS = ("gpt-gqa", "gpt-25m")
DEFAULT_WORLDS = (1, 2, 4)
#: the world figures a repeat gives (the slowest rank's time, the largest rank's memory, rank 0's bytes)
_TIMES = ("save_block_s", "save_total_s", "load_s")
_PEAKS = ("save_peak_rss", "save_peak_delta", "load_peak_rss", "load_peak_delta")


def world_figures(ranks: list[list[dict]]) -> list[dict]:
    """Per repeat, the world's figures from each rank's: a collective step lasts as long as its
    slowest rank, memory is the largest rank's, the bytes are what rank 0 counted on disk."""
    out = []
    for i in range(len(ranks[0])):
        per = [r[i] for r in ranks]
        fig = {k: max(p[k] for p in per) for k in _TIMES + _PEAKS}
        fig["bytes"] = per[0]["bytes"]
        out.append(fig)
    return out


#: the least a DCP figure must be for a ratio to it to mean anything: RSS moves by pages and
#: allocator chunks, so a ratio over DCP's 0.03 MiB read as "500x" of nothing
RATIO_FLOOR: dict[str, float] = {"save_peak_delta_mib": 1.0, "load_peak_delta_mib": 1.0}


def medians(runs: list[dict]) -> dict[str, float]:
    """The table's figures: times, bytes and GB/s the median over the repeats (GB/s per repeat,
    then its median); memory the largest repeat's, which is the job's first save or load: the
    process's later ones reuse what the first allocated, so their peak over baseline reads ~0."""
    def med(f: Callable[[dict], float]) -> float:
        return float(statistics.median(f(r) for r in runs))

    def top(f: Callable[[dict], float]) -> float:
        return float(max(f(r) for r in runs))

    return {
        "save_block_s": med(lambda r: r["save_block_s"]), "save_total_s": med(lambda r: r["save_total_s"]),
        "load_s": med(lambda r: r["load_s"]), "bytes_written": med(lambda r: r["bytes"]),
        "mb_written": med(lambda r: r["bytes"] / 1e6),
        "save_gbps": med(lambda r: r["bytes"] / 1e9 / r["save_total_s"]),
        "load_gbps": med(lambda r: r["bytes"] / 1e9 / r["load_s"]),
        "save_peak_delta_mib": top(lambda r: r["save_peak_delta"] / MiB),
        "load_peak_delta_mib": top(lambda r: r["load_peak_delta"] / MiB),
        "save_peak_rss_mib": top(lambda r: r["save_peak_rss"] / MiB),
    }


def add_ratios(rows: list[dict]) -> None:
    """Each measured row's `ratio`: its median over the DCP row's of the same model and world size
    (None where DCP has no figure, or one at or under its RATIO_FLOOR; the DCP row's own are 1)."""
    refs = {(r["model"], r["world"]): r["median"] for r in rows if r["strategy"] == REFERENCE and "median" in r}
    for r in rows:
        ref = refs.get((r["model"], r["world"]))
        if "median" in r:
            r["ratio"] = {k: (v / ref[k] if ref is not None and ref[k] > RATIO_FLOOR.get(k, 0.0) else None)
                          for k, v in r["median"].items()}


def _skip_reason(strategy: str, world: int) -> str | None:
    _, opts = STRATEGIES[strategy]
    if "fully_parallel" in opts.values() and world == 1:
        return "fully-parallel save/load distribute over the DP group: one rank has nothing to distribute"
    return None


def _first_lines(text: str, n: int = 3) -> str:
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    return " / ".join(lines[:n])[:400]


def bench_one(model: str, topo: Topology, strategy: str, repeats: int, options: RunOptions,
              keep: Path | None = None) -> dict:
    """One world of one strategy: its row (per-repeat figures and medians), or `error` naming why it failed."""
    from harness.backends import get_backend, resolve
    from harness.core.result import CaseResult, Check
    from harness.orchestration.bench_rank import BenchJob, bench_rank
    from harness.orchestration.runner import case_envelope

    engine, opts = STRATEGIES[strategy]
    row: dict[str, Any] = {"model": model, "world": topo.world_size, "strategy": strategy, "engine": engine, "options": opts}
    result = CaseResult(id=f"bench-{model}-{topo.id}-{strategy}", case="bench", model=model, backend=engine,
                        source=topo.id, target=topo.id)
    with case_envelope(result, options) as env:
        root = (keep / f"{model}-{topo.world_size}-{strategy}") if keep is not None else env.case_dir / "checkpoints"
        job = BenchJob(model, topo, engine, tuple(sorted(opts.items())), str(root), repeats, keep_last=keep is not None)
        ranks = env.launch("bench", bench_rank, job, topo)
        short = [r for r, figures in enumerate(ranks) if len(figures) != repeats]
        # the rank raises when a load gives back other weights than it saved: every repeat timed is a round trip
        result.checks.append(Check("weights-roundtrip", "failed" if short or not ranks else "passed",
                                   f"ranks {short} timed fewer than {repeats} repeat(s)" if short else
                                   f"{len(ranks)} rank(s) loaded back the saved weights in each of {repeats} repeat(s)"))
        if engine != DCP:  # the backend ran what its options asked (harness.backends._mcore_events)
            env.sources.append(get_backend(resolve(engine, opts)))
    if result.status != "passed":
        failed = "; ".join(f"{c.name}: {c.detail}" for c in result.failed_checks)
        row["error"] = _first_lines(result.error or failed)
        return row
    row["runs"] = world_figures(ranks)
    row["median"] = medians(row["runs"])
    if keep is not None:
        row["kept"] = str(root / f"r{repeats - 1}")
    return row


def machine(dist_backend: str) -> dict[str, Any]:
    """What the numbers depend on: cores, memory, versions, the dist backend and how busy the host is."""
    from importlib import metadata

    import psutil
    import torch

    from harness.run.world import choose_backend

    try:
        mcore = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        mcore = "(not installed)"
    return {"cpus": os.cpu_count(), "host_gib": round(psutil.virtual_memory().total / 2**30, 1), "torch": torch.__version__,
            "megatron_core": mcore, "dist_backend": choose_backend(1, dist_backend),
            "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def run_bench(models: tuple[str, ...] = DEFAULT_MODELS, worlds: tuple[int, ...] = DEFAULT_WORLDS,
              strategies: tuple[str, ...] = DEFAULT_STRATEGIES, repeats: int = 3, options: RunOptions | None = None,
              keep: Path | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """Every (model, world size, strategy) row, DCP first in each group, with ratios to it: the
    document bench.json holds. ValueError names a model, world size or strategy it cannot run."""
    from harness.core.zoo import get_model
    from harness.orchestration.runner import RunOptions
    from harness.run.preload import warm

    options = options or RunOptions(reuse=False)
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategy {unknown[0]!r}; known: {sorted(STRATEGIES)}")
    order = (REFERENCE,) + tuple(s for s in dict.fromkeys(strategies) if s != REFERENCE)
    plan = []
    for model in models:
        try:
            spec = get_model(model, "gpt")
        except KeyError as exc:
            raise ValueError(f"--models: {exc.args[0]}") from None
        for world in worlds:
            if world < 1:
                raise ValueError(f"--worlds: a world size is a positive number of ranks, got {world}")
            topo = Topology(dp=world)
            try:
                topo.validate(spec)
            except TopologyError as exc:
                raise ValueError(f"--worlds {world} with model {model}: {exc}") from None
            plan += [(model, topo, s) for s in order]
    doc: dict[str, Any] = {"repeats": repeats, "machine": machine(options.dist_backend), "rows": []}
    warm()  # forked ranks start with megatron-core imported
    for model, topo, strategy in plan:
        skip = _skip_reason(strategy, topo.world_size)
        if skip:
            row = {"model": model, "world": topo.world_size, "strategy": strategy, "skipped": skip}
        else:
            row = bench_one(model, topo, strategy, repeats, options, keep)
        doc["rows"].append(row)
        if progress:
            m = row.get("median")
            progress(f"{model} ranks={topo.world_size} {strategy:22s} " + (
                f"save {m['save_total_s']:.3f}s (blocking {m['save_block_s']:.3f}s) load {m['load_s']:.3f}s "
                f"{m['mb_written']:.1f} MB" if m else row.get("skipped") or f"ERROR {row.get('error')}"))
    doc["machine"]["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    add_ratios(doc["rows"])
    return doc


def write(doc: dict, out: Path) -> str:
    """DIR/bench.json, DIR/bench.md and DIR/bench.png; returns the Markdown."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    text = markdown(doc)
    (out / "bench.json").write_text(json.dumps(doc, indent=2))
    (out / "bench.md").write_text(text)
    plot(doc, out / "bench.png")
    return text


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """`ckpt-harness bench` (registered by harness.cli)."""
    p = sub.add_parser("bench", help="checkpoint throughput per backend strategy and model size, with torch DCP as "
                       "the reference: a Markdown table and a plot (a benchmark, not a test)")
    p.add_argument("--out", type=Path, required=True, help="writes DIR/bench.md, DIR/bench.json and DIR/bench.png")
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), metavar="MODEL", help="zoo GPT models (sizes)")
    p.add_argument("--worlds", nargs="+", type=int, default=list(DEFAULT_WORLDS), metavar="N",
                   help="world sizes (data parallel: every rank holds the whole model)")
    p.add_argument("--strategies", nargs="+", default=list(DEFAULT_STRATEGIES), choices=sorted(STRATEGIES), metavar="S",
                   help=f"of {sorted(STRATEGIES)}; dcp (the reference) always runs")
    p.add_argument("--repeats", type=int, default=3, help="saves and loads per world; the table gives their median")
    p.add_argument("--dist-backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="each world's wall-clock limit")
    p.add_argument("--workdir", type=Path, default=None, help="parent of the worlds' scratch dirs (default: the temp dir)")
    p.add_argument("--keep", action="store_true", help="keep each world's last checkpoint under OUT/checkpoints/")
    p.set_defaults(func=run_cli)
    return p


def run_cli(args: argparse.Namespace) -> int:
    """Run, write, print; exit 1 when a world failed, 2 on input the benchmark cannot run."""
    from harness.orchestration.runner import RunOptions
    from harness.run.world import WorldError, choose_backend

    try:  # before any world: NCCL asked on a box without a GPU per rank
        choose_backend(max(args.worlds), args.dist_backend)
    except WorldError as exc:
        print(f"ckpt-harness bench: --dist-backend {args.dist_backend}: {exc}", file=sys.stderr)
        return 2
    options = RunOptions(dist_backend=args.dist_backend, workdir=args.workdir, timeout_s=args.timeout_s, reuse=False)
    keep = args.out / "checkpoints" if args.keep else None
    if keep is not None and keep.exists():
        print(f"ckpt-harness bench: --keep writes {keep}, which exists (a previous run's): remove it or name another --out",
              file=sys.stderr)
        return 2
    try:
        doc = run_bench(tuple(args.models), tuple(args.worlds), tuple(args.strategies), args.repeats, options,
                        keep=keep,
                        progress=lambda line: print(line, file=sys.stderr, flush=True))
    except ValueError as exc:
        print(f"ckpt-harness bench: {exc}", file=sys.stderr)
        return 2
    print(write(doc, args.out))
    return 1 if any(r.get("error") for r in doc["rows"]) else 0
