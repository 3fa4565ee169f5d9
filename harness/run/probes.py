"""The launcher self-test: a rank function that exercises a world without a model (every rank
all-reduces its rank number). benchmarks/world_start.py times world starts with it, and it checks a
launcher (mp, torchrun, nodes) end to end; it lives in the package because torchrun children import
it by name. The tests' own probes (a failing rank, a hook's mark, a file left in temp) are
tests/probes.py: the wheel ships no test code."""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.core.context import RankContext


def allreduce_ranks(ctx: RankContext, scale: float) -> dict:
    t = torch.tensor([float(ctx.rank)], device=ctx.device)
    dist.all_reduce(t)
    return {"rank": ctx.rank, "world": ctx.world_size, "sum": float(t) * scale, "device": str(ctx.device), "backend": ctx.backend}
