"""The rank side of async-save: one training job at S saved through an async-saving backend (and,
with fault none, through its synchronous twin at the same step), or killed while an async write
is in flight; and the jobs at D that load what it left."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from ..shared.damaged_load import RefusedLoadError, chain_text
from .train_phase import TrainOut, _finalize
from harness.backends import Backend, BackendRef, get_backend
from harness.core import truth
from harness.core.context import RankContext
from harness.core.memory import track
from harness.core.topology import Topology
from harness.core.zoo import ModelSpec
from harness.faults.hooks import ASYNC_KILL_ENV
from harness.models import training
from harness.models.builder import build_job
from harness.models.mcore import local_shards

Fault = Literal["none", "kill-writer", "kill-rank"]


@dataclass(frozen=True)
class Options(training.TrainOptions):
    #: none: the job saves the same step sync and async, trains on while the async write is in flight,
    #: finalizes; kill-writer / kill-rank: step k saved async and finalized, step k+1's async write
    #: killed in flight (its forked writer SIGKILLed, or the last rank itself)
    fault: Fault = "none"


#: the name a sync twin records its events under: the strategy check of the backend under test
#: judges that backend's own (async) saves only
TWIN_SUFFIX = ":sync-twin"


def sync_twin(backend: Backend) -> Backend:
    """The same backend with the same options but `async_save` at its synchronous default: what the
    async save must equal once finalized."""
    off = type(backend.options)().async_save
    twin = backend.configured(replace(backend.options, async_save=off))
    twin.name = backend.name + TWIN_SUFFIX
    return twin


@dataclass(frozen=True)
class SavePhase:
    model: ModelSpec
    topo: Topology
    opts: Options
    backend: BackendRef
    root: str  # the async save's checkpoint root
    sync_root: str  # fault none: the sync twin's root
    views_dir: str  # faults: each rank's state at step k and k+1 (torch.save), read even after a kill
    killed: bool = False  # a fault's second world: the save of step k+1, killed in flight


@dataclass
class SaveOut(TrainOut):
    #: rank 0: what the root's tracker named (None: no tracker file) right before the async save's finalize
    tracker_before_finalize: str | None = None
    #: saves the backend still held pending right after the async save returned (0: it finalized within the call)
    pending_after_save: int = 0
    #: the exception chain the interrupted save raised on this rank (at its finalize), or None
    save_error: str | None = None
    saved_steps: list[int] = field(default_factory=list)


def tracker_text(root: Path) -> str | None:
    """What the root's latest_checkpointed_iteration.txt names (verl's, Megatron-LM's and Bridge's
    legacy tracker), None without one."""
    from harness.backends._megatron_lm import TRACKER

    f = Path(root) / TRACKER
    return f.read_text().strip() if f.is_file() else None


def views_path(views_dir: str | Path, step: int, rank: int) -> Path:
    return Path(views_dir) / f"step{step}-rank{rank}.pt"


def kill_record(views_dir: str | Path) -> Path:
    return Path(views_dir) / "killed-writer.json"


def _dump_views(ctx: RankContext, p: SavePhase, job: training.TrainingJob) -> None:
    """This rank's model and optimizer shards at the job's step, on disk before anything is killed."""
    opt, steps = training.optimizer_view(job.chunks, job.optimizer)
    torch.save({"model": local_shards(job.chunks), "optimizer": opt, "steps": steps}, views_path(p.views_dir, job.step, ctx.rank))


def _build(p: Any, decoy: bool) -> tuple[training.TrainingJob, list]:
    return build_job(get_backend(p.backend).builder(), p.model, p.topo, p.opts.config,
                     truth.DECOY_SEED_OFFSET if decoy else 0, sharding=p.opts.sharding, mem_efficient=p.opts.mem_efficient)


def _train(job: training.TrainingJob, p: Any, steps: int, trace: list | None = None) -> list:
    losses = training.train_steps(job.chunks, job.optimizer, p.model, job.step, steps, job.scheduler, trace=trace)
    job.step += steps
    get_backend(p.backend).builder().sync_params(job.chunks, job.optimizer, p.opts.config)
    return losses


def victim_rank() -> int:
    """The rank whose async write is killed: the last rank of DP rank 0 that is not rank 0 (rank 0
    coordinates the write results; a DP replica may have nothing of its own to write: megatron-core
    saves a replicated tensor from its main replica only). Collective."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dp = [0] * dist.get_world_size()
    dist.all_gather_object(dp, parallel_state.get_data_parallel_rank(with_context_parallel=True))
    return max(r for r, d in enumerate(dp) if d == 0)


