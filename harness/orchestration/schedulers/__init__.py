"""How a run's cases are spread: one `Scheduler` protocol, one module per scheduler,
picked by name from `SCHEDULERS` (as pytest-xdist keeps one module per scheduler behind a protocol).

  serial   one case after another in this process (the default)
  pool     `--jobs N`: N forked workers on this machine (gloo + the mp launcher only)
  packing  `--gpus-per-node N`: cases packed onto a node's GPUs, each on its own set, largest first
  cluster  submitit jobs (Slurm, or local processes) each running a balanced part through an inner scheduler
  shard    `--shard I/N`: this runner's deterministic, balanced part, run through an inner scheduler

A scheduler module imports no other scheduler module: they share this package and its
`_`-prefixed helpers (tests/test_layout.py). A wrapper (shard, cluster) gets its inner scheduler
from `get`, by name. No scheduler imports harness.orchestration.runner: it is handed `run_one`
(runner.run_case, or a fake in tests), so runner.run_cases can delegate here without a cycle.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from harness.core.result import CaseResult
from harness.core.spec import CaseSpec

#: name -> module of this package that holds it (its `make(settings)` builds one)
SCHEDULERS: dict[str, str] = {"serial": "serial", "pool": "pool", "packing": "packing", "cluster": "cluster", "shard": "shard"}

RunOne = Callable[[CaseSpec, Any], CaseResult]
OnResult = Callable[[CaseResult], None]


@runtime_checkable
class Scheduler(Protocol):
    """Runs a list of cases; the defaults of `select` and `check` are inherited by subclassing."""

    name: str

    def select(self, specs: Sequence[CaseSpec]) -> list[CaseSpec]:
        """The cases of `specs` this scheduler runs here, in matrix order: all of them (shard: its part)."""
        return list(specs)

    def check(self, specs: Sequence[CaseSpec], options: Any) -> None:
        """ValueError naming why it cannot run `specs` with these RunOptions (pool: NCCL or torchrun)."""
        return None

    def run(self, specs: Sequence[CaseSpec], options: Any, run_one: RunOne, on_result: OnResult | None = None) -> list[CaseResult]:
        """Every case `select(specs)` keeps, each by `run_one(spec, options)`; the results in matrix
        order, `on_result` called as each finishes."""
        ...


@dataclass(frozen=True)
class Settings:
    """What today's flags say about scheduling; each scheduler's `make` reads the fields it needs."""

    jobs: int = 1  # pool: workers
    gpus_per_node: int | None = None  # packing: the node's GPUs; cluster: what each node asks for
    durations: dict[str, float] | None = None  # case id -> seconds (a previous results.json): balance and order
    shard: str | None = None  # shard: I/N
    inner: str | None = None  # shard, cluster: the scheduler a part runs through (default: implied by the flags)
    cluster: Any = None  # cluster: its ClusterOptions, or their keywords (executor, shards, nodes, ...)


#: today's flags, each with the scheduler it implies; the first one set wins (shard then runs its part
#: through what the rest imply)
IMPLIED: tuple[tuple[str, Callable[[Settings], bool], str], ...] = (
    ("--shard", lambda s: bool(s.shard), "shard"),
    ("--gpus-per-node", lambda s: bool(s.gpus_per_node), "packing"),
    ("--jobs", lambda s: s.jobs > 1, "pool"),
)


def implied(settings: Settings, skip: Sequence[str] = ()) -> str:
    """The scheduler today's flags pick (`skip`: names a wrapper cannot hold as its inner)."""
    return next((name for _, is_set, name in IMPLIED if name not in skip and is_set(settings)), "serial")


def get(name: str | None, settings: Settings | None = None) -> Scheduler:
    """The scheduler called `name` (None: the one `settings`' flags imply), built from `settings`."""
    settings = settings or Settings()
    name = name or implied(settings)
    if name not in SCHEDULERS:
        raise ValueError(f"scheduler {name!r}: one of {', '.join(SCHEDULERS)}")
    return importlib.import_module(f"{__name__}.{SCHEDULERS[name]}").make(settings)


def inner_of(settings: Settings, wrapper: str) -> Scheduler:
    """What a wrapper (shard, cluster) runs its part through: `settings.inner`, else what the flags
    imply besides the wrappers."""
    name = settings.inner or implied(settings, skip=("shard", "cluster"))
    if name in ("shard", "cluster"):
        raise ValueError(f"the {wrapper} scheduler runs its part through serial, pool or packing, not {name}")
    return get(name, settings)
