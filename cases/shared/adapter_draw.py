"""What the PEFT cases that make an adapter in transformers share (peft-adapter-io, peft-tp-load): the
input ids their logits are taken on, the seeded draw that gives every adapter tensor values no other
tensor has (a moved or swapped tensor shows), and the words of a load or save warning that is a finding."""

from __future__ import annotations

import re
from typing import Any, Callable

import torch

#: a warning of PEFT's load or save naming keys it could not place, or tensors it found invalid
WARNED = re.compile(r"missing|unexpected|mismatch|invalid shape", re.IGNORECASE)


def input_ids(vocab: int) -> torch.Tensor:
    """Two rows: the first ids (where trainable tokens sit) and the last ones (a resized vocabulary's new rows)."""
    return torch.stack([torch.arange(1, 9), torch.arange(vocab - 8, vocab)]).long()


@torch.no_grad()
def draw(model: Any, keep: Callable[[str], bool], seed: int) -> None:
    """Every parameter `keep` names gets its own random values (0.05 x normal), drawn in name order, so the
    same names get the same values whatever order the model lists them in."""
    g = torch.Generator().manual_seed(seed)
    for _, t in sorted((n, t) for n, t in model.named_parameters() if keep(n)):
        t.copy_(torch.randn(t.shape, generator=g) * 0.05)
