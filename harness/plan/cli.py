"""`ckpt-harness plan`: its arguments and the run (harness/cli.py only registers it)."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from harness.core.topology import Topology, TopologyError
from harness.plan import memory, predict, report, validate
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
    p.add_argument("--host-device", default="cuda", choices=("cuda", "cpu"),
                   help="where the training state lives, for the host-memory table (default cuda: only what a save "
                        "or load stages is on the host; cpu: the state too, as in this project's CPU worlds)")
    p.add_argument("--bucket-size", type=int, default=None,
                   help="DDP bucket size in parameters (default: one bucket per buffer, megatron-core without "
                        "overlap_grad_reduce); bounds fully_reshardable's gather transient")
    p.add_argument("--ranks-per-node", type=int, default=memory.RANKS_PER_NODE, help="for the per-node host peaks (default 8)")
    p.add_argument("--first-stage-layers", type=_stage_layers, default=None,
                   help="layers in the first pipeline stage (megatron-core's num_layers_in_first_pipeline_stage) at both "
                        "topologies, or 'auto': derived per topology where the layers do not divide over pp*vpp "
                        "(collect.pipeline_split); default: even stages only")
    p.add_argument("--last-stage-layers", type=_stage_layers, default=None,
                   help="layers in the last pipeline stage (num_layers_in_last_pipeline_stage), as --first-stage-layers")
    p.add_argument("--out", required=True, type=Path, help="folder for plan.md and plan.json")
    p.set_defaults(func=run_cli)
    return p


def _stage_layers(text: str) -> int | str:
    """--first/--last-stage-layers: a positive int or "auto"."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive number of layers or 'auto'")
    return int(text)


def plan(model_ref: str, src: str, dst: str, fmt: str = "fully_reshardable", vocab_divisible_by: int | None = None,
         progress=None, setup: memory.Setup | None = None, first: int | str | None = None,
         last: int | str | None = None) -> dict:
    """The plan as a dict (raises PlanInputError on bad input). `first`/`last`: layers in the first/last
    pipeline stage at both topologies, ints or "auto" (collect.pipeline_split); None: even stages only."""
    from harness.compat.cuda import guard_megatron_import
    from harness.plan.collect import check_topology, pipeline_split, topology_records

    t0 = time.perf_counter()
    model = load_model(model_ref, vocab_divisible_by)
    topos = []
    for text in (src, dst):
        try:
            topos.append(Topology.parse(text))
        except TopologyError as e:
            raise PlanInputError(f"topology {text!r}: {e}") from e
    guard_megatron_import()
    for topo in topos:  # both before building either: a target that cannot hold the model fails in seconds
        check_topology(model, topo, pipeline_split(model, topo, first, last))
    # fp32 models: the distributed optimizer's main params are the DDP buffer's params (memory.Setup)
    setup = replace(setup or memory.Setup(), fp32_model=model.dtype == "float32")
    saved = topology_records(model, topos[0], progress, first, last)
    loading = topology_records(model, topos[1], progress, first, last)
    return assemble(model.to_json(), topos[0], topos[1], fmt, saved, loading, time.perf_counter() - t0, setup)


def assemble(model: dict, src: Topology, dst: Topology, fmt: str, saved: list, loading: list, seconds: float,
             setup: memory.Setup | None = None) -> dict:
    """The plan from the two topologies' records (pure: tests feed planted records)."""
    save_problems, load_problems = validate.coverage_problems(saved), validate.coverage_problems(loading)
    keys = validate.load_problems(saved, loading)
    optimizer = predict.optimizer_verdict(fmt, src, dst)
    bad = save_problems or load_problems or keys["missing"] or keys["mismatched"] or optimizer
    return {
        "model": model, "format": fmt, "seconds": round(seconds, 2),
        "verdict": "INVALID" if bad else "VALID", "exit_code": EXIT_INVALID if bad else EXIT_OK,
        "save": predict.summary(saved, src, setup), "load": predict.summary(loading, dst, setup),
        "save_problems": save_problems, "load_problems": load_problems, "keys": keys, "optimizer": optimizer,
        "layout": {"save": validate.layout(saved), "load": validate.layout(loading)},
        "caveats": caveats(src, dst),
    }


def caveats(*topos: Topology) -> list[str]:
    """What the estimates do not model at these topologies, shown at the top of plan.md and on stderr.
    None at present: predict.py's optimizer share and fully-parallel spread and memory.py's rank layout
    follow megatron-core's groups at any cp and etp (dp x cp, expert-dp, collect.rank_coordinates), and
    the records and their validation are exact."""
    return []


def run_cli(args: argparse.Namespace) -> int:
    def progress(topo, i, n):
        if i == n or i % 16 == 0:
            print(f"plan: {topo.id}: {i}/{n} model-parallel coordinates built", file=sys.stderr, flush=True)

    try:
        if args.vocab_divisible_by is not None and args.vocab_divisible_by < 1:
            raise PlanInputError(f"--vocab-divisible-by {args.vocab_divisible_by}: must be >= 1")
        for name in ("bucket_size", "ranks_per_node"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                raise PlanInputError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
        setup = memory.Setup(device=args.host_device, bucket_numel=args.bucket_size, ranks_per_node=args.ranks_per_node)
        result = plan(args.model, args.src, args.dst, args.format, args.vocab_divisible_by, progress, setup,
                      args.first_stage_layers, args.last_stage_layers)
    except PlanInputError as e:
        print(f"ckpt-harness plan: bad input: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    md, js = report.write(result, args.out)
    s = result["save"]
    print(f"{result['verdict']}: {s['topology']} -> {result['load']['topology']}: checkpoint weights "
          f"{report.gib(s['checkpoint_weight_bytes'])}, max written/rank {report.gib(s['max_written_per_rank'])}, "
          f"max read/rank {report.gib(result['load']['max_read_per_rank'])}; {md} and {js} ({result['seconds']:.1f} s)")
    for line in result["caveats"]:
        print(f"plan: caveat: {line}", file=sys.stderr)
    return result["exit_code"]
