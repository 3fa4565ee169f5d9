"""What a job holds, as the checks read it: the optimizer state in model space, the scheduler,
the job's sharded state for a backend (TrainingJob) and its bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from harness.compat import mcore as compat
from harness.core.parity import Shard
from harness.models.mcore import (
    load_state_dict,
    shards_of,
)
from harness.models.mcore import sharded_state_dict as model_sharded_state


def leaf_optimizers(optimizer) -> list:
    """The megatron optimizers that step: chains flattened, nested ones too (Muon's layer-wise
    distributed optimizer is itself a chain, inside the chain that adds the DistributedOptimizer)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        return [optimizer]
    return [leaf for o in chained for leaf in leaf_optimizers(o)]


def layer_wise_leaves(optimizer) -> list:
    """The leaves a LayerWiseDistributedOptimizer owns (whole params per DP rank), [] without one."""
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    if isinstance(optimizer, LayerWiseDistributedOptimizer):
        return leaf_optimizers(optimizer)
    return [leaf for o in getattr(optimizer, "chained_optimizers", []) for leaf in layer_wise_leaves(o)]


def scheduler_view(scheduler, optimizer) -> dict[str, Any] | None:
    """What a restored scheduler must hold: its state dict and the LR it put into the optimizer."""
    if scheduler is None:
        return None
    lrs = sorted({float(g["lr"]) for o in leaf_optimizers(optimizer) for g in o.param_groups})
    return {"state": {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in scheduler.state_dict().items()}, "lr": lrs}


def users_metadata(sharding: str | None, mem_efficient: bool) -> dict[str, Any]:
    """The sharded_state_dict metadata Megatron-LM builds for a job (training/checkpointing.py
    `_build_sharded_state_dict_metadata`) and saves as the checkpoint's content metadata: the
    distributed optimizer's sharding type (mem_efficient only for fully_reshardable), no singleton
    local shards, no chained-optimizer prefix. Its `dp_cp_group` is added at call time, never saved."""
    meta: dict[str, Any] = {}
    if sharding is not None:
        meta["distrib_optim_sharding_type"] = sharding
        if sharding == "fully_reshardable":
            meta["distrib_optim_fully_reshardable_mem_efficient"] = mem_efficient
    meta["singleton_local_shards"] = False
    meta["chained_optim_avoid_prefix"] = True
    return meta


def sharded_state(ddp, optimizer, sharding: str | None, mem_efficient: bool, is_loading: bool,
                  metadata: dict[str, Any] | None = None) -> dict:
    """What a training checkpoint holds: model (every chunk, harness.models.sharded_state_dict) and
    (if sharding is given) optimizer, both built with `metadata` as Megatron-LM passes it (default:
    the job's own, `users_metadata`; a load passes what the checkpoint's content metadata says)."""
    from megatron.core import parallel_state

    meta = dict(users_metadata(sharding, mem_efficient) if metadata is None else metadata)
    meta["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    state = {"model": model_sharded_state(ddp, metadata=meta)}
    if sharding is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_sharded_state(ddp, metadata=meta), is_loading=is_loading, metadata=meta)
    return state


@dataclass
class TrainingJob:
    """The live job at one rank as a backend sees it (harness.backends.TrainingState): what a
    training checkpoint saves and a resume fills. `step` is the number of optimizer steps taken."""

    chunks: list  # DDP-wrapped model chunks
    optimizer: Any
    scheduler: Any = None
    sharding: str | None = None
    mem_efficient: bool = False
    step: int = 0
    bridge: Any = None  # harness.models.bridge.BridgeModel for a Megatron-Bridge model (AutoBridge, provider, HF dir)
    seed: int = 0  # the model's seed (a backend's CPU RNG-tracker shim derives from it)
    #: False: a save leaves the optimizer state out (Megatron-LM's --no-save-optim, Bridge's
    #: CheckpointConfig.save_optim); a load still asks for it (Megatron-Bridge #5706)
    save_optim: bool = True

    def sharded_state(self, is_loading: bool, metadata: dict[str, Any] | None = None) -> dict:
        state = sharded_state(self.chunks, self.optimizer, self.sharding, self.mem_efficient, is_loading, metadata)
        if not is_loading and not self.save_optim:
            state.pop("optimizer", None)
        return state

    def content_metadata(self) -> dict[str, Any]:
        """What Megatron-LM saves as this job's checkpoint content metadata."""
        return users_metadata(self.sharding, self.mem_efficient)

    def restore(self, state: dict) -> None:
        load_state_dict(self.chunks, state["model"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])


