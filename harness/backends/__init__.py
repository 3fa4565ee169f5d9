"""Checkpoint backends: one file each, one small interface, no knowledge of each other.

A backend module `harness/backends/<name>.py` exposes `BACKEND`, an instance of `Backend`.
Adding one is that file plus a matrix line naming it.
"""

from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import torch

from harness.world import RankContext


class Backend(ABC):
    name: ClassVar[str]
    #: Whether save_state/load_state take arbitrary sharded state (model + optimizer).
    supports_training_state: ClassVar[bool] = False

    @abstractmethod
    def save(self, ctx: RankContext, model: Any, directory: Path) -> None:
        """Collective: every rank of the world calls it with its own model shard."""

    @abstractmethod
    def load(self, ctx: RankContext, model: Any, directory: Path) -> None:
        """Collective: fill `model` (built for this world's topology) from `directory`."""

    def save_state(self, ctx: RankContext, sharded_state: dict, directory: Path) -> None:
        raise NotImplementedError(f"backend {self.name} cannot save training state")

    def load_state(self, ctx: RankContext, sharded_state: dict, directory: Path) -> dict:
        raise NotImplementedError(f"backend {self.name} cannot load training state")

    @abstractmethod
    def read_full(self, ctx: RankContext, directory: Path) -> dict[str, torch.Tensor]:
        """Every tensor the checkpoint holds, unsharded, by checkpoint key (no model needed)."""


_extra: dict[str, Backend] = {}


def register(backend: Backend) -> None:
    """Add a backend defined outside this package (a plugin, or a fault-injecting test double).
    Forked ranks inherit the registration; spawned ranks need it at import time."""
    _extra[backend.name] = backend


def available() -> list[str]:
    return sorted({m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")} | set(_extra))


def get_backend(name: str) -> Backend:
    if name in _extra:
        return _extra[name]
    if name not in available():
        raise KeyError(f"unknown backend {name!r}; available: {available()}")
    module = importlib.import_module(f"{__name__}.{name}")
    return module.BACKEND
