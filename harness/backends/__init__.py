"""Checkpoint backends: one file each, one small interface, no knowledge of each other.

A backend is a *format*: how state goes to disk and back. Which state (model weights, model +
optimizer, adapters only) is chosen by the builders (harness.models, harness.models.training,
harness.models.bridge) and handed in as a sharded state dict or a model.

Adding one: a module `harness/backends/<name>.py` exposing `BACKEND` (a `Backend` instance) and a
matrix line naming it; or, outside this package, an entry point in the group
`ckpt_harness.backends` (`name = "package.module:attr"`), the way pytest finds plugins; or
`register(name, "module:attr")` in the process that runs the matrix (tests use this for
fault-injecting doubles, see tests/doubles.py).

A backend may take options (`Options`, a frozen dataclass like a case's: matrix
`backend_options: {...}` or axes `backend.<name>: [...]`, typed and validated at load). They
travel with the import path in a `BackendRef`, and `get_backend(ref)` returns the backend
configured with them (`self.options`).

Ranks never look a backend up by name in a registry they may not share: the parent resolves a
name to its import path (`resolve`) and the path travels inside the phase, so the same backend
is found under fork, spawn, forkserver and torchrun alike.

A backend declares what it can do (`capabilities`, read by matrix validation against what each
case needs):
  weights         save/load a Megatron module's sharded state dict (`save`, `load`)
  training_state  save/load a live training job: model chunks + optimizer (+ LR scheduler)
                  (`save_training`, `load_training`). A format backend gets them for free from
                  `save_state`/`load_state` of the job's sharded state dict; a client backend
                  (verl's MegatronCheckpointManager builds its own sharded dicts and loads into
                  the live objects) overrides them: both fit one interface, no runner special case.
  finetune        start a new job from a training checkpoint's weights only (`load_pretrained`:
                  Bridge's `pretrained_checkpoint`, Megatron-LM's --finetune)
  peft_training   save/load a LoRA job (a Bridge-built model with adapters, `job.bridge.peft`) as a
                  PEFT training checkpoint: adapter tensors and their optimizer state only, resumed
                  over the base (Bridge's `cfg.peft` + `pretrained_checkpoint`)
  read_plain      `read_full`: every tensor unsharded, with no model (an independent reader)
  hf_export       write an HF checkpoint from a Bridge model (`save`); `hf_import` reads one (`load`)
  adapter_export  write an HF PEFT adapter from a Bridge model with LoRA (`save`)
  adapter_io      save a transformers + PEFT model's adapters in PEFT's own format and load them
                  into a transformers model (`save`, `load`): PEFT's save_pretrained / from_pretrained
  manager         a training-checkpoint *manager* (verl's MegatronCheckpointManager): besides
                  training_state it lays out step directories and a tracker file a resume reads,
                  writes a contents manifest, keeps max_ckpt_to_keep, and saves the LR scheduler
                  and RNG state (what cases/verl_checkpoint.py checks)
"""

from __future__ import annotations

import copy
import importlib
import os
import pkgutil
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from harness.core.context import RankContext
from harness.core.options import NoOptions, parse_options

CAPABILITIES = frozenset({"weights", "training_state", "finetune", "peft_training", "read_plain", "hf_export", "hf_import", "adapter_export",
                          "adapter_io", "manager"})
ENTRY_POINT_GROUP = "ckpt_harness.backends"


class TrainingState(Protocol):
    """A live training job at one rank, as a backend sees it (harness.models.training.TrainingJob)."""

    chunks: list  # the DDP-wrapped model chunks (one without virtual pipelining)
    optimizer: Any  # megatron-core MegatronOptimizer
    scheduler: Any  # megatron-core OptimizerParamScheduler, or None

    def sharded_state(self, is_loading: bool, metadata: dict | None = None) -> dict:
        """{"model": ..., "optimizer": ...} as megatron-core's sharded state dicts, built with the
        sharded_state_dict `metadata` (None: the job's own, as Megatron-LM builds it)."""

    def content_metadata(self) -> dict:
        """The job's sharded_state_dict metadata as Megatron-LM saves it in the checkpoint."""

    def restore(self, state: dict) -> None:
        """Put a loaded `sharded_state` into the live model and optimizer."""


