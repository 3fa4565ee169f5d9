"""The packing scheduler (`--gpus-per-node N`): GPU packing on one node (issue 20 item 2): several cases at once, each on its own GPU set.

Without it a node runs one world at a time (`--jobs` > 1 refuses NCCL), so a 1- or 2-rank case of
the nightly GPU matrix leaves 6-7 of 8 GPUs idle. A case needs as many GPUs as its largest world,
max(source, target world size): its worlds run one after another, each at most that big (a
read-back world has 1 rank). A case needing more than the node has is refused (`not-run`, with
the reason) before anything starts.

Policy, greedy list scheduling largest first: cases wait in order of need, then duration (a
previous results.json's, `--durations`, else _balance.estimate), then id; whenever GPUs are free the
first waiting case that fits starts on the lowest-numbered contiguous free GPUs (any free ones when
no run is long enough). One `Packer` decides for `plan` (a simulated clock and estimated durations:
the predicted schedule) and for `run_packed` (the real clock: a set freed when a case ends goes to
the next case that fits, whatever the estimates said).

Each case runs in its own worker process: CUDA_VISIBLE_DEVICES is set there to its set before
anything in it initialises CUDA, and the ranks it starts inherit it, so rank r sits on the set's
r-th GPU. Workers of a GPU run are children of a forkserver (megatron-core preloaded), never of
this process: its imports may have touched CUDA, and a forked child of such a process cannot use
CUDA (a rank's result holding a CUDA tensor is loaded in the worker). Gloo workers are forked from
this process when it has one thread (the imports inherited), as the pool scheduler does. CKPT_HARNESS_GPUS carries the same set: gloo
ranks hide their GPUs (harness.run.world), so a CPU run with a made-up node size shows the set
there. Worlds rendezvous through a FileStore in their own directory (no port to share); torchrun's
--standalone picks a free port per world. The schedule lands in each result's `placement`
(harness.core.schedule) and its summary in results.md.
"""

from __future__ import annotations

import heapq
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any, Callable, Sequence

from harness.core.result import CaseResult
from harness.core.schedule import Placement, Summary, summarize
from harness.orchestration.schedulers import Scheduler, Settings
from harness.orchestration.schedulers._balance import estimate, source_group
from harness.orchestration.schedulers._common import bare as _bare, preload

#: what a packed case's worker and ranks find their GPU set in (indices into the node's visible GPUs
#: mapped to CUDA_VISIBLE_DEVICES' entries); gloo ranks clear CUDA_VISIBLE_DEVICES but keep this
ENV_GPUS = "CKPT_HARNESS_GPUS"


@dataclass(frozen=True)
class Job:
    """One case as the packer sees it: its place in the input, id, GPU need and expected seconds."""

    index: int
    id: str
    need: int
    seconds: float
    #: its likely stored source (schedulers._balance.source_group): it waits while another
    #: case of the group runs and none has finished (that one is writing the source it would wait for)
    group: str = ""


def need_of(spec: Any) -> int:
    """GPUs a case holds: its largest world's ranks."""
    return max(spec.source.world_size, spec.target.world_size)


def jobs_of(specs: Sequence[Any], durations: dict[str, float] | None = None) -> list[Job]:
    durations = durations or {}
    return [Job(i, s.id, need_of(s), durations.get(s.id) or estimate(s), source_group(s)) for i, s in enumerate(specs)]


def refusal(need: int, node_gpus: int) -> str | None:
    """Why a case of `need` GPUs cannot run on the node, or None."""
    if need <= node_gpus:
        return None
    return (f"needs {need} GPUs (its largest world has {need} ranks) but the node has {node_gpus} "
            f"(--gpus-per-node {node_gpus}): a case's worlds do not span nodes here")


def pick_gpus(free: set[int], n: int) -> tuple[int, ...]:
    """`n` of the free GPUs: the lowest-numbered contiguous run of n (neighbours share a switch on
    most nodes), else the n lowest."""
    if n > len(free):
        raise ValueError(f"{n} GPUs asked of {len(free)} free")
    ordered = sorted(free)
    for i in range(len(ordered) - n + 1):
        if ordered[i + n - 1] - ordered[i] == n - 1:
            return tuple(ordered[i:i + n])
    return tuple(ordered[:n])


