"""The one registry of Shim records: every public module of harness.compat lists its records in
the conventional name `SHIMS` (harness.compat._shim), and `collect` finds them by walking the
package (pkgutil), so a new module's records need no wiring. Keyed by name (unique across modules),
in module order (alphabetical) then each module's own order: `install` applies in that order.

  records()            name -> Shim, every record
  get(name)            one record (KeyError naming the known ones)
  by_upstream(pkg)     the records that touch a package or module (dotted prefix: 'megatron.core')
  by_kind(kind)        ADAPTS (an API or environment adapted to) or HIDES (an upstream defect stepped around)
  by_trigger(trigger)  INSTALL / REQUIRE / CALLER
  by_label(label)      the record a result's compat_shims names (None where none does)
  switched(switch)     name -> record of the workarounds one option lists ('training', 'verl', 'fsdp', 'converter')
  defaults(switch)     the names that option lists when a matrix entry leaves it out (default_on)
  check(switch, names, what)  ValueError for a name that option does not know, listing the known ones
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache
from types import ModuleType

from harness.compat._shim import KINDS, SWITCHES, TRIGGERS, Shim

#: the name every compat module lists its records in
CONVENTION = "SHIMS"
PACKAGE = "harness.compat"


def modules(package: str = PACKAGE) -> list[ModuleType]:
    """The package's public modules (not `_`-prefixed, not this one), imported, by name."""
    pkg = importlib.import_module(package)
    names = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_") and not m.ispkg)
    return [importlib.import_module(f"{package}.{n}") for n in names if f"{package}.{n}" != __name__]


def collect(package: str = PACKAGE) -> dict[str, Shim]:
    """Every record of every public module of `package`, keyed by name. A module without `SHIMS`, an
    entry that is not a Shim, or a name (or result label) two records share is refused."""
    out: dict[str, Shim] = {}
    labels: dict[str, str] = {}
    for module in modules(package):
        if not hasattr(module, CONVENTION):
            raise LookupError(f"{module.__name__} has no {CONVENTION}: every compat module lists its Shim records "
                              f"there (an empty tuple where it has none)")
        for shim in getattr(module, CONVENTION):
            if not isinstance(shim, Shim):
                raise TypeError(f"{module.__name__}.{CONVENTION} holds {shim!r}, not a Shim")
            if shim.name in out:
                raise ValueError(f"shim name {shim.name!r} is defined twice ({module.__name__} and another module)")
            if shim.label in labels:
                raise ValueError(f"shim label {shim.label!r} is used by {labels[shim.label]!r} and {shim.name!r}")
            out[shim.name] = shim
            labels[shim.label] = shim.name
    return out


@lru_cache(maxsize=None)
def _records() -> dict[str, Shim]:
    return collect()


def records() -> dict[str, Shim]:
    return dict(_records())


def get(name: str) -> Shim:
    try:
        return _records()[name]
    except KeyError:
        raise KeyError(f"no shim {name!r}; known: {sorted(_records())}") from None


def by_upstream(package: str) -> tuple[Shim, ...]:
    """Records whose upstream is `package` or a module under it."""
    return tuple(s for s in _records().values() if s.upstream == package or s.upstream.startswith(package + "."))


def by_kind(kind: str) -> tuple[Shim, ...]:
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {KINDS}")
    return tuple(s for s in _records().values() if s.kind == kind)


def by_trigger(trigger: str) -> tuple[Shim, ...]:
    if trigger not in TRIGGERS:
        raise ValueError(f"trigger {trigger!r} is not one of {TRIGGERS}")
    return tuple(s for s in _records().values() if s.trigger == trigger)


def by_label(label: str) -> Shim | None:
    """The record a result's compat_shims entry `label` names (None: not a registered shim)."""
    return next((s for s in _records().values() if s.label == label), None)


def switched(switch: str) -> dict[str, Shim]:
    if switch not in SWITCHES:
        raise ValueError(f"switch {switch!r} is not one of {SWITCHES}")
    return {n: s for n, s in _records().items() if s.switch == switch}


def defaults(switch: str) -> tuple[str, ...]:
    return tuple(n for n, s in switched(switch).items() if s.default_on)


def check(switch: str, names: object, what: str) -> None:
    """Refuse names the option `switch` does not know: ValueError 'unknown WHAT [...]; known: [...]'."""
    known = switched(switch)
    bad = sorted(set(names) - set(known))  # type: ignore[call-overload]
    if bad:
        raise ValueError(f"unknown {what} {bad}; known: {sorted(known)}")
