"""How a backend's client builds a GPT-zoo model or training job and how the checks read it back
(`Builder`): megatron-core DDP as Megatron-LM's get_model builds it (`MegatronDDP`, every backend's
default) or Megatron-FSDP (harness.models.fsdp, the mcore_fsdp backend's). The cases ask the backend
for its builder (harness.backends.Backend.builder) and never wrap a model themselves.

MegatronDDP looks the module functions up at call time, so a rank hook that patches
harness.models.training or harness.models.mcore (tests/doubles.py) still acts.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from harness.core.parity import Shard
from harness.core.topology import Topology
from harness.core.zoo import ModelSpec


class Builder(Protocol):
    """A model (reshard-weights) or training job (the training cases) at one rank, and its views."""

    def build_model(self, spec: ModelSpec, topo: Topology, dtype: str, layer_spec: str, weights: ModelSpec) -> Any:
        """The rank's model chunks holding the canonical weights of `weights` (a seed of `spec`)."""

    def model_shards(self, model: Any) -> list[Shard]:
        """Every checkpointed model tensor this rank holds, keyed by megatron's checkpoint key."""

    def logits(self, model: Any, batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor | None:
        """harness.models.mcore.forward_logits of the model's weights."""

    def build_training(self, spec: ModelSpec, topo: Topology, cfg: Any, seed_offset: int = 0, **overrides: Any) -> tuple[list, Any]:
        """(wrapped chunks, megatron optimizer), the chunks holding the canonical weights."""

    def propagation(self, ddp: list, optimizer: Any, cfg: Any) -> list[dict[str, Any]]:
        """Asked vs built, per knob (the `propagation` check's rows)."""

    def optimizer_view(self, ddp: list, optimizer: Any) -> tuple[list[Shard], dict[str, Any]]:
        """(optimizer state in model space, keyed optimizer.state.<param|exp_avg|exp_avg_sq>.<key>, the step values)."""

    def sync_params(self, ddp: list, optimizer: Any, cfg: Any) -> None:
        """Make every rank's model weights current before a save or a read."""

    def rank_state_bytes(self, ddp: list, optimizer: Any) -> int:
        """Bytes of training state this rank holds."""


def build_job(build: Builder, spec: ModelSpec, topo: Topology, cfg: Any, seed_offset: int = 0, *, sharding: str | None,
              mem_efficient: bool, step: int = 0, **overrides: Any) -> tuple[Any, list[dict[str, Any]]]:
    """(harness.models.training.TrainingJob, its propagation rows): a training job as every training
    case builds one through a backend's builder; the scheduler after the propagation read (a warmup
    changes the optimizer's lr)."""
    from harness.models import training

    ddp, optimizer = build.build_training(spec, topo, cfg, seed_offset, **overrides)
    propagated = build.propagation(ddp, optimizer, cfg)
    scheduler = training.build_scheduler(optimizer, cfg)
    job = training.TrainingJob(ddp, optimizer, scheduler, sharding=sharding, mem_efficient=mem_efficient, step=step, seed=spec.seed)
    return job, propagated


class MegatronDDP:
    """megatron-core DistributedDataParallel + get_megatron_optimizer (harness.models.training)."""

    name = "megatron-ddp"

    def build_model(self, spec: ModelSpec, topo: Topology, dtype: str, layer_spec: str, weights: ModelSpec) -> Any:
        from harness.models import mcore

        model = mcore.build_gpt(spec, topo, dtype, layer_spec)
        mcore.fill_canonical(model, weights)
        return model

    def model_shards(self, model: Any) -> list[Shard]:
        from harness.models import mcore

        return mcore.local_shards(model)

    def logits(self, model: Any, batch: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor | None:
        from harness.models import mcore

        return mcore.forward_logits(model, batch, device)

    def build_training(self, spec: ModelSpec, topo: Topology, cfg: Any, seed_offset: int = 0, **overrides: Any) -> tuple[list, Any]:
        from harness.models import training

        return training.build_training(spec, topo, cfg, seed_offset, **overrides)

    def propagation(self, ddp: list, optimizer: Any, cfg: Any) -> list[dict[str, Any]]:
        from harness.models import training

        return training.propagation(ddp, optimizer, cfg)

    def optimizer_view(self, ddp: list, optimizer: Any) -> tuple[list[Shard], dict[str, Any]]:
        from harness.models import training

        return training.optimizer_view(ddp, optimizer)

    def sync_params(self, ddp: list, optimizer: Any, cfg: Any) -> None:
        from harness.models import training

        training.sync_params(ddp, optimizer, cfg)

    def rank_state_bytes(self, ddp: list, optimizer: Any) -> int:
        from harness.models import training

        return training.rank_state_bytes(ddp, optimizer)


MEGATRON_DDP = MegatronDDP()
