"""The training phase the training cases share (reshard-optimizer, resume, verl-checkpoint) and the
golden corpus reuses: one job at one topology built by harness.models.training, saved and loaded
through a backend. It sits with the cases, above the backends it drives; the builders below it
know no backend."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.backends import BackendRef, get_backend
from harness.core import truth
from harness.core.context import RankContext
from harness.core.memory import track
from harness.core.parity import EXACT, Shard
from harness.core.result import Check
from harness.core.topology import Topology
from harness.core.zoo import ModelSpec

# module access: rank hooks (tests/doubles.py) patch training's functions in the rank
from harness.models import training
from harness.models.builder import build_job
from harness.models.mcore import MCORE_P2P_DEFAULTS


@dataclass
class TrainOut:
    """One rank's record of a training phase (shard lists are None when the view was not asked)."""

    propagation: list[dict[str, Any]]
    losses_before_save: list[float | None]
    losses_after: list[float | None]
    optimizer_shards: list[Shard] | None = None
    steps: dict[str, Any] | None = None
    #: a loading job: the Adam step view as its (first) load left it, before any workaround rewrote
    #: the state (training.load_training); what the step check judges. None: no load
    steps_as_loaded: dict[str, Any] | None = None
    model_shards: list[Shard] | None = None
    final_shards: list[Shard] | None = None
    shard_bytes: int = 0
    #: the later segments (TrainPhase.resave_to / reload_from): per segment, losses and final weights
    losses_more: list[list[float | None]] = field(default_factory=list)
    final_more: list[list[Shard]] = field(default_factory=list)
    #: one record per save the backend finalized (async saves: harness.backends.Backend.finalize_saves)
    finalized_saves: list[dict] = field(default_factory=list)
    #: view "fresh": the optimizer and scheduler right after a finetune start (training.fresh_view)
    fresh: dict[str, Any] | None = None
    #: per step of `losses_after`: the LR it used and the grad norm (training.train_steps' trace)
    trace_after: list[dict] = field(default_factory=list)
    #: view "next": model and optimizer shards right after the first step of `losses_after` (the
    #: step past a save or a load: resume's next-step check)
    next_model: list[Shard] | None = None
    next_optimizer: list[Shard] | None = None
    #: view "main": the distributed optimizer's fp32 main params alone, where "optimizer" is viewed
    #: (training.main_params_view: a job started without Adam state has no moments to view)
    main_shards: list[Shard] | None = None


@dataclass(frozen=True)
class TrainPhase:
    """One job at one topology: build, optionally load a training checkpoint, train, record the
    optimizer view, save, train on. `backend` is the import path harness.backends.resolve gave.

    A job that checkpoints again (each of `resave_to`, after `steps_after` more steps) or resumes
    again (each of `reload_from`, likewise) then trains `steps_after` more steps: each such
    segment's losses and final weights go to `losses_more` and `final_more`. All run with the
    same backend instance, so the strategies it keeps (metadata caches) serve the later saves
    and loads, as in a Megatron-LM job that checkpoints every N steps."""

    model: ModelSpec
    topo: Topology
    cfg: training.TrainConfig
    backend: BackendRef
    sharding: str
    mem_efficient: bool
    workarounds: tuple[str, ...]
    load_from: str | None = None
    save_to: str | None = None
    steps_before_save: int = 0
    steps_after: int = 0
    first_step: int = 0
    views: tuple[str, ...] = field(default=("optimizer",))
    resave_to: tuple[str, ...] = ()
    reload_from: tuple[str, ...] = ()
    #: a finetune: start from this training checkpoint's weights (backend.load_pretrained), the job's
    #: own checkpoint directory being `run_dir`
    pretrained_from: str | None = None
    run_dir: str | None = None
    #: the finetune's reference: after its save the job restarts as a finetune would (training.restart)
    restart_after_save: bool = False
    #: False: the job's saves leave the optimizer state out (TrainingJob.save_optim)
    save_optim: bool = True


def phase_of(model: ModelSpec, opts: training.TrainOptions, backend: BackendRef, **kw: Any) -> TrainPhase:
    """A TrainPhase with the model, DDP/optimizer knobs, format and workarounds of `opts`."""
    return TrainPhase(model=model, cfg=opts.config, backend=backend, sharding=opts.sharding, mem_efficient=opts.mem_efficient,
                      workarounds=opts.workarounds, **kw)


def _finalize(ctx: RankContext, backend, out: TrainOut) -> None:
    """Complete the backend's pending (async) saves, in their own memory phase `finalize`."""
    if backend.pending_saves():
        with track("finalize"):
            out.finalized_saves.extend(backend.finalize_saves(ctx))


def _save(ctx: RankContext, backend, job: "training.TrainingJob", step: int, directory: str, out: TrainOut) -> None:
    _finalize(ctx, backend, out)  # Megatron-LM: a save first waits for the previous async save
    job.step = step
    with track("save"):
        backend.save_training(ctx, job, Path(directory))