class Packer:
    """The policy: who starts next on which GPUs. `take` starts the first waiting case that fits the
    free GPUs (None when none does); `release` gives a finished case's set back."""

    def __init__(self, jobs: Sequence[Job], node_gpus: int):
        if node_gpus < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got {node_gpus}")
        self.node_gpus = node_gpus
        self.refused = {j.index: reason for j in jobs if (reason := refusal(j.need, node_gpus))}
        self.pending = sorted((j for j in jobs if j.index not in self.refused), key=lambda j: (-j.need, -j.seconds, j.id, j.index))
        self.free = set(range(node_gpus))
        self.group_of = {j.index: j.group for j in jobs}
        self.writing: set[str] = set()  # groups with a case running and none finished
        self.written: set[str] = set()

    def take(self) -> tuple[Job, tuple[int, ...]] | None:
        for i, job in enumerate(self.pending):
            if job.group in self.writing:
                continue  # its source is being written: it would hold GPUs waiting on the store's lock
            if job.need <= len(self.free):
                if job.group and job.group not in self.written:
                    self.writing.add(job.group)
                del self.pending[i]
                gpus = pick_gpus(self.free, job.need)
                self.free -= set(gpus)
                return job, gpus
        return None

    def release(self, gpus: tuple[int, ...], index: int | None = None) -> None:
        """`gpus` back to the node; `index`: the job that held them (its group's source is written)."""
        if self.free & set(gpus):
            raise RuntimeError(f"GPUs {sorted(self.free & set(gpus))} released twice")
        self.free |= set(gpus)
        group = self.group_of.get(index, "") if index is not None else ""
        if group:
            self.writing.discard(group)
            self.written.add(group)


@dataclass
class Plan:
    """A predicted schedule: each placed job's Placement (by job index), in start order, and the refused."""

    node_gpus: int
    jobs: list[Job]
    placements: dict[int, Placement] = field(default_factory=dict)
    refused: dict[int, str] = field(default_factory=dict)

    def summary(self) -> Summary | None:
        return summarize(list(self.placements.values())) if self.placements else None


def plan(jobs: Sequence[Job], node_gpus: int) -> Plan:
    """Run the Packer on a simulated clock: each job takes its `seconds`; at an instant, every job
    ending then gives its GPUs back before any job starts."""
    packer = Packer(jobs, node_gpus)
    out = Plan(node_gpus, list(jobs), refused=dict(packer.refused))
    running: list[tuple[float, int, tuple[int, ...]]] = []
    now = 0.0
    while True:
        while (took := packer.take()) is not None:
            job, gpus = took
            out.placements[job.index] = Placement(gpus, node_gpus, now, now + job.seconds)
            heapq.heappush(running, (now + job.seconds, job.index, gpus))
        if not running:
            return out  # every job fits an empty node, so nothing is left waiting here
        now = running[0][0]
        while running and running[0][0] <= now:
            _, index, gpus = heapq.heappop(running)
            packer.release(gpus, index)


def _devices(gpus: tuple[int, ...], visible: list[str]) -> str:
    """CUDA_VISIBLE_DEVICES for a set: entries of this process's own list when it has one (a runner
    given GPUs 4-7 hands out 4-7), else the indices."""
    return ",".join(visible[g] if visible else str(g) for g in gpus)


def visible_devices() -> list[str]:
    """This process's CUDA_VISIBLE_DEVICES entries ([] when unset or empty)."""
    return [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]


