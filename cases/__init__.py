"""Cases: what a scenario checks. One module per case, exposing `CASE`; found by name.

Cases from outside this package: an entry point in the group `ckpt_harness.cases`
(`name = "package.module:CASE"`). A case runs in the parent process (its rank functions travel
by value), so no start method needs the registry.

Imported as `harness.cases`: the wheel's name for this directory, which harness/__init__.py gives
the clone's cases/ too. Case modules import each other relatively (`from .contract import Case`),
so no module loads under two names; a plugin imports `harness.cases.contract`.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache
from importlib import metadata

from .contract import Case

ENTRY_POINT_GROUP = "ckpt_harness.cases"


def all_cases() -> dict[str, Case]:
    return dict(_discovered())


@lru_cache(maxsize=1)
def _discovered() -> dict[str, Case]:
    """Once a process: the entry-point scan reads every installed distribution's metadata."""
    found: dict[str, Case] = {}
    for m in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{m.name}")
        case = getattr(module, "CASE", None)
        if isinstance(case, Case):
            found[case.name] = case
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        case = ep.load()
        if isinstance(case, Case):
            found[case.name] = case
    return found


def get_case(name: str) -> Case:
    cases = all_cases()
    if name not in cases:
        raise KeyError(f"unknown case {name!r}; available: {sorted(cases)}")
    return cases[name]
