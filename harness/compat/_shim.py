"""The Shim record and the per-case record of applied shims (shared by every compat module;
`harness.compat` re-exports what callers use)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Shim:
    """A runtime patch for one upstream assumption or defect.

    `needed(device)` detects the condition in this process (an error raised, an attribute
    missing or unset, a return type): the shim is applied because the condition is there, never
    because a version string matches, so the day upstream changes, the probe says False and the
    shim is no longer applied (nor listed). `retire_when` says which upstream change that is."""

    name: str
    reason: str
    apply: Callable[[], None]
    needed: Callable[[torch.device], bool]
    retire_when: str
    #: applied only when code that needs it asks (`require`), not by `install`
    on_demand: bool = False


#: names applied in this process (a forked rank inherits its parent's): never applied twice
_applied: list[str] = []
#: names `install` applied in this process: every case run in it uses them
_base: list[str] = []
#: names the current case applied or used (reset by `begin_case`): what a result lists
_record: list[str] = []


def note(name: str) -> None:
    """Record `name` as applied in this process and used by the current case."""
    if name not in _applied:
        _applied.append(name)
    if name not in _record:
        _record.append(name)


def applied(name: str) -> bool:
    return name in _applied


def fails(fn: Callable[[], object]) -> bool:
    """Probe helper: True when `fn()` raises (the upstream call the shim stands in for)."""
    try:
        fn()
    except Exception:
        return True
    return False