def optimizer_view(ddp, optimizer) -> tuple[list[Shard], dict[str, Any]]:
    """The optimizer state in a topology-independent form: per model tensor key, the fp32 main
    param, exp_avg and exp_avg_sq as shards of the full tensor (megatron's canonical model-space
    representation, the one fully_reshardable saves), the distinct step values it holds, and how
    many per-param Adam step tensors are aliases of another (each param must own its step).

    For the distributed optimizer the view is built here (`_distributed_model_space`), from each
    rank's param-local ranges, not by megatron's sharded_param_state_fully_reshardable: with
    several DDP buckets that function reads params at offsets shifted by the inter-bucket padding
    (the defect the smoke `buckets` entries show), and the view is what the checks trust."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    leaves = leaf_optimizers(optimizer)
    if leaves and all(isinstance(o, DistributedOptimizer) for o in leaves):
        sd = {i: _distributed_model_space(ddp, o) for i, o in enumerate(leaves)}
    else:  # no buckets to shard across DP: megatron's per-param state dict is the state itself
        metadata = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
        sd = optimizer.sharded_state_dict(model_sharded_state(ddp), is_loading=False, metadata=metadata)
    shards = shards_of(sd, lambda sh: isinstance(sh, ShardedTensor) and sh.key.startswith("optimizer.state."))
    return shards, adam_steps(optimizer)


def main_params_view(ddp, optimizer) -> list[Shard]:
    """The distributed optimizer's fp32 main params alone, in model space (`optimizer.state.param.<key>`
    shards, as `optimizer_view`): readable where the optimizer holds no Adam state yet (a job started
    without its optimizer state), which `optimizer_view` is not."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    leaves = leaf_optimizers(optimizer)
    if not leaves or not all(isinstance(o, DistributedOptimizer) for o in leaves):
        raise ValueError("main_params_view reads the distributed optimizer's main params (use_distributed_optimizer: true)")
    sd = {i: _distributed_model_space(ddp, o, ("param",)) for i, o in enumerate(leaves)}
    return shards_of(sd, lambda sh: isinstance(sh, ShardedTensor) and sh.key.startswith("optimizer.state.param."))


def state_kinds(keys) -> str:
    """The optimizer-state kinds among `keys` (`optimizer.state.<kind>.<param>`): "exp_avg, exp_avg_sq,
    param" for Adam, momentum_buffer too where Muon steps the matrices."""
    return ", ".join(sorted({k.split(".")[2] for k in keys if k.startswith("optimizer.state.")}))


def adam_steps(optimizer) -> dict[str, Any]:
    """The distinct Adam step values the optimizer holds (param groups and per-param states) and how
    many per-param step tensors are aliases of another's (each param must own its step)."""
    steps: set[float] = set()
    step_tensors: list[torch.Tensor] = []
    for opt in leaf_optimizers(optimizer):
        for group in opt.optimizer.param_groups:
            if "step" in group:
                steps.add(float(group["step"]))
        for p_state in opt.optimizer.state.values():
            if "step" in p_state:
                steps.add(float(p_state["step"]))
                if isinstance(p_state["step"], torch.Tensor):
                    step_tensors.append(p_state["step"])
    shared = len(step_tensors) - len({id(t) for t in step_tensors})
    return {"values": sorted(steps), "shared_step_tensors": shared}


