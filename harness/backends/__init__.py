"""Checkpoint backends: one file each, one small interface, no knowledge of each other.

A backend is a *format*: how state goes to disk and back. Which state (model weights, model +
optimizer, adapters only) is chosen by the builders (harness.models, harness.training,
harness.bridge) and handed in as a sharded state dict or a model.

Adding one: a module `harness/backends/<name>.py` exposing `BACKEND` (a `Backend` instance) and a
matrix line naming it; or, outside this package, an entry point in the group
`ckpt_harness.backends` (`name = "package.module:attr"`), the way pytest finds plugins; or
`register(name, "module:attr")` in the process that runs the matrix (tests use this for
fault-injecting doubles, see harness/doubles.py).

Ranks never look a backend up by name in a registry they may not share: the parent resolves a
name to its import path (`resolve`) and the path travels inside the phase, so the same backend
is found under fork, spawn, forkserver and torchrun alike.

A backend declares what it can do (`capabilities`, read by matrix validation against what each
case needs):
  weights         save/load a Megatron module's sharded state dict (`save`, `load`)
  training_state  save/load any sharded state dict, model + optimizer (`save_state`, `load_state`)
  read_plain      `read_full`: every tensor unsharded, with no model (an independent reader)
  hf_export       write an HF checkpoint from a Bridge model (`save`); `hf_import` reads one (`load`)
  adapter_export  write an HF PEFT adapter from a Bridge model with LoRA (`save`)
"""

from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar

import torch

from harness.world import RankContext

CAPABILITIES = frozenset({"weights", "training_state", "read_plain", "hf_export", "hf_import", "adapter_export"})
ENTRY_POINT_GROUP = "ckpt_harness.backends"


class Backend(ABC):
    name: ClassVar[str]
    capabilities: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def save(self, ctx: RankContext, model: Any, directory: Path) -> None:
        """Collective: every rank of the world calls it with its own model shard."""

    def load(self, ctx: RankContext, model: Any, directory: Path) -> None:
        """Collective: fill `model` (built for this world's topology) from `directory`."""
        raise NotImplementedError(f"backend {self.name} cannot load into a model")

    def save_state(self, ctx: RankContext, sharded_state: dict, directory: Path) -> None:
        raise NotImplementedError(f"backend {self.name} cannot save training state")

    def load_state(self, ctx: RankContext, sharded_state: dict, directory: Path) -> dict:
        raise NotImplementedError(f"backend {self.name} cannot load training state")

    @abstractmethod
    def read_full(self, ctx: RankContext | None, directory: Path) -> dict[str, torch.Tensor]:
        """Every tensor the checkpoint holds, unsharded, by checkpoint key (no model needed)."""


_registered: dict[str, str] = {}


def _builtin() -> dict[str, str]:
    return {m.name: f"{__name__}.{m.name}:BACKEND" for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")}


def _entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def register(name: str, target: str) -> None:
    """Make `name` mean the backend at import path `target` ("module:attr", attr a Backend
    instance or class) in this process; ranks receive the path, not the name."""
    if ":" not in target:
        raise ValueError(f"backend target must be 'module:attr', got {target!r}")
    _registered[name] = target


def unregister(name: str) -> None:
    _registered.pop(name, None)


def _table() -> dict[str, str]:
    return {**_builtin(), **_entry_points(), **_registered}


def available() -> list[str]:
    return sorted(_table())


def resolve(name: str) -> str:
    """The import path of backend `name` (a path is returned as it is)."""
    if ":" in name:
        return name
    table = _table()
    if name not in table:
        raise KeyError(f"unknown backend {name!r}; available: {sorted(table)}")
    return table[name]


def get_backend(name_or_path: str) -> Backend:
    """The backend, by name (parent side) or by the import path a phase carries (rank side)."""
    module_name, _, attr = resolve(name_or_path).partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise KeyError(f"backend {name_or_path!r}: cannot import {module_name}:{attr}: {exc}") from None
    backend = obj() if isinstance(obj, type) else obj
    if not isinstance(backend, Backend):
        raise KeyError(f"backend {name_or_path!r}: {module_name}:{attr} is not a Backend")
    return backend
