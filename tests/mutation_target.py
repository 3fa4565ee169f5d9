"""A small stand-in for upstream checkpoint code, the target of tests/test_mutants.py's mutants:
shard offsets, a flag-driven loader, a merge of two state dicts, and a debug switch left off."""

from __future__ import annotations

DEBUG = False


def shard_range(numel: int, rank: int, world: int) -> tuple[int, int]:
    """The [start, end) a rank holds of `numel` elements split as evenly as possible."""
    per, extra = divmod(numel, world)
    start = rank * per + min(rank, extra)
    end = start + per + (1 if rank < extra else 0)
    return start, end


def take(values: list[float], rank: int, world: int) -> list[float]:
    start, end = shard_range(len(values), rank, world)
    return values[start:end]


def load(state: dict, expected: set[str], strict: bool = True) -> dict:
    missing = expected - set(state)
    if strict and missing:
        raise KeyError(f"missing keys: {sorted(missing)}")
    return {k: v for k, v in state.items() if k in expected}


def merge(a: dict, b: dict) -> dict:
    out = {"version": 2, **a}
    out.update(b)
    return out


def describe(state: dict) -> str:
    if DEBUG:
        print(sorted(state))
    if False:  # a debug dump switched off in the source: the compiler drops this block
        dump(state)
    return f"{len(state)} keys"


def never_called(x: int) -> int:
    return x * 2 if x > 0 else -x
