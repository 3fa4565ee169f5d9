"""Cases: what a scenario checks. One module per case, exposing `CASE`; found by name."""

from __future__ import annotations

import importlib
import pkgutil

from harness.case import Case


def all_cases() -> dict[str, Case]:
    found: dict[str, Case] = {}
    for m in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{m.name}")
        case = getattr(module, "CASE", None)
        if isinstance(case, Case):
            found[case.name] = case
    return found


def get_case(name: str) -> Case:
    cases = all_cases()
    if name not in cases:
        raise KeyError(f"unknown case {name!r}; available: {sorted(cases)}")
    return cases[name]