def save_rank(ctx: RankContext, p: SavePhase) -> SaveOut:
    """fault none: step k saved by the sync twin and async, the job trains on while the write is in
    flight, then finalizes. A fault's first world: step k saved async and finalized (the tracker
    then names it), its state dumped. A fault's second world (`killed`): a job trained to step k+1
    (the same state the first job reaches: training is deterministic) saves it async with the last
    rank's writer armed to be killed, trains on, finalizes; the save's error is recorded, not raised."""
    backend = get_backend(p.backend)
    job, propagated = _build(p, decoy=False)
    k = p.opts.steps
    out = SaveOut(propagated, _train(job, p, k + (1 if p.killed else 0)), [])
    root = Path(p.root)
    if p.opts.fault == "none":
        with track("save-sync"):
            sync_twin(backend).save_training(ctx, job, Path(p.sync_root))
    elif p.killed and ctx.rank == victim_rank():
        os.environ[ASYNC_KILL_ENV] = f"{p.opts.fault.removeprefix('kill-')}:{kill_record(p.views_dir)}"
    if p.opts.fault != "none":
        _dump_views(ctx, p, job)
    try:
        with track("save"):
            backend.save_training(ctx, job, root)  # a client that finalizes within its save (verl) meets a kill here
        out.saved_steps.append(job.step)
        out.pending_after_save = backend.pending_saves()
        os.environ.pop(ASYNC_KILL_ENV, None)
        # the job trains on while the write is in flight: the writer must hold the state as it was saved
        out.losses_after = _train(job, p, k if p.opts.fault == "none" else 1, out.trace_after)
        out.tracker_before_finalize = tracker_text(root) if ctx.is_rank0 else None
        _finalize(ctx, backend, out)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # torch DCP's CheckpointException is a BaseException
        if not p.killed:
            raise
        out.save_error = chain_text(exc)
    finally:
        os.environ.pop(ASYNC_KILL_ENV, None)
    return out


@dataclass(frozen=True)
class LoadPhase:
    model: ModelSpec
    topo: Topology
    opts: Options
    backend: BackendRef
    load_from: str
    first_step: int  # the step the checkpoint holds (a backend that restores the iteration sets its own)
    steps_after: int = 0


@dataclass
class LoadOut(TrainOut):
    loaded_step: int = -1


def load_rank(ctx: RankContext, p: LoadPhase) -> LoadOut:
    """A fresh (decoy) job loads `load_from` through the backend (an error of the load itself is
    raised as RefusedLoadError), records its state right after, trains `steps_after` steps. One job
    per world: a second build in the process resets megatron's RNG tracker under a loaded job."""
    backend = get_backend(p.backend)
    job, propagated = _build(p, decoy=True)
    job.step = p.first_step
    try:
        as_loaded = training.load_training(ctx, backend, job, Path(p.load_from), p.opts.workarounds)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        raise RefusedLoadError(chain_text(exc)) from exc
    out = LoadOut(propagated, [], [], steps_as_loaded=as_loaded, loaded_step=job.step)
    out.optimizer_shards, out.steps = training.optimizer_view(job.chunks, job.optimizer)
    out.model_shards = local_shards(job.chunks)
    if p.steps_after:
        out.losses_after = _train(job, p, p.steps_after, out.trace_after)
        out.final_shards = local_shards(job.chunks)
    return out