def _distributed_model_space(ddp, opt, kinds: tuple[str, ...] | None = None) -> dict:
    """A DistributedOptimizer's state in model space, independently of its own checkpoint code:
    every DP rank's (param-local range, main param and moments) gathered, each model param's full
    state rebuilt from those ranges, and wrapped in the param's own sharded metadata (factories
    included) under megatron's keys, `optimizer.state.<param|exp_avg|exp_avg_sq>.<key>`."""
    from dataclasses import replace

    import torch.distributed as dist
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import (
        extract_sharded_tensors_and_factories,
    )

    model_sd, _ = extract_sharded_tensors_and_factories(model_sharded_state(ddp))
    metadata = {sh.data: sh for sh in nested_values(model_sd)}
    keys = kinds  # ('param', *optimizer_state_keys), read once from the first state where not given
    order = [p for buffer in opt.buffers for p in buffer.param_index_map]  # the same on every DP rank
    position = {id(p): i for i, p in enumerate(order)}  # by identity: tensors compare elementwise
    index: dict[int, tuple[int, int, dict[str, int]]] = {}  # param position -> (start, end, {key: offset in flat})
    pieces: list[torch.Tensor] = []
    offset = 0
    for gbuf_range_maps in opt.gbuf_ranges:
        for buckets in gbuf_range_maps.values():
            for bucket in buckets:
                for model_param, ranges in bucket["param_map"].items():
                    state = opt._get_main_param_and_optimizer_states(model_param)
                    keys = keys or ("param", *compat.optimizer_state_keys(opt, state))
                    r = ranges["param"]
                    at = {}
                    for k in keys:
                        pieces.append(state[k].detach().float().cpu().flatten())
                        at[k], offset = offset, offset + pieces[-1].numel()
                    index[position[id(model_param)]] = (r.start, r.end, at)
    # one flat tensor and a small index per rank: all_gather_object pickles each tensor through
    # torch.save (and unpickles it through the weights-only loader), so hundreds of small ones cost
    # far more than the bytes; a fresh tensor also never drags a view's whole storage along
    flat = torch.cat(pieces) if pieces else torch.zeros(0)
    gathered: list = [None] * dist.get_world_size(opt.data_parallel_group)
    dist.all_gather_object(gathered, (index, flat), group=opt.data_parallel_group)
    # a rank that holds no shard read no keys: every rank takes them from what was gathered
    keys = next((tuple(at) for rank_index, _ in gathered for (_, _, at) in rank_index.values()), ("param",))
    out = {}
    for idx, model_param in enumerate(order):
        full = {k: torch.zeros(model_param.numel(), dtype=torch.float32) for k in keys}
        covered = torch.zeros(model_param.numel(), dtype=torch.bool)
        for rank_index, rank_flat in gathered:
            if idx in rank_index:
                start, end, at = rank_index[idx]
                covered[start:end] = True
                for k in keys:
                    full[k][start:end] = rank_flat[at[k]:at[k] + end - start]
        if not bool(covered.all()):
            raise RuntimeError(f"optimizer view: {int((~covered).sum())} elements of a param are held by no DP rank")
        sh = metadata[model_param]
        for k in keys:
            ten = full[k].reshape(sh.data.shape)
            kw = dict(key=f"optimizer.state.{k}.{sh.key}", data=ten, dtype=ten.dtype, replica_id=sh.replica_id)
            if isinstance(sh, ShardedTensorFactory):
                kw.pop("dtype")
            out[f"{k}.{idx}"] = replace(sh, **kw)  # one entry per param: layers share a stacked key
    return out


def rank_state_bytes(ddp, optimizer) -> int:
    """Bytes of training state this rank holds (model shard + its optimizer state)."""
    total = sum(t.numel() * t.element_size() for d in ddp for t in d.module.state_dict().values() if isinstance(t, torch.Tensor))
    for opt in leaf_optimizers(optimizer):
        for st in opt.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor))
    return total


def fresh_view(optimizer, scheduler) -> dict[str, Any]:
    """What a job's optimizer and scheduler hold right after a finetune start: how many Adam
    states and non-zero moment elements, the step values, the scheduler's step and the LRs in
    the optimizer (a fresh start: no state, scheduler step 0, the schedule's first LR)."""
    states = [st for o in leaf_optimizers(optimizer) for st in o.optimizer.state.values() if st]
    nonzero = sum(int(torch.count_nonzero(v)) for st in states for k, v in st.items() if k.startswith("exp_avg"))
    steps = sorted({float(st["step"]) for st in states if "step" in st})
    lrs = sorted({float(g["lr"]) for o in leaf_optimizers(optimizer) for g in o.param_groups})
    return {"adam_states": len(states), "nonzero_moments": nonzero, "steps": steps,
            "scheduler_steps": None if scheduler is None else int(scheduler.num_steps), "lrs": lrs}
