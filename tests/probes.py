"""Rank functions and hooks that only the tests use to probe a launcher (a failing rank, a hook's
mark, a file left in the rank's temp). They live here, not in the harness: the wheel ships no test
code. Ranks reach them by name, as they reach tests/doubles.py ("probes:mark_hook", or pickled
`probes.raise_on_rank`): the root conftest puts tests/ on PYTHONPATH for every child process.
The launcher self-test the harness keeps (allreduce_ranks, used by benchmarks/world_start.py) stays
in harness.run.probes."""

from __future__ import annotations

import os
import tempfile

import torch.distributed as dist

from harness.core.context import RankContext


def raise_on_rank(ctx: RankContext, rank: int) -> None:
    if ctx.rank == rank:
        raise ValueError(f"boom on rank {rank}")
    dist.barrier()


def mark_hook() -> None:
    """A rank hook for the probes: leaves a mark the rank can report."""
    os.environ["CKPT_HARNESS_PROBE_HOOK"] = "ran"


def leave_temp_file(ctx: RankContext, name: str) -> dict:
    """Write a file into the rank's temp, as a library's lock file or scratch would, and never remove it."""
    path = os.path.join(tempfile.gettempdir(), f"{name}-{ctx.rank}")
    with open(path, "w") as f:
        f.write("left behind")
    return {"tmp": tempfile.gettempdir(), "env": os.environ.get("TMPDIR"), "path": path}
