"""The one rank envelope: every world of every case gets parallel_state for its topology, the
CPU shims, per-phase memory records, the shims it applied and the backend events the same way
(`RunEnv.launch`), a world that writes a source checkpoint once per run (`RunEnv.launch_source`,
harness.run.reuse), and one `timed` phase clock."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

from harness.core.parity import NOT_COMPARED
from harness.core.result import CaseResult, Check, WorldRecord
from harness.core.topology import Topology
from harness.run import world
from harness.run.reuse import PLACEHOLDER, SOURCE_UNCHANGED, SourceStore, SourceUse, source_key
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
    #: the run's store of source worlds (harness.run.reuse); None: every world runs in the case
    store: SourceStore | None = None
    uses: list[SourceUse] = field(default_factory=list)  # what this case took from (or wrote into) the store
    log_dir: Path | None = None  # the case's log directory (harness.run.ranklog): <phase>-rank<N>.log; None: the world's dir
    #: what else judges the case (harness.core.result.CheckSource: its backends, its memory
    #: budgets), asked with this env's own `checks_of` when the case's envelope concludes
    sources: list[Any] = field(default_factory=list)
    #: a source written during a failed case must still hash as written: judged after an error too
    after_error: ClassVar[bool] = True
    case_id: str = ""  # the case's id: whose world a store entry is (harness.run.reuse)
    #: what this case's worlds recorded (seconds, memory, events, shims, store uses): the sources read
    #: it, and the case's envelope hands it to the result once, when the case ends
    record: WorldRecord = field(default_factory=WorldRecord)

    def launch(self, phase: str, fn: world.RankFn, arg: Any, topo: Topology | None) -> list[Any]:
        """One world for `topo` (one rank without parallel_state when None), timed as `phase`; its
        memory records, backend events and shims go into this env's `record`. Returns each rank's value."""
        outs = self._world(phase, fn, arg, topo)
        self._record(phase, outs)
        return [o.value for o in outs]

    def launch_source(self, phase: str, fn: world.RankFn, make_arg: Callable[[Path], Any],
                      topo: Topology | None) -> tuple[Path, list[Any]]:
        """A world that writes a checkpoint the case then only reads: `make_arg(root)` is its
        argument with every output under `root`. With a store, the first case of the run with this
        world's key (harness.run.reuse.source_key) runs it into the store and every later one gets
        the same directory and rank values without running it (its events, shims and memory
        recorded, the memory marked `measured_by` the writer: the same world, measured once); either way the case gets `source-unchanged` when it
        ends. Without a store, or when the argument names this case's scratch directory, the world
        runs under the case's own `source-<phase>/`. Returns (root, each rank's value)."""
        own = self.case_dir / f"source-{phase}"
        probe = make_arg(PLACEHOLDER)
        if self.store is None or str(self.case_dir) in repr(probe):
            own.mkdir(parents=True, exist_ok=True)
            return own, self.launch(phase, fn, make_arg(own), topo)
        key = source_key(fn, probe, topo, {"dist_backend": self.dist_backend, "launcher": self.launcher,
                                            "torchrun_template": self.torchrun_template})
        root, outs, use = self.store.get_or_make(key, phase, self.case_id, lambda d: self._world(phase, fn, make_arg(d), topo))
        self._record(phase, outs, measured_by=use.writer if use.role == "reused" else None)
        self.uses.append(use)
        self.record.reuse.append(use.to_dict())
        if use.role == "reused":
            self.record.notes.append(f"{phase}: the source world of {use.writer} reused (store entry {use.key}, saved {use.world_s:.1f} s)")
        return root, [o.value for o in outs]

    def source_files(self, phase: str, what: str, spec: Any, make: Callable[[Path], Any]) -> Path:
        """A file tree this process writes from `spec` alone (an HF fixture: `what` names the
        writer, `make(dir)` writes it), timed as `phase`: once per run in the store like a source
        world, else in the case's own `<phase>/`. Returns its directory."""
        if self.store is None or str(self.case_dir) in repr(spec):
            with self.timed(phase):
                make(self.case_dir / phase)
            return self.case_dir / phase
        key = source_key(what, spec, None, {})
        with self.timed(phase):
            root, _, use = self.store.get_or_make(key, phase, self.case_id, lambda d: make(d))
        self.uses.append(use)
        self.record.reuse.append(use.to_dict())
        return root

    def timed(self, phase: str) -> Any:
        """A context that adds its seconds to this case's `phase` (the case's own steps: compare, fixture)."""
        return timed(self.record, phase)

    def checks_of(self, record: WorldRecord) -> list[Check]:
        """`source-unchanged` for each stored source this case used: its files hash as they did when
        written (this env is the store's harness.core.result.CheckSource; `record` is not read)."""
        checks = []
        for use in self.uses:
            problems = self.store.verify(use) if self.store is not None else []
            detail = (f"the {use.phase} source {use.key} ({use.role}) changed while this case used it: " + "; ".join(problems[:10])
                      + "; the entry is set aside") if problems else f"the {use.phase} source {use.key} ({use.role}) hashes as written"
            checks.append(Check(SOURCE_UNCHANGED, "failed" if problems else "passed", detail, tolerance=NOT_COMPARED))
        return checks

    def _world(self, phase: str, fn: world.RankFn, arg: Any, topo: Topology | None) -> list[RankOut]:
        size = topo.world_size if topo is not None else 1
        workdir = self.case_dir / f"world-{phase}"
        call = (fn, arg, topo)
        logs = LogFiles(str(self.log_dir), safe_name(phase), kept=True) if self.log_dir is not None else None
        with self.timed(phase):
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
        return outs

    def _record(self, phase: str, outs: list[RankOut], measured_by: str | None = None) -> None:
        record = self.record
        by = {"measured_by": measured_by} if measured_by else {}
        for rank, out in enumerate(outs):
            for name, m in out.memory.items():
                key = name if name == phase else f"{phase}:{name}"
                record.memory.setdefault(key, {})[str(rank)] = {**m, "shard_bytes": getattr(out.value, "shard_bytes", 0), **by}
            if out.events:
                record.backend_events.setdefault(phase, {})[str(rank)] = out.events
        for out in outs:  # what any rank of any of the case's worlds applied, first-seen order
            record.compat_shims += [name for name in out.compat if name not in record.compat_shims]


@contextmanager
def timed(record: CaseResult | WorldRecord, phase: str) -> Iterator[None]:
    """Add the seconds the block takes to `record.phases[phase]`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        record.phases[phase] = round(record.phases.get(phase, 0.0) + time.perf_counter() - start, 3)
