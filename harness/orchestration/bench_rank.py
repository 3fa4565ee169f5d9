"""One rank of a throughput-benchmark world (harness.orchestration.bench): build a zoo GPT model,
then save and load it `repeats` times through one engine, timing each step and measuring its
host memory (harness.core.memory.track).

An engine is torch DCP (`dcp`: `torch.distributed.checkpoint.save/load` of the model's plain
state_dict, the reference) or a backend with its options (`mcore_dist` and its save/load/async
strategies). One backend instance serves every repeat of a world, as a training job keeps its
strategy objects. What a step costs is what the slowest rank waits, so each rank reports its own
times and the orchestrator takes the maximum.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from harness.core.context import RankContext
from harness.core.memory import track
from harness.core.topology import Topology
from harness.report.bench import REFERENCE as DCP  # the reference's engine name


@dataclass(frozen=True)
class BenchJob:
    """What every rank of one world runs: `engine` is DCP or a backend name with `options`."""

    model: str
    topo: Topology
    engine: str
    options: tuple[tuple[str, Any], ...]
    root: str  # the world's checkpoints go to root/r<repeat>
    repeats: int
    keep_last: bool = False  # keep the last repeat's checkpoint (the test reads its files)


def bytes_on_disk(directory: Path) -> int:
    """Every file's size under `directory`, hidden ones (DCP's `.metadata`) included: what the save wrote."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


def _checksum(chunks: list) -> float:
    """A float64 sum over every parameter: equal after a load only if the load put the weights back.
    A sharded parameter (Megatron-FSDP's DTensor) counts its local shard: each rank checks its own."""
    return float(sum(_local(p).detach().double().sum().item() for c in chunks for p in c.parameters()))


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _wipe(chunks: list) -> None:
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                _local(p).zero_()


def _save(engine: str, backend: Any, ctx: RankContext, chunks: list, directory: Path) -> float:
    """Save; returns the seconds until the call returned (what training waits for). An async
    backend's save is then finalized (its writer waited for, the metadata written) before this returns."""
    start = time.perf_counter()
    if engine == DCP:
        import torch.distributed.checkpoint as dcp

        dcp.save(chunks[0].state_dict(), checkpoint_id=str(directory))
        return time.perf_counter() - start
    backend.save(ctx, chunks, directory)
    blocking = time.perf_counter() - start
    if backend.pending_saves():
        backend.finalize_saves(ctx)
    return blocking


def _load(engine: str, backend: Any, ctx: RankContext, chunks: list, directory: Path) -> None:
    if engine == DCP:
        import torch.distributed.checkpoint as dcp

        state = chunks[0].state_dict()  # views of the parameters: DCP loads into them in place
        dcp.load(state, checkpoint_id=str(directory))
        chunks[0].load_state_dict(state, strict=True)
        return
    backend.load(ctx, chunks, directory)


def bench_rank(ctx: RankContext, job: BenchJob) -> list[dict]:
    """Per repeat: this rank's save blocking and total seconds, load seconds, the peak RSS of
    each (harness.core.memory: absolute and over the phase's baseline), and on rank 0 the bytes
    the save wrote. Raises when a load did not give back the saved weights."""
    from harness.backends import get_backend, resolve
    from harness.core.zoo import get_model
    from harness.models.mcore import build_gpt

    spec = get_model(job.model, "gpt")
    backend = None if job.engine == DCP else get_backend(resolve(job.engine, dict(job.options)))
    if backend is None:
        chunks = build_gpt(spec, job.topo)
        if len(chunks) != 1:
            raise ValueError(f"the DCP reference saves one model chunk's state_dict; {job.topo.id} builds {len(chunks)}")
    else:  # the backend's own model (mcore_fsdp: Megatron-FSDP, its parameters sharded across the world)
        chunks = backend.builder().build_model(spec, job.topo, "fp32", "local", spec)
    saved = _checksum(chunks)
    out = []
    for i in range(job.repeats):
        directory = Path(job.root) / f"r{i}"
        dist.barrier()
        with track("save") as save_mem:  # the clock runs inside: the sampler's start and stop are not the save's
            start = time.perf_counter()
            blocking = _save(job.engine, backend, ctx, chunks, directory)
            dist.barrier()  # the save is done when every rank's part is
            total = time.perf_counter() - start
        written = bytes_on_disk(directory) if ctx.is_rank0 else 0
        _wipe(chunks)
        dist.barrier()
        with track("load") as load_mem:
            start = time.perf_counter()
            _load(job.engine, backend, ctx, chunks, directory)
            dist.barrier()
            load_s = time.perf_counter() - start
        got = _checksum(chunks)
        if abs(got - saved) > 1e-6 * max(1.0, abs(saved)):
            raise RuntimeError(f"rank {ctx.rank} repeat {i}: {job.engine} load gave weights summing to {got}, saved {saved}")
        out.append({
            "save_block_s": blocking, "save_total_s": total, "load_s": load_s, "bytes": written,
            "save_peak_rss": save_mem.peak_rss, "save_peak_delta": save_mem.peak_delta,
            "load_peak_rss": load_mem.peak_rss, "load_peak_delta": load_mem.peak_delta,
        })
        dist.barrier()  # every rank has read it before it goes
        if ctx.is_rank0 and not (job.keep_last and i == job.repeats - 1):
            shutil.rmtree(directory, ignore_errors=True)  # ours: made under the world's root by this save
    return out
