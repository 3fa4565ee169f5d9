"""Megatron-Bridge HF export/import: `save_hf_pretrained` out, `load_hf_weights` in.

The model is a harness.models.bridge.BridgeModel (the AutoBridge and the Megatron modules it built).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from harness.backends import Backend
from harness.backends._safetensors import read_safetensors
from harness.core.context import RankContext


@dataclass(frozen=True)
class Options:
    """`strict`: save_hf_pretrained's own flag (verl's checkpoint.strict passes it through). True,
    Bridge's default, refuses an export that does not write every source tensor; False writes what
    it has (the remedy Bridge's refusal message names)."""

    strict: bool = True


class BridgeHF(Backend):
    name = "bridge_hf"
    capabilities = frozenset({"hf_export", "hf_import", "read_plain"})
    Options = Options
    refusals = ("SafetensorError",)  # safetensors' header/format error (transformers reads through it)

    def save(self, ctx: RankContext, model: Any, directory: Path) -> None:
        model.bridge.save_hf_pretrained(model.modules, str(directory), show_progress=False, strict=self.options.strict)

    def load(self, ctx: RankContext, model: Any, directory: Path) -> None:
        model.bridge.load_hf_weights(model.modules, str(directory))

    def read_full(self, ctx: RankContext | None, directory: Path) -> dict[str, torch.Tensor]:
        return read_safetensors(directory)


BACKEND = BridgeHF()
