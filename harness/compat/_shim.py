"""The Shim record, one shape for every runtime patch the harness makes to an upstream, and the
per-case record of applied shims (shared by every compat module; `harness.compat` re-exports what
callers use, harness.compat.registry collects every module's records).

Each compat module lists its records in ONE conventional name, `SHIMS: tuple[Shim, ...]` (empty
where it has none); nothing else in harness/ holds a table of shims or workarounds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

#: kind: the harness ADAPTS to an API shape or an environment (CUDA-on-CPU, Transformer-Engine
#: absent, an API newer than a release): nothing is hidden, a case runs where it could not
ADAPTS = "adapts"
#: kind: the harness HIDES (steps around) an upstream defect; switched off, the strict xfail or test
#: named in `shown_by` shows the defect, so the record's removal turns that xfail red
HIDES = "hides"
KINDS = (ADAPTS, HIDES)

#: trigger: `install` applies it in every rank whose probe finds the condition
INSTALL = "install"
#: trigger: applied on demand, where harness code asks (`harness.compat.require`)
REQUIRE = "require"
#: trigger: applied by the function the harness calls for it (`apply`, or the code `applied_in` names):
#: an import helper, an API fallback, a workaround a matrix entry switches
CALLER = "caller"
TRIGGERS = (INSTALL, REQUIRE, CALLER)

#: switch: the options that list a switchable record (a HIDES workaround), by the option users write
#: in matrices/*.yaml: 'training' (case option `workarounds`), 'verl' (backend verl_manager's
#: `workarounds`), 'fsdp' (backend mcore_fsdp's `workarounds`), 'converter' (case convert's
#: `converter_workarounds`)
SWITCHES = ("training", "verl", "fsdp", "converter")


@dataclass(frozen=True, kw_only=True)
class Shim:
    """A runtime patch for one upstream assumption or defect.

    `needed(device)` detects the condition in this process (an error raised, an attribute
    missing or unset, a return type): the shim is applied because the condition is there, never
    because a version string matches, so the day upstream changes, the probe says False and the
    shim is no longer applied (nor listed). `probe` says what it detects, `retire_when` which
    upstream change retires it. A switched record (HIDES, `switch` set) is applied where a matrix
    entry lists it (default: `default_on`); its `apply` is the patch, or the helper its consumer
    calls with the object it patches, or None where `applied_in` names the code that applies it."""

    name: str
    #: the upstream package/module it touches (dotted, or a path for a script)
    upstream: str
    #: the upstream defect or API gap, with upstream file:line or thread where known
    why: str
    #: what it detects (an attribute, a signature, an error, never a version string)
    probe: str
    #: when it can go: the upstream change after which the probe says it is not needed
    retire_when: str
    kind: str
    apply: Callable[..., object] | None = None
    needed: Callable[[torch.device], bool] | None = None
    trigger: str = INSTALL
    #: the option that lists it ('' = not switchable: applied wherever its probe finds the condition)
    switch: str = ""
    default_on: bool = True
    #: the path of its switch's consumer it matters on ('' every path): verl 'async_save' / 'vanilla', training 'vpp'
    only_on: str = ""
    #: HIDES: the strict xfail (matrices/X.yaml:tag) or test (tests/x.py::test) that shows the defect without it
    shown_by: str = ""
    #: where it is applied when `apply` is None (a module of a higher floor, by name)
    applied_in: str = ""
    #: the name a result's compat_shims lists when it applies ('' = `name`; a switched workaround is
    #: listed in a result's notes instead, unless it names one here)
    recorded_as: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"shim {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if self.trigger not in TRIGGERS:
            raise ValueError(f"shim {self.name!r}: trigger {self.trigger!r} is not one of {TRIGGERS}")
        if self.switch and self.switch not in SWITCHES:
            raise ValueError(f"shim {self.name!r}: switch {self.switch!r} is not one of {SWITCHES}")

    @property
    def on_demand(self) -> bool:
        """Applied only when code that needs it asks (`require`), not by `install`."""
        return self.trigger == REQUIRE

    @property
    def label(self) -> str:
        """The name a result's compat_shims lists it under."""
        return self.recorded_as or self.name


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
