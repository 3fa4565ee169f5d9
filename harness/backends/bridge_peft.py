"""Megatron-Bridge HF PEFT adapter export: `save_hf_adapter` (adapter_config.json +
adapter_model.safetensors, loadable by peft.PeftModel.from_pretrained).

Megatron-Bridge 0.6.2 exports adapters but has no HF-adapter import, so this backend cannot load:
adapters travel between topologies as adapter-only dist checkpoints (mcore_dist over the state
harness.models.bridge.adapter_state selects, as verl does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from harness.backends import Backend
from harness.backends._safetensors import read_safetensors
from harness.core.context import RankContext


class BridgePeft(Backend):
    name = "bridge_peft"
    capabilities = frozenset({"adapter_export", "read_plain"})
    refusals = ("SafetensorError", "PeftError", "NoMatchingPeftModuleError")  # safetensors', peft's own errors

    def save(self, ctx: RankContext, model: Any, directory: Path) -> None:
        model.bridge.save_hf_adapter(
            model.modules, str(directory), peft_config=model.peft, base_model_name_or_path=model.base_path, show_progress=False
        )

    def read_full(self, ctx: RankContext | None, directory: Path) -> dict[str, torch.Tensor]:
        return read_safetensors(directory)


BACKEND = BridgePeft()
