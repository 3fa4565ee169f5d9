"""Judging the tensors of an HF PEFT adapter file by their shape alone (Megatron-Bridge #6076,
docs/user-reports.md): a LoRA factor stock PEFT cannot load.

PEFT stores every LoRA factor 2D: a module target's lora_A (r, in) and lora_B (out, r), and a
parameter target's (`target_parameters`, PEFT's ParamWrapper over fused MoE experts) packed 2D as
well (lora_A (E*r, in), lora_B (out, E*r)). A 3D factor, such as the `[1, out, r]` shared side of
Megatron-Bridge's shared-outer MoE LoRA written under an expert-agnostic name
(`...mlp.experts.down_proj.lora_B.weight`), matches no PEFT module: PeftModel.from_pretrained
loads the rest and that factor stays at its init, so the served model silently lacks part of the
adapter. Whether PEFT reports the key depends on how it names the model's modules; the shape does
not, so the file's shape is judged here. Pure functions of the file's tensors."""

from __future__ import annotations

from typing import Mapping

import torch

#: the LoRA factors of a PEFT adapter file (lora_A / lora_B; lora_embedding_A/B of an embedding target)
_FACTORS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


def is_lora_factor(key: str) -> bool:
    """Whether `key` names a LoRA factor (a `.lora_A.` / `.lora_B.` ... path component)."""
    return any(f".{f}." in f".{key}." for f in _FACTORS)


def lora_tensor_problems(state: Mapping[str, torch.Tensor]) -> list[str]:
    """One problem per LoRA factor of the adapter file `state` (key -> tensor) that is not 2D, and
    one when the file holds no LoRA factor at all ([] when every factor is 2D)."""
    factors = {k: v for k, v in state.items() if is_lora_factor(k)}
    if not factors:
        return ["the adapter file holds no lora_A/lora_B tensor"]
    return [f"{v.dim()}D LoRA tensor stock PEFT cannot load: {k} {tuple(v.shape)} (PEFT's factors are 2D, "
            f"ParamWrapper's packed experts included)" for k, v in sorted(factors.items()) if v.dim() != 2]