class Backend(ABC):
    name: ClassVar[str]
    capabilities: ClassVar[frozenset[str]] = frozenset()
    Options: ClassVar[type] = NoOptions
    #: Modules the parent imports before forking ranks (harness.run.preload.warm), when a case uses
    #: this backend: a backend whose library is slow to import (verl: ~11 s) pays it once.
    preload: ClassVar[tuple[str, ...]] = ()
    #: The exceptions (class names, as a rank's traceback names them) with which this format's
    #: readers refuse files they cannot read (a newer format version, a foreign layout): what a user
    #: can act on. The golden corpus's rollback direction (an older stack reading newer files) passes
    #: these as a clean refusal; any other exception (AttributeError, KeyError) is a crash and fails.
    refusals: ClassVar[tuple[str, ...]] = ()
    #: The checks `strategy_check` may add besides `strategy` (an xfail may name them).
    checks: ClassVar[tuple[str, ...]] = ()

    def notes(self) -> list[str]:
        """Lines for the result's notes (e.g. which upstream defects this configuration steps around)."""
        return []

    def __init__(self, options: Any = None) -> None:
        self.options = options if options is not None else self.Options()

    def configured(self, options: Any) -> "Backend":
        """A copy of this backend with `options` (an instance of `Options`)."""
        other = copy.copy(self)
        other.options = options
        return other

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

    def unavailable(self) -> str | None:
        """Why this backend, with its options, cannot run on this machine (a package it needs is
        not installed), or None. The matrix loader marks such cases not-run with this reason."""
        return None

    def validate_case(self, case: Any, source: Any, target: Any, opts: Any) -> None:
        """Rules across this backend's options and a case (its contract, the topologies, its typed
        options), checked at matrix load: raise ValueError naming what does not fit."""

    @property
    def saves_async(self) -> bool:
        """Whether a save returns before the checkpoint is complete (finalized by `finalize_saves`)."""
        return False

    def checkpoint_complete(self, directory: Path) -> bool | None:
        """Whether `directory` holds a complete checkpoint by this format's own rule (None: unknown)."""
        return None

    def strategy_check(self, events: dict[str, dict[str, list[dict]]]) -> Any:
        """A `strategy` Check (harness.core.result.Check): what the backend's options asked is what
        every save and load ran (`events`: per world phase, per rank, what `record_event`
        recorded), or None when the options ask nothing to check."""
        return None

    #: a case whose body raised is not judged by what its saves and loads recorded so far
    after_error = False

    def checks_of(self, record: Any) -> list:
        """This backend's part of the case's verdict (harness.core.result.CheckSource):
        `strategy_check` over what the case's saves and loads recorded (`record.backend_events`)."""
        check = self.strategy_check(record.backend_events)
        return list(check) if isinstance(check, (list, tuple)) else [check] if check is not None else []

    def pending_saves(self) -> int:
        """How many saves this backend has started and not finalized (async saves)."""
        return 0

    def finalize_saves(self, ctx: RankContext) -> list[dict]:
        """Collective: complete every save this backend left pending (an async save's finalize
        step: until it runs, the checkpoint is not complete and must not count as saved). Returns
        one record per save it finalized: {"directory", "complete_before", "complete_after"}.
        A synchronous backend has nothing pending."""
        return []

    def build_bridge_model(self, hf_dir: Path | str, spec: Any, topo: Any, *, load_weights: bool = True, ddp_config: Any = None,
                           adapter: Any = None) -> Any:
        """A Megatron-Bridge model at this rank (with `adapter`, a harness.models.bridge.AdapterSpec, its PEFT
        adapters), built as this backend's client builds it (a harness.models.bridge.BridgeModel):
        Megatron-Bridge's provider unless the backend knows another way."""
        from harness.models import bridge

        return bridge.build(hf_dir, spec, topo, load_weights=load_weights, ddp_config=ddp_config, adapter=adapter)

    def builder(self) -> Any:
        """How this backend's client builds a GPT-zoo model or training job and how the checks read
        it back (harness.models.builder.Builder): megatron-core DDP, as Megatron-LM does, unless the
        backend knows another way (mcore_fsdp: Megatron-FSDP)."""
        from harness.models.builder import MEGATRON_DDP

        return MEGATRON_DDP

    def save_training(self, ctx: RankContext, job: TrainingState, directory: Path) -> None:
        """Collective: save the live job (model chunks + optimizer) to `directory`."""
        self.save_state(ctx, job.sharded_state(is_loading=False), directory)

    def load_training(self, ctx: RankContext, job: TrainingState, directory: Path) -> None:
        """Collective: fill the live job (built for this world's topology) from `directory`."""
        job.restore(self.load_state(ctx, job.sharded_state(is_loading=True), directory))

    def load_pretrained(self, ctx: RankContext, job: TrainingState, directory: Path, run_dir: Path) -> None:
        """Collective, capability "finetune": start the new job (built for this world's topology)
        from the weights of the training checkpoint `directory`, as a finetune does: not its
        optimizer state, scheduler or iteration. `run_dir` is the job's own checkpoint directory
        (empty: nothing to resume). A path that holds no checkpoint must raise, never leave the
        job at its random init."""
        raise NotImplementedError(f"backend {self.name} cannot start a job from a pretrained checkpoint")

    @abstractmethod
    def read_full(self, ctx: RankContext | None, directory: Path) -> dict[str, torch.Tensor]:
        """Every tensor the checkpoint holds, unsharded, by checkpoint key (no model needed)."""


