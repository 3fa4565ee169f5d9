"""Train: the fixed, topology-independent batches through megatron-core's schedules, and the
steps around a load (the Adam priming and step workarounds, Megatron-LM's force_param_sync)."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from harness.compat import mcore as compat
from harness.core import truth
from harness.core.context import RankContext
from harness.core.memory import track
from harness.core.zoo import ModelSpec
from harness.models.parallel import rank_device
from harness.models.training.config import GLOBAL_BATCH, TrainConfig
from harness.models.training.views import TrainingJob, adam_steps, leaf_optimizers


def train_steps(ddp, optimizer, spec: ModelSpec, first_step: int, steps: int, scheduler=None,
                trace: list[dict] | None = None) -> list[float | None]:
    """Run `steps` optimizer steps (and scheduler steps, when there is one, as Megatron-LM's
    train_step does); return the global-mean loss per step (None off the last stage). `trace`, when
    given, gets each step's LR (the one the step used) and the grad norm the optimizer clipped by."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    per_rank = GLOBAL_BATCH // dp
    forward_backward = get_forward_backward_func()
    losses: list[float | None] = []
    for d in ddp:
        d.train()
    for step in range(first_step, first_step + steps):
        b = truth.train_batch(spec, step, GLOBAL_BATCH)
        rows = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        device = rank_device()
        micro = [{k: (v[i : i + 1] if k != "mask" else v).to(device) for k, v in b.items()} for i in rows]

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            out = model(mb["input_ids"], mb["position_ids"], mb["mask"], labels=mb["labels"])

            def loss_func(per_token):
                loss = per_token.float().mean()
                return loss, {"loss": loss.detach().clone()}  # the schedule divides `loss` in place

            return out, loss_func

        for d in ddp:
            d.zero_grad_buffer()
        optimizer.zero_grad()
        # Megatron-LM's data: one iterator per chunk under the interleaved schedule, where every
        # chunk reads the same micro-batches (the first takes input_ids, the last labels).
        iterators = [iter(micro) for _ in ddp]
        reports = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterators if len(ddp) > 1 else iterators[0],
            model=ddp,
            num_microbatches=len(micro),
            seq_length=spec.seq_length,
            micro_batch_size=1,
            forward_only=False,
        )
        lr = max(float(g["lr"]) for o in leaf_optimizers(optimizer) for g in o.param_groups)
        ok, grad_norm, _ = optimizer.step()
        if trace is not None:
            trace.append({"lr": lr, "grad_norm": None if grad_norm is None else float(grad_norm)})
        if not ok:
            raise RuntimeError(f"optimizer step {step} was skipped (found inf/nan)")
        if scheduler is not None:
            scheduler.step(increment=1)
        if parallel_state.is_pipeline_last_stage():
            local = torch.stack([r["loss"] for r in reports]).mean()
            dist.all_reduce(local, group=parallel_state.get_data_parallel_group())
            losses.append(float(local) / dp)
        else:
            losses.append(None)
    return losses


#: The per-param Adam step `prime_optimizer_state` writes before a load. No load writes it (a saved
#: step is a whole number >= 0), so a step still at it after the load was never loaded, which a step
#: check tells apart from a load that restores 0. Not -1: megatron-core's fsdp_dtensor load first
#: steps the optimizer itself (`_init_optimizer_states_with_dummy_values`), and torch Adam cannot
#: step from -1 (bias correction 1 - beta**0 divides by zero); from -0.5 it reaches 0.5, no load's either.
PRIMED_STEP = -0.5


def never_loaded(step: float) -> bool:
    """A per-param step no load writes: the primed one, or it stepped by upstream before the load."""
    return step < 0 or step != int(step)


