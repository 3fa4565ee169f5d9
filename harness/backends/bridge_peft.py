"""Megatron-Bridge HF PEFT adapter export: `save_hf_adapter` (adapter_config.json +
adapter_model.safetensors, loadable by peft.PeftModel.from_pretrained).

Megatron-Bridge 0.6.2 exports adapters but has no HF-adapter import: adapters travel between
topologies as adapter-only dist checkpoints (save_state/load_state, as verl does), filtered with
the Bridge's own `apply_peft_adapter_filter_to_state_dict`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from harness.backends import Backend
from harness.hf_models import read_safetensors
from harness.world import RankContext


class BridgePeft(Backend):
    name = "bridge_peft"
    supports_training_state = True

    def save(self, ctx: RankContext, model: Any, directory: Path) -> None:
        model.bridge.save_hf_adapter(
            model.modules, str(directory), peft_config=model.peft, base_model_name_or_path=model.base_path, show_progress=False
        )

    def load(self, ctx: RankContext, model: Any, directory: Path) -> None:
        raise NotImplementedError("Megatron-Bridge 0.6.2 cannot import an HF PEFT adapter into a Megatron model")

    def adapter_state(self, model: Any) -> dict:
        from megatron.bridge.training.checkpointing import apply_peft_adapter_filter_to_state_dict

        from harness.bridge import unwrapped

        return apply_peft_adapter_filter_to_state_dict({"model": unwrapped(model).sharded_state_dict()}, model.peft)

    def save_state(self, ctx: RankContext, sharded_state: dict, directory: Path) -> None:
        from megatron.core import dist_checkpointing

        if ctx.is_rank0:
            directory.mkdir(parents=True, exist_ok=False)
        dist.barrier()
        dist_checkpointing.save(sharded_state, str(directory))

    def load_state(self, ctx: RankContext, sharded_state: dict, directory: Path) -> dict:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.validation import StrictHandling

        # An adapter-only checkpoint holds the adapter keys exactly: any difference is an error.
        return dist_checkpointing.load(sharded_state, str(directory), strict=StrictHandling.RAISE_ALL)

    def read_full(self, ctx: RankContext | None, directory: Path) -> dict[str, torch.Tensor]:
        return read_safetensors(directory)


BACKEND = BridgePeft()
