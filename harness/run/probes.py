"""Tiny rank functions that exercise a launcher without a model (self-tests, launcher checks).

They live in the package, not in tests, because torchrun children import them by name.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.core.context import RankContext


def allreduce_ranks(ctx: RankContext, scale: float) -> dict:
    t = torch.tensor([float(ctx.rank)], device=ctx.device)
    dist.all_reduce(t)
    return {"rank": ctx.rank, "world": ctx.world_size, "sum": float(t) * scale, "device": str(ctx.device), "backend": ctx.backend}


def raise_on_rank(ctx: RankContext, rank: int) -> None:
    if ctx.rank == rank:
        raise ValueError(f"boom on rank {rank}")
    dist.barrier()


def mark_hook() -> None:
    """A rank hook for the probes: leaves a mark the rank can report."""
    import os

    os.environ["CKPT_HARNESS_PROBE_HOOK"] = "ran"


def leave_temp_file(ctx: RankContext, name: str) -> dict:
    """Write a file into the rank's temp, as a library's lock file or scratch would, and never remove it."""
    import os
    import tempfile

    path = os.path.join(tempfile.gettempdir(), f"{name}-{ctx.rank}")
    with open(path, "w") as f:
        f.write("left behind")
    return {"tmp": tempfile.gettempdir(), "env": os.environ.get("TMPDIR"), "path": path}
