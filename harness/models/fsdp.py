"""Megatron-FSDP jobs: the harness's GPT-zoo models (dense and MoE) wrapped in megatron-core's
FullyShardedDataParallel (distributed/fsdp/mcore_fsdp_adapter.py) the way Megatron-Bridge's training
builds them with `use_megatron_fsdp` (Megatron-LM's `--use-megatron-fsdp` alike):

  model      build_gpt's chunks with the canonical weights, wrapped by Bridge's own `_ddp_wrap`
             (models/common/unimodal.py, megatron.training's dist_utils) with use_megatron_fsdp=True,
             the DDP config Bridge's ConfigContainer validation sets (use_megatron_fsdp and
             use_distributed_optimizer on) and the sharding strategy asked (default optim_grads_params)
  optimizer  megatron-core's get_megatron_optimizer over the wrapped chunks (its Megatron-FSDP branch:
             a DistributedOptimizer whose params are Megatron-FSDP's main-weight DTensors), then
             Bridge's _update_model_config_funcs (no_sync / grad_sync / finalize / grad scale funcs)

The checks read a job in megatron's checkpoint-key space, as they read a DDP job: each wrapped chunk
keeps a plain GPTModel of the same topology (`FsdpChunks.mirrors`); a view gathers every DTensor to
its full tensor with Megatron-FSDP's own `uneven_dtensor_to_full_tensor` (a collective over the
tensor's mesh), takes this rank's TP slice (the mirror param's megatron TP attributes) and reads it
through the mirror's sharded_state_dict. No view is what a backend saves: the backend saves the
wrapped chunks' DTensor state dict.

pp 1 only: the fsdp_dtensor state dict names parameters by module path, which repeats on every
pipeline stage (harness.backends.mcore_fsdp refuses pp > 1 at matrix load).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from harness.core.parity import Shard
from harness.core.topology import Topology
from harness.core.zoo import ModelSpec

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


class FsdpChunks(list):
    """The rank's FullyShardedDataParallel chunks (a list, as get_model returns) and, per chunk, the
    plain GPTModel the views read through."""

    def __init__(self, chunks: list, mirrors: list, strategy: str) -> None:
        super().__init__(chunks)
        self.mirrors = mirrors
        self.strategy = strategy


def tail(name: str) -> str:
    """A parameter or state-dict name without the wrappers' leading 'module.' segments."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def require_shims(topo: Topology) -> None:
    """The CPU shims a Megatron-FSDP build needs here (each applies only where its probe finds the
    condition: none on a CUDA rank). Collective: the gloo probe reduces over the world."""
    from harness.compat import require
    from harness.compat.cuda import (
        FSDP_DEVICE,
        FSDP_GLOO_PREMUL_SUM,
        FSDP_GLOO_UNEVEN_ALL_GATHER,
    )
    from harness.compat.gloo import FSDP_GLOO_SERIAL_COALESCING
    from harness.models.parallel import rank_device

    device = rank_device()
    require(FSDP_DEVICE, device)
    require(FSDP_GLOO_PREMUL_SUM, device)
    require(FSDP_GLOO_UNEVEN_ALL_GATHER, device)
    require(FSDP_GLOO_SERIAL_COALESCING, device)
    if topo.tp > 1 or topo.etp > 1:  # the adapter broadcasts TP rank 0's RNG states, torch.cuda's included
        from harness.compat.bridge_training import CUDA_RNG_STATE

        require(CUDA_RNG_STATE, device)


