"""megatron-core dist_checkpointing, `torch_dist` format (what verl and Megatron-LM save).

Saves and loads any sharded state dict (model weights, or model + optimizer for training
checkpoints, or adapters only); a model is a chunk list (harness.models: one chunk, or one per
virtual pipeline stage under `model0`, `model1`, ... as Megatron-LM lays them out). Loads are
strict (RAISE_ALL): a key the state expects but the checkpoint lacks, or the reverse, is an error,
never a silently kept initial value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from harness.backends import Backend
from harness.world import RankContext


class McoreDist(Backend):
    name = "mcore_dist"
    capabilities = frozenset({"weights", "training_state", "read_plain"})

    def save_state(self, ctx: RankContext, sharded_state: dict, directory: Path) -> None:
        from megatron.core import dist_checkpointing

        if ctx.is_rank0:
            directory.mkdir(parents=True, exist_ok=False)  # dist_checkpointing expects it to exist
        dist.barrier()
        dist_checkpointing.save(sharded_state, str(directory))

    def load_state(self, ctx: RankContext, sharded_state: dict, directory: Path) -> dict:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.validation import StrictHandling

        return dist_checkpointing.load(sharded_state, str(directory), strict=StrictHandling.RAISE_ALL)

    def save(self, ctx: RankContext, model: Any, directory: Path) -> None:
        from harness.models import sharded_state_dict

        self.save_state(ctx, sharded_state_dict(model), directory)

    def load(self, ctx: RankContext, model: Any, directory: Path) -> None:
        from harness.models import load_state_dict, sharded_state_dict

        load_state_dict(model, self.load_state(ctx, sharded_state_dict(model), directory))

    def read_full(self, ctx: RankContext | None, directory: Path) -> dict[str, torch.Tensor]:
        from megatron.core import dist_checkpointing

        plain = dist_checkpointing.load_plain_tensors(str(directory))
        return {k: v for k, v in plain.items() if isinstance(v, torch.Tensor)}


BACKEND = McoreDist()
