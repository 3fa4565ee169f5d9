"""Rank side shared by reshard-optimizer and resume: one phase of a training job.

A phase builds DDP + optimizer at its topology, optionally loads a training checkpoint, trains,
records the optimizer view, saves, and trains on. Workarounds for upstream defects are applied
only when the case lists them, and the case records which ones it applied.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness import models, training
from harness.backends import get_backend
from harness.memory import track
from harness.models import ModelSpec
from harness.topology import Topology
from harness.training import TrainConfig
from harness.world import RankContext

# Workarounds a matrix entry can switch off to show the defect behind each.
WORKAROUNDS = {
    "prime_adam": "megatron-core 0.19.2 DistributedOptimizer + plain torch Adam: loading into a never-stepped "
    "optimizer fails `assert len(steps) == 1`; the harness primes Adam state (step 0, zero moments)",
    "load_no_grad": "megatron-core 0.19.2 dp_reshardable load copies into views of leaf params that require grad "
    "('a view of a leaf Variable that requires grad is being used in an in-place operation'); "
    "the harness loads under torch.no_grad()",
    "fully_reshardable_step": "megatron-core 0.19.2 DistributedOptimizer._set_main_param_and_optimizer_states iterates the "
    "destination torch Adam state keys, 'step' included, but load_parameter_state_from_fully_reshardable "
    "leaves 'step' out of the source: KeyError 'step'; the harness passes step=None so the copy skips it",
}
WORKAROUNDS["unshare_adam_step"] = (
    "megatron-core 0.19.2 DistributedOptimizer.load_state_dict without Apex/TE puts ONE step tensor in every "
    "param's torch Adam state; Adam increments it once per param per step (3 -> 30 after one step with 27 "
    "params), corrupting bias correction after every resume; the harness gives each param its own copy"
)
DEFAULT_WORKAROUNDS = ("prime_adam", "load_no_grad", "fully_reshardable_step", "unshare_adam_step")


def _apply_fully_reshardable_step_workaround() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_ckpt_harness", False):
        return

    def skip_missing_step(self, model_param, tensors):
        return original(self, model_param, {"step": None, **tensors})

    skip_missing_step._ckpt_harness = True
    DistributedOptimizer._set_main_param_and_optimizer_states = skip_missing_step
DECOY_SEED_OFFSET = 9973


@dataclass(frozen=True)
class TrainPhase:
    model: ModelSpec
    topo: Topology
    cfg: TrainConfig
    backend: str
    sharding: str
    mem_efficient: bool
    load_from: str | None = None
    save_to: str | None = None
    steps_before_save: int = 0
    steps_after: int = 0
    first_step: int = 0
    workarounds: tuple[str, ...] = DEFAULT_WORKAROUNDS
    views: tuple[str, ...] = field(default=("optimizer",))


def train_phase(ctx: RankContext, p: TrainPhase) -> dict[str, Any]:
    from harness import compat

    backend = get_backend(p.backend)
    models.init_parallel(p.topo)
    ddp, optimizer = training.build_training(p.model, p.topo, p.cfg, DECOY_SEED_OFFSET if p.load_from else 0)
    out: dict[str, Any] = {"propagation": training.propagation(ddp, optimizer, p.cfg), "memory": {}, "compat": compat.installed()}
    step = p.first_step
    if p.load_from is not None:
        if "fully_reshardable_step" in p.workarounds:
            _apply_fully_reshardable_step_workaround()
        if "prime_adam" in p.workarounds:
            training.prime_optimizer_state(optimizer)
        guard = torch.no_grad() if "load_no_grad" in p.workarounds else nullcontext()
        with track("load") as out["memory"]["load"], guard:
            sharded = training.sharded_state(ddp, optimizer, p.sharding, p.mem_efficient, is_loading=True)
            state = backend.load_state(ctx, sharded, Path(p.load_from))
            ddp.module.load_state_dict(state["model"], strict=True)
            optimizer.load_state_dict(state["optimizer"])
        if "unshare_adam_step" in p.workarounds:
            training.unshare_adam_step(optimizer)
    out["losses_before_save"] = training.train_steps(ddp, optimizer, p.model, step, p.steps_before_save)
    step += p.steps_before_save
    if "optimizer" in p.views:
        out["optimizer_shards"], out["steps"] = training.optimizer_view(ddp, optimizer)
        out["model_shards"] = models.local_shards(ddp.module)
    if p.save_to is not None:
        out["shard_bytes"] = training.rank_state_bytes(ddp, optimizer)
        with track("save") as out["memory"]["save"]:
            backend.save_state(ctx, training.sharded_state(ddp, optimizer, p.sharding, p.mem_efficient, is_loading=False), Path(p.save_to))
    out["losses_after"] = training.train_steps(ddp, optimizer, p.model, step, p.steps_after)
    if "final" in p.views:
        out["final_shards"] = models.local_shards(ddp.module)
    out["memory"] = {k: v.to_dict() for k, v in out["memory"].items()}
    return out