def ddp_config(cfg: Any, strategy: str):
    """The DDP config of a Megatron-FSDP job (Bridge's _validate_and_apply_megatron_fsdp_configs: both
    use_megatron_fsdp and use_distributed_optimizer on), with the case's knobs."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        use_distributed_optimizer=True,
        data_parallel_sharding_strategy=strategy,
        overlap_grad_reduce=cfg.overlap_grad_reduce,
        overlap_param_gather=cfg.overlap_param_gather,
        bucket_size=cfg.bucket_size or None,
        grad_reduce_in_fp32=cfg.grad_reduce_in_fp32,
    )


def wrap(chunks: list, config: Any, topo: Topology) -> list:
    """`chunks` in FullyShardedDataParallel, through Megatron-Bridge's `_ddp_wrap`."""
    from harness.compat.te import import_megatron_bridge

    require_shims(topo)
    import_megatron_bridge()
    from megatron.bridge.models.common.unimodal import _ddp_wrap
    from megatron.core.process_groups_config import ProcessGroupCollection

    return _ddp_wrap(chunks, False, config, False, use_megatron_fsdp=True,
                     pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def tp_local(full: torch.Tensor, like: torch.nn.Parameter) -> torch.Tensor:
    """This rank's TP slice of `full` (a parameter's tensor over every TP rank), shaped like `like`."""
    from megatron.core import parallel_state as ps

    if getattr(like, "tensor_model_parallel", False) and tuple(full.shape) != tuple(like.shape):
        expert = not getattr(like, "allreduce", True)
        size = ps.get_expert_tensor_parallel_world_size() if expert else ps.get_tensor_model_parallel_world_size()
        rank = ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank()
        full = full.chunk(size, dim=like.partition_dim)[rank]
    return full.reshape(like.shape)


def gathered(t: Any, like: torch.nn.Parameter) -> torch.Tensor:
    """Collective: a Megatron-FSDP DTensor (or a plain tensor) as this rank's TP slice, like `like`."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import uneven_dtensor_to_full_tensor
    from torch.distributed.tensor import DTensor

    full = uneven_dtensor_to_full_tensor(t) if isinstance(t, DTensor) else t
    return tp_local(full.detach(), like)


def compute_weights(fsdp: Any) -> dict[str, Any]:
    """The weights a chunk's forward runs with, by parameter name, as DTensors shaped like its main
    weights: each parameter group's model weight buffer (what Megatron-FSDP all-gathers for the
    forward; bf16 in a bf16 job), read the way its _init_distributed_params reads it; with no such
    buffer (no_shard) the main weight, which is then the module's own parameter."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import make_fsdp_dtensor

    buffers = fsdp.module.param_and_grad_buffer
    sharded = buffers.bucketing_policy.data_parallel_sharding_strategy != "no_shard"
    out = {}
    for group in buffers.parameter_groups:
        wbuf = group.model_weight_buffer
        for item_id, orig in enumerate(group.params):
            name = buffers.param_to_name[orig]
            out[name] = buffers.dist_main_weight[name] if wbuf is None else make_fsdp_dtensor(
                local_tensor=wbuf.get_item(item_id, only_shard=sharded), param=orig, dist_index=buffers.dist_index,
                is_sharded_param=sharded, is_expert_param=group.is_expert_param)
    return out


def refresh(model: FsdpChunks) -> list:
    """Collective: the mirrors, each parameter set to the weights its FSDP chunk computes with
    (`compute_weights`: after a load, what Megatron-FSDP installed from the loaded main weights)."""
    for fsdp, mirror in zip(model, model.mirrors):
        weights = {tail(k): v for k, v in compute_weights(fsdp).items()}
        with torch.no_grad():
            for name, p in mirror.named_parameters():
                if tail(name) not in weights:
                    raise KeyError(f"Megatron-FSDP holds no weight {tail(name)!r} (the plain model's {name!r})")
                p.copy_(gathered(weights[tail(name)], p))
    return model.mirrors


def built_dtype(ddp: list, optimizer: Any) -> str:
    """fp32 or bf16 as built: Float16Module inside MegatronFSDP, fp32 main params, the optimizer's flag."""
    from megatron.core.transformer.module import Float16Module

    from harness.models.training import leaf_optimizers

    inner = leaf_optimizers(optimizer)
    main = {p.dtype for o in inner for g in o.optimizer.param_groups for p in g["params"]}
    flags = {bool(o.config.bf16) for o in inner}
    wrapped = all(isinstance(d.module.module, Float16Module) for d in ddp)
    if wrapped and main <= {torch.float32} and flags == {True}:
        return "bf16"
    if not wrapped and main <= {torch.float32} and flags <= {False}:
        return "fp32"
    return f"Float16Module {wrapped}, optimizer params {sorted(str(d) for d in main)}, optimizer bf16={sorted(flags)}"


