"""Typed options: a frozen dataclass per case (and per backend) declares every option with its
type and default; matrix values are coerced and checked against it, errors name the option.

Shared by the case contract (harness.run.envelope) and the backends (harness.backends), so neither
imports the other for it.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class NoOptions:
    """A case without options."""


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(name: str, value: Any, tp: Any) -> Any:
    """`value` as type `tp`, or ValueError naming the option; YAML lists become tuples, and a
    float option takes an int or a numeric string (PyYAML reads `1e-3` as a string)."""
    origin = typing.get_origin(tp)
    ok = True
    if origin is Literal:
        ok = value in typing.get_args(tp)
    elif origin is tuple:
        if isinstance(value, (list, tuple)):
            return tuple(_coerce(name, v, typing.get_args(tp)[0]) for v in value)
        ok = False
    elif tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                ok = False
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if ok else value
    elif tp is str:
        ok = isinstance(value, str)
    if not ok:
        raise ValueError(f"option {name!r}: expected {_describe(tp)}, got {value!r}")
    return value


def parse_options(cls: type, raw: dict[str, Any], owner: str) -> Any:
    """An instance of the frozen dataclass `cls` from raw matrix options."""
    assert is_dataclass(cls), cls
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        takes = f"takes {', '.join(names)}" if names else "takes no options"
        raise ValueError(f"{owner} {takes}; unknown option(s) {unknown}")
    hints = typing.get_type_hints(cls)
    try:
        return cls(**{k: _coerce(k, v, hints[k]) for k, v in raw.items()})
    except TypeError as exc:  # a required field without a default
        raise ValueError(f"{owner}: {exc}") from None