def train_phase(ctx: RankContext, p: TrainPhase) -> TrainOut:
    backend = get_backend(p.backend)
    build = backend.builder()  # megatron DDP, or the backend's own (mcore_fsdp: Megatron-FSDP)
    p2p = {} if "vpp_overlap_p2p" in p.workarounds else MCORE_P2P_DEFAULTS  # megatron-core's own, to show the defect
    decoy = truth.DECOY_SEED_OFFSET if p.load_from or p.pretrained_from else 0  # a load must overwrite every weight
    job, propagated = build_job(build, p.model, p.topo, p.cfg, decoy, sharding=p.sharding, mem_efficient=p.mem_efficient,
                                step=p.first_step, **p2p)
    ddp, optimizer, scheduler = job.chunks, job.optimizer, job.scheduler
    job.save_optim = p.save_optim
    step = p.first_step
    as_loaded = None
    if p.load_from is not None:
        as_loaded = training.load_training(ctx, backend, job, Path(p.load_from), p.workarounds)
    if p.pretrained_from is not None:
        training.load_pretrained(ctx, backend, job, Path(p.pretrained_from), Path(p.run_dir or "."))
        step = job.step
    before = training.train_steps(ddp, optimizer, p.model, step, p.steps_before_save, scheduler)
    step += p.steps_before_save
    build.sync_params(ddp, optimizer, p.cfg)
    out = TrainOut(propagated, before, [], steps_as_loaded=as_loaded)
    if "optimizer" in p.views:
        out.optimizer_shards, out.steps = build.optimizer_view(ddp, optimizer)
    if "main" in p.views:
        out.main_shards = training.main_params_view(ddp, optimizer)
    if "optimizer" in p.views or "weights" in p.views:
        out.model_shards = build.model_shards(ddp)
    if p.save_to is not None:
        out.shard_bytes = build.rank_state_bytes(ddp, optimizer)
        _save(ctx, backend, job, step, p.save_to, out)
    if p.restart_after_save:
        scheduler, step = training.restart(optimizer, p.cfg), 0
    if "fresh" in p.views:
        out.fresh = training.fresh_view(optimizer, scheduler)
    first = 1 if "next" in p.views and p.steps_after else 0  # the step past the save/load, viewed on its own
    out.losses_after = training.train_steps(ddp, optimizer, p.model, step, first, scheduler, trace=out.trace_after)
    if first:
        build.sync_params(ddp, optimizer, p.cfg)
        out.next_optimizer, _ = build.optimizer_view(ddp, optimizer)
        out.next_model = build.model_shards(ddp)
    out.losses_after += training.train_steps(ddp, optimizer, p.model, step + first, p.steps_after - first, scheduler,
                                             trace=out.trace_after)
    step += p.steps_after
    build.sync_params(ddp, optimizer, p.cfg)
    if "final" in p.views:
        out.final_shards = build.model_shards(ddp)
    if p.resave_to and p.reload_from:
        raise ValueError("a job either saves again or loads again, not both")
    for again in p.resave_to or p.reload_from:
        if p.resave_to:
            _save(ctx, backend, job, step, again, out)
        else:
            training.load_training(ctx, backend, job, Path(again), p.workarounds)
        out.losses_more.append(training.train_steps(ddp, optimizer, p.model, step, p.steps_after, scheduler))
        step += p.steps_after
        build.sync_params(ddp, optimizer, p.cfg)
        out.final_more.append(build.model_shards(ddp))
    _finalize(ctx, backend, out)  # the end of the job: Megatron-LM finalizes what is pending
    return out


def step_check(saved: list[TrainOut], loaded: list[TrainOut], src: str, dst: str) -> Check:
    """The Adam step at D equals S and no two params share one step tensor, both read as the load left
    them (`steps_as_loaded`: before a workaround rewrote the state). A step no load writes
    (training.never_loaded: the primed sentinel) is named as never loaded, apart from a reset to 0. Sharing as loaded passes only where
    the record says a workaround (unshare_adam_step) undid it and none is left for training: the
    matrix's defect-shared-step entries run without it and show the defect as a named xfail."""
    as_loaded = [o.steps_as_loaded or o.steps for o in loaded]
    steps_s = sorted({x for o in saved for x in o.steps["values"]})
    steps_d = sorted({x for s in as_loaded for x in s["values"]})
    shared = sum(s["shared_step_tensors"] for s in as_loaded)
    left = sum(o.steps["shared_step_tensors"] for o in loaded)  # what the job trains on from here
    undone_by = sorted({w for s in as_loaded for w in s.get("rewritten_by", ())})
    detail = f"step at {src}: {steps_s}, at {dst}: {steps_d} (as the load left it)"
    if any(training.never_loaded(x) for x in steps_d):
        never = sum(s.get("never_loaded", 0) for s in as_loaded)
        detail += (f"; {never or 'some'} param(s) still hold a step no load writes (primed {training.PRIMED_STEP}): the load "
                   "never wrote their step (not a reset to 0; set to 0 to train on)")
    if shared:
        detail += f"; as loaded, {shared} param(s) share another param's Adam step tensor (each step then advances it once per param)"
        if undone_by and not left:
            detail += f"; workaround {', '.join(undone_by)} gave each param its own before training (the upstream defect it steps around)"
    if left and left != shared:
        detail += f"; {left} param(s) share another param's Adam step tensor when training goes on"
    ok = steps_s == steps_d and bool(steps_s) and not left and (not shared or bool(undone_by))
    return Check("step", "passed" if ok else "failed", detail, tolerance=EXACT)
