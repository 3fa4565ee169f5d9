"""The rank side of verl-checkpoint: one verl training job at one topology, built the way verl's
Megatron engine builds it, saved or resumed through verl's checkpoint manager (the verl_manager
backend), with the views the case judges (RNG digests, scheduler, optimizer, adapters)."""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from .train_phase import TrainOut
from harness.core.context import RankContext
from harness.core.topology import Topology
from harness.models.training import TrainOptions

RNG_SEED = 424242  # + the step: the RNG state the last save carries
DECOY_RNG_SEED = 777  # what the resuming job holds before its load


@dataclass(frozen=True)
class Options(TrainOptions):
    min_steps: ClassVar[int] = 0  # 0: save the untrained job (a Bridge model then exports the fixture itself)
    steps: int = 2
    lr_schedule: Literal["none", "warmup-cosine"] = "warmup-cosine"
    saves: int = 1  # consecutive saves through one manager, a step apart (max_ckpt_to_keep)
    refuse_with: tuple[str, ...] = ("CheckpointingException",)
    adapter: Literal["none", "lora", "canonical_lora"] = "none"  # a PEFT job (Bridge model): verl's peft_cls

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.saves < 1:
            raise ValueError(f"option 'saves' must be >= 1, got {self.saves}")



@dataclass(frozen=True)
class VerlPhase:
    model: Any  # ModelSpec | HFModelSpec
    topo: Topology
    opts: Options
    backend: Any  # BackendRef
    ckpt: str
    hf_dir: str | None
    load: bool


@dataclass
class VerlOut(TrainOut):
    coords: tuple[int, int] = (0, 0)  # (pp rank, tp rank)
    scheduler: dict | None = None
    rng: dict[str, str] = field(default_factory=dict)
    saved_steps: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # (adapter) Megatron+LoRA logits at S, on the rank that has them
    #: the loading job's RNG digest and scheduler view right before its load (the decoys the load must
    #: overwrite); None: not recorded (a save rank), so the judges cannot tell a restore from no load
    rng_before: dict[str, str] | None = None
    scheduler_before: dict | None = None


def set_rng(seed: int) -> None:
    """Every RNG a verl checkpoint carries, to a state derived from `seed` (same on every DP rank)."""
    import random

    import numpy as np

    from harness.compat.verl import verl_rng_tracker_state

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        verl_rng_tracker_state(seed)


def rng_digest() -> dict[str, str]:
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    def h(obj: Any) -> str:
        return hashlib.sha256(pickle.dumps(obj)).hexdigest()[:16]

    tracker = {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    np_state = np.random.get_state()
    return {"random": h(random.getstate()), "numpy": h((np_state[0], np_state[1].tolist(), *np_state[2:])),
            "torch": h(torch.get_rng_state().tolist()), "tracker": h(tracker)}


def adapter_spec(model: Any, kind: str):
    """The Bridge adapter of option `adapter` (None for `none`), as case peft-export builds it."""
    if kind == "none":
        return None
    from ..shared.peft import PeftOptions

    return PeftOptions(adapter=kind).spec(model)


def build_job(p: VerlPhase, decoy: bool):
    """The job at this rank: GPT zoo (harness.models.training) or a Bridge model (provider path), with the
    case's optimizer knobs and LR scheduler. A decoy job starts from other weights."""
    from harness.core import truth
    from harness.models.training import TrainingJob, build_scheduler, build_training

    cfg = p.opts.config
    bm = None
    if p.model.kind == "gpt":
        chunks, optimizer = build_training(p.model, p.topo, cfg, truth.DECOY_SEED_OFFSET if decoy else 0)
    else:
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from harness.backends import get_backend

        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=cfg.use_distributed_optimizer)
        # the backend builds it as its client does (verl: Megatron-Bridge's provider, or mbridge); decoy: the model's own init,
        # except with adapters: verl's engine loads the HF base at build, only the adapters come from the checkpoint
        adapter = adapter_spec(p.model, p.opts.adapter)
        bm = get_backend(p.backend).build_bridge_model(p.hf_dir, p.model, p.topo, load_weights=not decoy or adapter is not None,
                                                       ddp_config=ddp_config, adapter=adapter)
        if adapter is not None:
            from harness.models import bridge as mb

            mb.fill_adapters(bm, p.model, replace(adapter, seed=adapter.seed + 1) if decoy else adapter)
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=cfg.lr, min_lr=cfg.lr / 100 if cfg.lr_schedule != "none" else None, weight_decay=cfg.weight_decay,
            use_distributed_optimizer=cfg.use_distributed_optimizer, bf16=False, fp16=False, params_dtype=torch.float32, clip_grad=1.0,
        ), bm.modules)
        chunks = bm.modules
    scheduler = build_scheduler(optimizer, cfg)
    return TrainingJob(chunks, optimizer, scheduler, sharding=p.opts.sharding, mem_efficient=p.opts.mem_efficient, bridge=bm,
                       seed=p.model.seed)


def _views(out: VerlOut, job) -> None:
    from harness.models.mcore import local_shards
    from harness.models.training import optimizer_view, scheduler_view

    out.model_shards = local_shards(job.chunks)
    out.optimizer_shards, out.steps = optimizer_view(job.chunks, job.optimizer)
    out.scheduler = scheduler_view(job.scheduler, job.optimizer)


def verl_rank(ctx: RankContext, p: VerlPhase) -> VerlOut:
    from megatron.core import parallel_state

    from harness.backends import get_backend
    from harness.core.memory import track
    from harness.models.training import (
        load_training,
        stepped_once_state,
        train_steps,
    )
    from harness.run.preload import warm

    backend = get_backend(p.backend)
    # what a forked rank inherits from the parent (harness.run.preload.warm): importing verl's checkpoint
    # manager advances Python's global `random`, so a spawned rank (NCCL's) that imported it inside the
    # save would save another state than the one the rng check digested before it
    warm(modules=backend.preload)
    job = build_job(p, decoy=p.load)
    out = VerlOut([], [], [], coords=(parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()))
    ddp, opts = job.chunks, p.opts
    if p.load:
        from harness.models.training import scheduler_view

        set_rng(DECOY_RNG_SEED)
        out.rng_before = rng_digest()
        out.scheduler_before = scheduler_view(job.scheduler, job.optimizer)
        out.steps_as_loaded = load_training(ctx, backend, job, Path(p.ckpt), opts.workarounds)
        _views(out, job)
        out.rng = rng_digest()
        return out
    step = 0
    if p.model.kind == "gpt" and opts.steps:
        out.losses_before_save = train_steps(ddp, job.optimizer, p.model, 0, opts.steps, job.scheduler)
        step = opts.steps
    elif "prime_adam" in opts.workarounds:  # megatron-core: a never-stepped torch Adam cannot be saved either
        stepped_once_state(job.optimizer)
    if opts.adapter != "none":
        from harness.models import bridge as mb

        out.logits = mb.megatron_logits(job.bridge, p.model, ctx.device)
    for i in range(opts.saves):
        if i:
            if p.model.kind == "gpt":
                train_steps(ddp, job.optimizer, p.model, step, 1, job.scheduler)
            step += 1
        if i == opts.saves - 1:
            _views(out, job)
            set_rng(RNG_SEED + step)
            out.rng = rng_digest()
        job.step = step
        with track("save"):
            backend.save_training(ctx, job, Path(p.ckpt))
        out.saved_steps.append(step)
    return out