_registered: dict[str, str] = {}


@lru_cache(maxsize=1)
def _builtin() -> dict[str, str]:
    return {m.name: f"{__name__}.{m.name}:BACKEND" for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")}


@lru_cache(maxsize=1)
def _entry_points() -> dict[str, str]:
    """Once a process: the scan reads every installed distribution's metadata (~1000 files here,
    17 ms), and a case resolved its backend a few times (docs/measurements.md)."""
    return {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def register(name: str, target: str) -> None:
    """Make `name` mean the backend at import path `target` ("module:attr", attr a Backend
    instance or class) in this process; ranks receive the path, not the name."""
    if ":" not in target:
        raise ValueError(f"backend target must be 'module:attr', got {target!r}")
    _registered[name] = target


def unregister(name: str) -> None:
    _registered.pop(name, None)


#: NAME=module:attr[,NAME=module:attr...]: backends of this process and every process it starts, with
#: no package to install (a backend of the user's own, or a test double a `run` subprocess needs)
ENV = "CKPT_HARNESS_BACKENDS"


def _from_env() -> dict[str, str]:
    out = {}
    for item in filter(None, (x.strip() for x in os.environ.get(ENV, "").split(","))):
        name, sep, target = item.partition("=")
        if not sep or ":" not in target:
            raise ValueError(f"{ENV}: {item!r} is not NAME=module:attr")
        out[name.strip()] = target.strip()
    return out


def _table() -> dict[str, str]:
    return {**_builtin(), **_entry_points(), **_from_env(), **_registered}


def available() -> list[str]:
    return sorted(_table())


@dataclass(frozen=True)
class BackendRef:
    """What a phase carries to its ranks: the backend's import path and its raw options."""

    path: str
    options: tuple[tuple[str, Any], ...] = ()

    def __str__(self) -> str:
        return self.path + (f"{dict(self.options)}" if self.options else "")


def resolve(name: str | BackendRef, options: dict[str, Any] | None = None) -> BackendRef:
    """The reference to backend `name` (a name, an import path, or a ref) with `options`."""
    if isinstance(name, BackendRef):
        return name if options is None else BackendRef(name.path, tuple(sorted(options.items())))
    opts = tuple(sorted((options or {}).items()))
    if ":" in name:
        return BackendRef(name, opts)
    table = _table()
    if name not in table:
        raise KeyError(f"unknown backend {name!r}; available: {sorted(table)}")
    return BackendRef(table[name], opts)


def parse_ref(text: str) -> BackendRef:
    """A backend named in a case option, with its options: `"mcore_dist"` or
    `"mcore_dist strict=assume_ok_unexpected save_strategy=fully_parallel"` (values true/false and
    integers as such, the rest strings). ValueError names the word that does not parse."""
    name, *pairs = text.split()
    options: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"backend {text!r}: {pair!r} is not key=value")
        options[key] = {"true": True, "false": False}.get(value, int(value) if value.lstrip("-").isdigit() else value)
    try:
        ref = resolve(name, options)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    get_backend(ref)  # its options parse, or ValueError naming them
    return ref


def ref_of(spec: Any) -> BackendRef:
    """The reference a case spec's worlds receive: its backend's import path + its backend options."""
    return resolve(spec.backend, spec.backend_opts)


def get_backend(ref: str | BackendRef) -> Backend:
    """The backend, by name (parent side) or by the ref a phase carries (rank side), configured
    with the ref's options (ValueError naming the option when they do not parse)."""
    ref = resolve(ref)
    module_name, _, attr = ref.path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise KeyError(f"backend {ref.path!r}: cannot import {module_name}:{attr}: {exc}") from None
    backend = obj() if isinstance(obj, type) else obj
    if not isinstance(backend, Backend):
        raise KeyError(f"backend {ref.path!r}: {module_name}:{attr} is not a Backend")
    if ref.options or backend.Options is not NoOptions:
        backend = backend.configured(parse_options(backend.Options, dict(ref.options), f"backend {backend.name}"))
    return backend
