"""A training job on a Megatron-Bridge model built from an HF fixture (the provider path), as a
Bridge recipe trains one: the cases that save such jobs through a training backend share it
(peft-resume: LoRA adapters over a frozen base; bridge-hf-interop: the whole model)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from harness.backends import BackendRef
from harness.core.parity import Shard
from harness.core.topology import Topology
from harness.core.zoo import HFModelSpec
from harness.models import bridge as mb


@dataclass(frozen=True)
class BridgeJobOptions:
    """The options of a case that trains such a job: its steps, the optimizer's sharding, the LR schedule."""

    steps: int = 2
    use_distributed_optimizer: bool = True
    lr_schedule: Literal["none", "warmup-cosine"] = "warmup-cosine"


def bridge_job(model: HFModelSpec, hf_dir: str, topo: Topology, adapter: mb.AdapterSpec | None, opts: BridgeJobOptions,
               decoy: bool, backend: BackendRef) -> tuple[mb.BridgeModel, Any]:
    """(BridgeModel, TrainingJob) at this rank, the model built as `backend`'s client builds it:
    megatron DDP + optimizer over the trainable params, wired as Megatron-LM's loop wires it. With
    `adapter`: the base from the fixture (frozen) and the adapters' truth values; when `decoy`, no
    HF weights are asked (a resume's base comes the client's way: Bridge's PEFT pre-wrap hook loads
    its pretrained_checkpoint) and the adapters get other values. Without: the fixture's weights, or
    the provider's own init when `decoy` (a load must overwrite every weight)."""
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from harness.models.training import TrainConfig, TrainingJob, build_scheduler

    from harness.backends import get_backend

    distopt = opts.use_distributed_optimizer
    bm = get_backend(backend).build_bridge_model(hf_dir, model, topo, load_weights=not decoy, adapter=adapter,
                                                 ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=distopt))
    if adapter is not None:
        bm.peft.set_params_to_save([mb.unwrapped(bm)])  # as Bridge's setup applies it (pre-wrap parameter names)
        mb.fill_adapters(bm, model, replace(adapter, seed=adapter.seed + 1) if decoy else adapter)
    cfg = TrainConfig(use_distributed_optimizer=distopt, lr_schedule=opts.lr_schedule)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=cfg.lr, min_lr=cfg.lr / 100, weight_decay=cfg.weight_decay, use_distributed_optimizer=distopt,
        bf16=False, fp16=False, clip_grad=1.0), bm.modules)
    config = bm.modules[0].config
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = bm.modules[0].no_sync
    config.grad_scale_func = optimizer.scale_loss
    sharding = "fully_reshardable" if distopt else None
    return bm, TrainingJob(bm.modules, optimizer, build_scheduler(optimizer, cfg), sharding=sharding, bridge=bm, seed=model.seed)


def base_shards(modules) -> list[Shard]:
    """This rank's shards of every non-adapter weight."""
    from harness.models.mcore import local_shards

    return [s for s in local_shards(modules) if ".adapter." not in s.key]