def check_node(node_gpus: int, dist_backend: str, launcher: str = "mp", torchrun_template: str | None = None) -> None:
    """ValueError when a packed run cannot hold: a node bigger than the GPUs this process sees (except
    under gloo, where the sets are labels and the worlds run on CPU), or a multi-node torchrun template."""
    import torch

    if node_gpus < 1:
        raise ValueError(f"--gpus-per-node must be >= 1, got {node_gpus}")
    if launcher == "torchrun" and torchrun_template:
        raise ValueError("--gpus-per-node packs cases on one node: it cannot take a --torchrun-template (multi-node)")
    seen = torch.cuda.device_count()
    if dist_backend == "nccl" and seen < node_gpus or dist_backend == "auto" and 0 < seen < node_gpus:
        raise ValueError(f"--gpus-per-node {node_gpus} but this process sees {seen} GPU(s) "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')!r})")


def start_method(dist_backend: str) -> str:
    """fork for gloo workers from a one-thread process, else forkserver (see the module's docstring)."""
    return "fork" if dist_backend == "gloo" and threading.active_count() == 1 else "forkserver"


def _worker(conn, run_one: Callable, spec: Any, options: Any, devices: str) -> None:
    """One case in its own process on its own GPUs; the result goes back through `conn`."""
    from harness.core import requires

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the world's `finally` kills its ranks
    os.environ["CUDA_VISIBLE_DEVICES"] = os.environ[ENV_GPUS] = devices
    requires.probe.cache_clear()  # the parent's answer counted the whole node
    try:
        result = run_one(spec, options)
    except BaseException as exc:  # noqa: BLE001 - run_case reports its own errors; this is the harness failing
        result = _bare(spec, "error", error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    conn.send(result)
    conn.close()


def run_packed(specs: Sequence[Any], options: Any, run_one: Callable[[Any, Any], CaseResult], node_gpus: int,
               durations: dict[str, float] | None = None, on_result: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
    """Every spec run by `run_one(spec, options)` (runner.run_case) in its own worker on its own GPU
    set of a `node_gpus` node; results in input order, `on_result` as each finishes (refused ones
    first). Each result's `placement` says where and when it ran."""
    check_node(node_gpus, options.dist_backend, options.launcher, options.torchrun_template)
    jobs = jobs_of(specs, durations)
    packer = Packer(jobs, node_gpus)
    results: dict[int, CaseResult] = {}
    for index, reason in packer.refused.items():
        results[index] = _bare(specs[index], "not-run", not_run_reason=reason)
        if on_result:
            on_result(results[index])
    visible = visible_devices() if options.dist_backend != "gloo" else []
    method = start_method(options.dist_backend)
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(["harness.run.forkserver_preload"])  # as harness.run.world does
    ctx = multiprocessing.get_context(method)
    running: dict[Any, tuple[Any, Job, tuple[int, ...], float, str]] = {}
    started, t0 = time.time(), time.perf_counter()
    try:
        while packer.pending or running:
            while (took := packer.take()) is not None:
                job, gpus = took
                devices = _devices(gpus, visible)
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker, args=(writer, run_one, specs[job.index], options, devices),
                                   name=f"case-{job.index}")
                proc.start()
                writer.close()  # the worker holds the only writer: its death reads as EOF here
                running[reader] = (proc, job, gpus, time.perf_counter() - t0, devices)
            if not running:  # cannot happen: every waiting case fits the empty node
                raise RuntimeError(f"{len(packer.pending)} case(s) wait on an idle {node_gpus}-GPU node")
            for reader in wait(list(running)):
                proc, job, gpus, start, devices = running.pop(reader)
                try:
                    result = reader.recv()
                except EOFError:
                    proc.join()
                    result = _bare(specs[job.index], "error", error=f"the worker running this case on GPUs {list(gpus)} "
                                   f"died (exit code {proc.exitcode}) before it reported")
                proc.join()
                reader.close()
                result.placement = Placement(gpus, node_gpus, start, time.perf_counter() - t0, started, devices).to_json()
                packer.release(gpus, job.index)
                results[job.index] = result
                if on_result:
                    on_result(result)
    finally:
        for reader, (proc, *_rest) in running.items():  # only when the loop raised (Ctrl-C): end the cases still running
            proc.terminate()
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()
            reader.close()
    return [results[i] for i in range(len(specs))]


def plan_lines(jobs: Sequence[Job], planned: Plan) -> list[str]:
    """The predicted schedule for people (`ckpt-harness list --gpus-per-node N`): one line per case in
    start order (refused ones first), then the summary."""
    def when(job: Job) -> tuple[float, tuple[int, ...], int]:
        p = planned.placements.get(job.index)
        return (p.start_s, p.gpus, job.index) if p else (-1.0, (), job.index)

    lines = []
    for job in sorted(jobs, key=when):
        if (p := planned.placements.get(job.index)) is None:
            lines.append(f"refused: {planned.refused[job.index]}  {job.id}")
        else:
            lines.append(f"gpus {','.join(map(str, p.gpus)):15} {p.start_s:8.1f} -> {p.end_s:8.1f} s  {job.id}")
    if (summary := planned.summary()) is not None:
        lines.append(f"predicted: {summary.line()}")
    return lines


class Packing(Scheduler):
    name = "packing"

    def __init__(self, node_gpus: int, durations: dict[str, float] | None = None):
        self.node_gpus, self.durations = node_gpus, durations

    def check(self, specs, options) -> None:
        check_node(self.node_gpus, options.dist_backend, options.launcher, options.torchrun_template)

    def run(self, specs, options, run_one, on_result=None) -> list[CaseResult]:
        specs = list(specs)
        preload(specs)
        return run_packed(specs, options, run_one, self.node_gpus, self.durations, on_result)


def make(settings: Settings) -> Packing:
    if settings.jobs > 1:
        raise ValueError("--gpus-per-node packs cases by their GPU need: it cannot take --jobs too")
    if not settings.gpus_per_node:
        raise ValueError("the packing scheduler needs --gpus-per-node N")
    return Packing(settings.gpus_per_node, settings.durations)
