"""The scheduling flags of `ckpt-harness run` and `list`, and the scheduler they name: `--scheduler
NAME`, else the one today's flags imply (schedulers.IMPLIED: --shard, --gpus-per-node, --jobs N > 1)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from harness.orchestration.schedulers import SCHEDULERS, Scheduler, Settings, get

EXECUTORS = ("local", "slurm")  # as harness.run.nodes.EXECUTORS (not imported: it is the cluster extra's)


def _gpus(text: str) -> int:
    """--gpus-per-node: N >= 1, or `auto` (the GPUs this process sees, asked of NVML: no CUDA context)."""
    if text == "auto":
        import torch

        if (n := torch.cuda.device_count()) < 1:
            raise argparse.ArgumentTypeError("auto: no GPU visible here; give a number")
        return n
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a number of GPUs >= 1 or auto, got {text!r}")
    return int(text)


def add_flags(p: argparse.ArgumentParser, run: bool = True) -> None:
    """--scheduler, --shard, --durations, --gpus-per-node; for `run` also the cluster scheduler's."""
    p.add_argument("--scheduler", choices=tuple(SCHEDULERS), default=None,
                   help="how the cases are spread (default: what --shard, --gpus-per-node, --jobs imply, else serial)")
    p.add_argument("--shard", default=None, metavar="I/N", help="only part I of N, a deterministic balanced split "
                   "(every runner computes the same one; `merge` joins the parts' results)")
    p.add_argument("--durations", type=Path, default=None, metavar="RESULTS",
                   help="balance --shard (and order --gpus-per-node) by the case durations of a previous results.json "
                        "(else by world size and model)")
    p.add_argument("--gpus-per-node", type=_gpus, default=None, metavar="N|auto",
                   help="pack cases onto the node's N GPUs, several at once on disjoint sets, largest first "
                        "(CUDA_VISIBLE_DEVICES per case; with gloo the sets are labels and worlds run on CPU); "
                        "list: print the predicted schedule (docs/nightly-gpu.md)")
    if not run:
        return
    g = p.add_argument_group("--scheduler cluster", "balanced parts as submitit jobs (the cluster extra)")
    g.add_argument("--executor", choices=EXECUTORS, default="local", help="slurm, or local processes")
    g.add_argument("--shards", type=int, default=1, help="jobs to split the cases into")
    g.add_argument("--nodes", type=int, default=1, help="nodes per job; > 1: worlds as nodes x ranks (c10d rendezvous)")
    g.add_argument("--ranks-per-node", type=int, default=None, help="most ranks of a world on one node (default: --gpus-per-node)")
    g.add_argument("--partition", default=None, help="slurm: the partition")
    g.add_argument("--timeout-min", type=float, default=120.0, help="a job's time limit in minutes")


def settings_of(args: argparse.Namespace) -> Settings:
    from harness.orchestration.schedulers._balance import durations_of

    name = getattr(args, "scheduler", None)
    uses_durations = args.shard or args.gpus_per_node or name in ("shard", "packing", "cluster")
    cluster = {k: getattr(args, k) for k in ("executor", "shards", "nodes", "ranks_per_node", "partition", "timeout_min")
               if hasattr(args, k)}
    return Settings(jobs=getattr(args, "jobs", 1), gpus_per_node=args.gpus_per_node, shard=args.shard, cluster=cluster,
                    durations=durations_of(args.durations) if args.durations and uses_durations else None)


def scheduler_of(args: argparse.Namespace) -> Scheduler:
    """The scheduler the flags name; ValueError naming a flag that cannot make one. `--shard` with
    another --scheduler: the shard scheduler, running its part through the named one."""
    name, settings = getattr(args, "scheduler", None), settings_of(args)
    if settings.shard and name not in (None, "shard"):
        settings, name = replace(settings, inner=name), "shard"
    return get(name, settings)
