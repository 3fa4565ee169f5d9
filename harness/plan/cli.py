"""`ckpt-harness plan`: its arguments and the run (harness/cli.py only registers it)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from harness.core.topology import Topology, TopologyError
from harness.plan import predict, report, validate
from harness.plan.model import PlanInputError, load_model, presets

EXIT_OK, EXIT_INVALID, EXIT_BAD_INPUT = 0, 1, 2


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="predict and validate a checkpoint's save and load plans between two topologies "
                                    "(meta device, fake process group: no GPU)")
    p.add_argument("--model", required=True, help=f"an HF config.json path or a preset: {', '.join(presets())}")
    p.add_argument("--from", dest="src", required=True, help="the save topology, e.g. tp8pp8dp16")
    p.add_argument("--to", dest="dst", required=True, help="the load topology, e.g. tp4pp16dp16")
    p.add_argument("--format", default="fully_reshardable", choices=predict.FORMATS,
                   help="the distributed optimizer's checkpoint format (default fully_reshardable)")
    p.add_argument("--vocab-divisible-by", type=int, default=None,
                   help="pad the vocab as Megatron-LM does (to a multiple of N*tp); default: no padding")
    p.add_argument("--out", required=True, type=Path, help="folder for plan.md and plan.json")
    p.set_defaults(func=run_cli)
    return p


def plan(model_ref: str, src: str, dst: str, fmt: str = "fully_reshardable", vocab_divisible_by: int | None = None,
         progress=None) -> dict:
    """The plan as a dict (raises PlanInputError on bad input)."""
    from harness.plan.collect import topology_records

    t0 = time.perf_counter()
    model = load_model(model_ref, vocab_divisible_by)
    topos = []
    for text in (src, dst):
        try:
            topos.append(Topology.parse(text))
        except TopologyError as e:
            raise PlanInputError(f"topology {text!r}: {e}") from e
    for topo in topos:  # both before building either: a target that cannot hold the model fails in seconds
        try:
            topo.validate(model)
        except ValueError as e:
            raise PlanInputError(f"topology {topo.id} cannot hold model {model.name}: {e}") from e
    saved = topology_records(model, topos[0], progress)
    loading = topology_records(model, topos[1], progress)
    return assemble(model.to_json(), topos[0], topos[1], fmt, saved, loading, time.perf_counter() - t0)


def assemble(model: dict, src: Topology, dst: Topology, fmt: str, saved: list, loading: list, seconds: float) -> dict:
    """The plan from the two topologies' records (pure: tests feed planted records)."""
    save_problems, load_problems = validate.coverage_problems(saved), validate.coverage_problems(loading)
    keys = validate.load_problems(saved, loading)
    optimizer = predict.optimizer_verdict(fmt, src, dst)
    bad = save_problems or load_problems or keys["missing"] or keys["mismatched"] or optimizer
    return {
        "model": model, "format": fmt, "seconds": round(seconds, 2),
        "verdict": "INVALID" if bad else "VALID", "exit_code": EXIT_INVALID if bad else EXIT_OK,
        "save": predict.summary(saved, src), "load": predict.summary(loading, dst),
        "save_problems": save_problems, "load_problems": load_problems, "keys": keys, "optimizer": optimizer,
        "layout": {"save": validate.layout(saved), "load": validate.layout(loading)},
    }


def run_cli(args: argparse.Namespace) -> int:
    def progress(topo, i, n):
        if i == n or i % 16 == 0:
            print(f"plan: {topo.id}: {i}/{n} model-parallel coordinates built", file=sys.stderr, flush=True)

    try:
        if args.vocab_divisible_by is not None and args.vocab_divisible_by < 1:
            raise PlanInputError(f"--vocab-divisible-by {args.vocab_divisible_by}: must be >= 1")
        result = plan(args.model, args.src, args.dst, args.format, args.vocab_divisible_by, progress)
    except PlanInputError as e:
        print(f"ckpt-harness plan: bad input: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    md, js = report.write(result, args.out)
    s = result["save"]
    print(f"{result['verdict']}: {s['topology']} -> {result['load']['topology']}: checkpoint weights "
          f"{report.gib(s['checkpoint_weight_bytes'])}, max written/rank {report.gib(s['max_written_per_rank'])}, "
          f"max read/rank {report.gib(result['load']['max_read_per_rank'])}; {md} and {js} ({result['seconds']:.1f} s)")
    return result["exit_code"]