@dataclass(frozen=True)
class MegatronFsdp:
    """harness.models.builder.Builder for Megatron-FSDP with `strategy` (data_parallel_sharding_strategy)."""

    strategy: str = "optim_grads_params"
    name = "megatron-fsdp"

    def build_model(self, spec: ModelSpec, topo: Topology, dtype: str, layer_spec: str, weights: ModelSpec) -> FsdpChunks:
        from harness.models.mcore import build_gpt, fill_canonical
        from harness.models.training import TrainConfig

        chunks = build_gpt(spec, topo, dtype, layer_spec)
        fill_canonical(chunks, weights)
        mirrors = build_gpt(spec, topo, dtype, layer_spec)
        return FsdpChunks(wrap(chunks, ddp_config(TrainConfig(dtype=dtype), self.strategy), topo), mirrors, self.strategy)

    def model_shards(self, model: FsdpChunks) -> list[Shard]:
        from harness.models.mcore import local_shards

        return local_shards(refresh(model))

    def logits(self, model: FsdpChunks, batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor | None:
        from harness.models.mcore import forward_logits

        return forward_logits(refresh(model), batch, device)

    def build_training(self, spec: ModelSpec, topo: Topology, cfg: Any, seed_offset: int = 0, **overrides: Any) -> tuple[FsdpChunks, Any]:
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.process_groups_config import ProcessGroupCollection

        from harness.models.mcore import build_gpt, fill_canonical
        from harness.models.training import optimizer_config

        chunks = build_gpt(spec, topo, cfg.dtype, cfg.layer_spec, **overrides)
        fill_canonical(chunks, spec.with_seed(spec.seed + seed_offset) if seed_offset else spec)
        mirrors = build_gpt(spec, topo, cfg.dtype, cfg.layer_spec, **overrides)
        config = ddp_config(cfg, self.strategy)
        ddp = wrap(chunks, config, topo)
        optimizer = get_megatron_optimizer(optimizer_config(cfg), ddp)
        from megatron.bridge.training.setup import _update_model_config_funcs

        _update_model_config_funcs(ddp, chunks[0].config, config, optimizer,
                                   pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        return FsdpChunks(ddp, mirrors, self.strategy), optimizer

    def propagation(self, ddp: FsdpChunks, optimizer: Any, cfg: Any) -> list[dict[str, Any]]:
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        from torch.distributed.tensor import DTensor

        from harness.models.training import built_layer_spec, leaf_optimizers

        inner = leaf_optimizers(optimizer)

        def built(knob: str):
            values = {getattr(d.ddp_config, knob) for d in ddp}
            return values.pop() if len(values) == 1 else f"chunks disagree: {sorted(values)}"

        actual = {
            "use_megatron_fsdp": all(isinstance(d, FullyShardedDataParallel) for d in ddp) and built("use_megatron_fsdp"),
            "data_parallel_sharding_strategy": built("data_parallel_sharding_strategy"),
            "use_distributed_optimizer": built("use_distributed_optimizer") is True and bool(inner)
            and all(isinstance(o, DistributedOptimizer) and o.config.use_distributed_optimizer for o in inner),
            "optimizer steps DTensors": all(isinstance(p, DTensor) for o in inner for g in o.optimizer.param_groups for p in g["params"]),
            "lr": inner[0].param_groups[0]["lr"] if inner else None,
            "dtype": built_dtype(ddp, optimizer),
            "layer_spec": built_layer_spec(ddp.mirrors[0]),
        }
        asked = {"use_megatron_fsdp": True, "data_parallel_sharding_strategy": self.strategy,
                 "use_distributed_optimizer": cfg.use_distributed_optimizer, "optimizer steps DTensors": True,
                 "lr": cfg.lr, "dtype": cfg.dtype, "layer_spec": cfg.layer_spec}
        return [{"knob": k, "asked": asked[k], "actual": actual[k], "ok": asked[k] == actual[k]} for k in asked]

    def optimizer_view(self, ddp: FsdpChunks, optimizer: Any) -> tuple[list[Shard], dict[str, Any]]:
        """Collective: per model parameter, the main param (the optimizer's DTensor), exp_avg and
        exp_avg_sq gathered to full and cut to this rank's TP slice, under megatron's keys
        optimizer.state.<param|exp_avg|exp_avg_sq>.<checkpoint key>. A param this rank holds no state
        for contributes zeros (an empty shard: the other ranks hold its elements)."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
        from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

        from harness.models.mcore import shards_of
        from harness.models.training import adam_steps, leaf_optimizers

        states = {}
        for o in leaf_optimizers(optimizer):
            states.update(o.optimizer.state)
        out: dict[str, Any] = {}
        for c, (fsdp, mirror) in enumerate(zip(ddp, ddp.mirrors)):
            fsdp.state_dict()  # Megatron-FSDP's pre-hook: the module's params are its distributed (optimizer) params
            model_sd, _ = extract_sharded_tensors_and_factories(mirror.sharded_state_dict())
            meta = {sh.data: sh for sh in nested_values(model_sd)}
            plain = {tail(n): p for n, p in mirror.named_parameters()}
            for i, (name, param) in enumerate(fsdp.named_parameters()):
                like = plain[tail(name)]
                st = states.get(param) or {}
                sh = meta[like]
                for k in ("param", "exp_avg", "exp_avg_sq"):
                    t = param if k == "param" else st.get(k)
                    data = gathered(t if t is not None else torch.zeros_like(param), like).float()
                    kw = dict(key=f"optimizer.state.{k}.{sh.key}", data=data, dtype=data.dtype)
                    if isinstance(sh, ShardedTensorFactory):
                        kw.pop("dtype")
                    out[f"{k}.{c}.{i}"] = replace(sh, **kw)
        shards = shards_of(out, lambda s: isinstance(s, ShardedTensor) and s.key.startswith("optimizer.state."))
        return shards, adam_steps(optimizer)

    def sync_params(self, ddp: FsdpChunks, optimizer: Any, cfg: Any) -> None:
        """Nothing: Megatron-LM forces no param sync under Megatron-FSDP (training.py
        should_disable_forward_pre_hook is False with --use-megatron-fsdp); the views read the DTensors."""

    def rank_state_bytes(self, ddp: FsdpChunks, optimizer: Any) -> int:
        from harness.models.training import leaf_optimizers

        def local(t: Any) -> int:
            t = t.to_local() if hasattr(t, "to_local") else t
            return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

        total = sum(local(v) for d in ddp for v in d.state_dict().values())
        for o in leaf_optimizers(optimizer):
            total += sum(local(v) for st in o.optimizer.state.values() for v in st.values())
        return total
