"""The one rank envelope: every world of every case gets parallel_state for its topology, the
CPU shims, per-phase memory records, the shims it applied and the backend events the same way
(`RunEnv.launch`), and one `timed` phase clock."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from harness.core.result import CaseResult
from harness.core.topology import Topology
from harness.run import world
from harness.run.ranklog import LogFiles, safe_name


@dataclass(frozen=True)
class RankOut:
    """What the envelope returns for one rank: the rank function's value plus what every world records."""

    value: Any
    memory: dict[str, dict]
    compat: list[str]
    events: list[dict]


def _envelope(ctx: world.RankContext, call: tuple[world.RankFn, Any, Topology | None]) -> RankOut:
    from harness import compat
    from harness.core import memory
    from harness.run.events import drain_events

    fn, arg, topo = call
    compat.begin_case()  # this case's shims only: not what the parent (forked from) or an earlier case applied
    if topo is not None:
        from harness.models.parallel import init_parallel

        init_parallel(topo)
    memory.start_recording()
    drain_events()
    try:
        value = fn(ctx, arg)
    finally:
        phases = memory.stop_recording()
    return RankOut(value, {name: m.to_dict() for name, m in phases.items()}, compat.installed(), drain_events())


@dataclass
class RunEnv:
    """Where and how a case runs: its scratch directory, the dist backend, launcher and timeout."""

    case_dir: Path
    dist_backend: str = "auto"
    timeout_s: float = 300.0
    launcher: str = "mp"  # "mp" (torch.multiprocessing) or "torchrun"
    torchrun_template: str | None = None
    start_method: str | None = None  # None/auto: fork for gloo, spawn for NCCL
    hooks: tuple[str, ...] = ()  # rank hooks ("module:function"), run in every rank before the case's function
    log_dir: Path | None = None  # the case's log directory (harness.run.ranklog): <phase>-rank<N>.log; None: the world's dir

    def launch(self, result: CaseResult, phase: str, fn: world.RankFn, arg: Any, topo: Topology | None) -> list[Any]:
        """One world for `topo` (one rank without parallel_state when None), timed into
        result.phases[phase]; its memory records and shims go into `result`. Returns each rank's value."""
        size = topo.world_size if topo is not None else 1
        workdir = self.case_dir / f"world-{phase}"
        call = (fn, arg, topo)
        logs = LogFiles(str(self.log_dir), safe_name(phase), kept=True) if self.log_dir is not None else None
        with timed(result, phase):
            if self.launcher == "torchrun":
                outs = world.launch_torchrun(
                    _envelope, call, size, workdir, backend=self.dist_backend, timeout_s=self.timeout_s,
                    template=self.torchrun_template, hooks=self.hooks, logs=logs,
                )
            else:
                outs = world.launch(
                    _envelope, call, size, workdir, backend=self.dist_backend, timeout_s=self.timeout_s,
                    start_method=self.start_method, hooks=self.hooks, logs=logs,
                )
        for rank, out in enumerate(outs):
            for name, m in out.memory.items():
                key = name if name == phase else f"{phase}:{name}"
                result.memory.setdefault(key, {})[str(rank)] = {**m, "shard_bytes": getattr(out.value, "shard_bytes", 0)}
            if out.events:
                result.backend_events.setdefault(phase, {})[str(rank)] = out.events
        for out in outs:  # what any rank of any of the case's worlds applied, first-seen order
            result.compat_shims += [name for name in out.compat if name not in result.compat_shims]
        return [o.value for o in outs]


@contextmanager
def timed(result: CaseResult, phase: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        result.phases[phase] = round(result.phases.get(phase, 0.0) + time.perf_counter() - start, 3)