def _fill_adam_state(optimizer, step: float, moments: float) -> None:
    """Give every param of a torch Adam that has no state yet `step` and moments filled with `moments`;
    any other optimizer (Muon: a momentum buffer) gets its own state (`_fill_own_state`)."""
    for opt in leaf_optimizers(optimizer):
        inner = opt.optimizer
        if not isinstance(inner, torch.optim.Adam):
            _fill_own_state(opt, step, moments)
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state.get(p):
                    inner.state[p] = {
                        "step": torch.tensor(step),
                        "exp_avg": torch.full_like(p, moments, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.full_like(p, moments, memory_format=torch.preserve_format),
                    }


def _fill_own_state(opt, step: float, moments: float) -> None:
    """A non-Adam optimizer's state, as megatron-core creates it for a checkpoint (the leaf's own
    `init_state_fn`: Muon's momentum_buffer), its tensors then filled with `moments` and any `step`
    set to `step`, for the params that had none. No init_state_fn (torch SGD in Core 0.19.2): left
    alone, as megatron-core leaves it."""
    init = getattr(opt, "init_state_fn", None)
    inner = opt.optimizer
    if init is None:
        return
    fresh = [p for g in inner.param_groups for p in g["params"] if not inner.state.get(p)]
    if not fresh:
        return
    init(inner, getattr(opt, "config", None))
    for p in fresh:
        st = inner.state.get(p, {})
        for k, v in st.items():
            if not isinstance(v, torch.Tensor):
                continue
            if k == "step":
                v.fill_(step)
            elif v.is_floating_point():
                v.fill_(moments)


def prime_optimizer_state(optimizer) -> None:
    """Give a fresh torch Adam state for a load to overwrite: step PRIMED_STEP and NaN moments, values
    no load writes, so whatever the load leaves alone shows as never loaded (never as a plausible 0).

    megatron-core 0.19.2 with plain torch.optim.Adam (no Apex/TE): loading into a never-stepped
    optimizer hits `assert len(steps) == 1` in DistributedOptimizer; primed state avoids it.
    """
    _fill_adam_state(optimizer, PRIMED_STEP, float("nan"))


def stepped_once_state(optimizer) -> None:
    """What one Adam step with zero gradients leaves (step 1, zero moments), for a never-stepped
    optimizer that must be saved (megatron-core cannot save one either): a saved step of 1, not 0,
    so a load that resets the step to 0 cannot pass for one that restored it."""
    _fill_adam_state(optimizer, 1.0, 0.0)


def settle_unloaded_steps(optimizer) -> int:
    """Set each per-param step a load left unwritten (`never_loaded`) to 0, a fresh Adam's count, and
    return how many, so training goes on as from a reset step rather than from a fraction. Run after
    the step check's view was taken: it judges what the load did."""
    settled = 0
    for opt in leaf_optimizers(optimizer):
        for st in opt.optimizer.state.values():
            step = st.get("step")
            if isinstance(step, torch.Tensor) and never_loaded(float(step)):
                step.fill_(0.0)  # in place: a step tensor the load shared between params stays shared
                settled += 1
    return settled


def unshare_adam_step(optimizer) -> int:
    """Give every param's Adam state its own step tensor (workaround 'unshare_adam_step', harness.compat.registry);
    return how many of them were another param's (what the workaround undid: 0 when upstream shared none)."""
    seen: dict[int, torch.Tensor] = {}  # keeps each original alive, so no id is reused while counting
    shared = 0
    for opt in leaf_optimizers(optimizer):
        for st in opt.optimizer.state.values():
            step = st.get("step")
            if isinstance(step, torch.Tensor):
                shared += id(step) in seen
                seen[id(step)] = step
                st["step"] = step.clone()
    return shared


def load_training(ctx: RankContext, backend, job: TrainingJob, directory: Path, workarounds: tuple[str, ...]) -> dict[str, Any]:
    """backend.load_training into the live job, with the megatron-core workarounds the case lists
    applied around it (whatever the backend: mcore_dist or a client like verl's manager).

    Returns the Adam step view as the load left it (`adam_steps`, read before any workaround rewrites
    the state: the step check judges upstream's load, not the harness's repair) with `rewritten_by`,
    the workarounds that then changed it (unshare_adam_step, where upstream shared step tensors), and
    with prime_adam `never_loaded`: how many per-param steps the load left at PRIMED_STEP (then set
    to 0 so training can go on)."""
    if "fully_reshardable_step" in workarounds:
        compat.apply_workaround("fully_reshardable_step")
    if "prime_adam" in workarounds:
        prime_optimizer_state(job.optimizer)
    guard = torch.no_grad() if "load_no_grad" in workarounds else nullcontext()
    with track("load"), guard:
        backend.load_training(ctx, job, directory)
    as_loaded = adam_steps(job.optimizer)
    as_loaded["rewritten_by"] = []
    if "prime_adam" in workarounds:
        as_loaded["never_loaded"] = settle_unloaded_steps(job.optimizer)
    if "unshare_adam_step" in workarounds and unshare_adam_step(job.optimizer):
        as_loaded["rewritten_by"].append("unshare_adam_step")
    return as_loaded


def sync_params(ddp, optimizer, cfg: TrainConfig) -> None:
    """What Megatron-LM's save_checkpoint_and_time does before it saves (force_param_sync): with
    overlap_param_gather the distributed optimizer's step leaves the param all-gather to the next
    forward's pre-hooks, so until then each rank's params hold stale values outside its own shard.
    Forced here before any save and before any weights are read."""
    if not cfg.overlap_param_gather:
        return
    compat.prepare_param_sync(optimizer)
    for d in ddp:
        d.start_param_sync(force_sync=True)


def load_pretrained(ctx: RankContext, backend, job: TrainingJob, directory: Path, run_dir: Path) -> None:
    """backend.load_pretrained into the live job: a finetune's start from `directory`'s weights.
    No optimizer workaround applies: a finetune loads no optimizer state."""
    with track("load"):
        backend.load_pretrained(ctx, job, directory, run_dir)


def restart(optimizer, cfg: TrainConfig):
    """What a finetune start keeps of a trained job: its weights only. The Adam state goes (a
    fresh torch Adam has none until its first step), bf16 main params are reloaded from the bf16
    weights (what Megatron-LM and Bridge do when they load no optimizer: `reload_model_params`),
    and a new scheduler starts at step 0 (returned). The reference a finetune's trajectory is
    judged against."""
    from harness.models.training.build import build_scheduler

    for opt in leaf_optimizers(optimizer):
        opt.optimizer.state.clear()
    if cfg.dtype == "bf16":
        optimizer.reload_model_params()
    return build_scheduler(optimizer, cfg)
