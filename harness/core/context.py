"""What a rank function receives: its place in the world. A value every layer above may name
(backends, models and the launcher), so it lives at the bottom, apart from the launcher."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

RankFn = Callable[["RankContext", Any], Any]


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    backend: str  # "gloo" | "nccl"
    workdir: Path  # shared by all ranks of this world
    device: torch.device

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0
