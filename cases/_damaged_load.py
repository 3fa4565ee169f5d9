"""Loading a damaged or foreign dist checkpoint and judging what the load did (refused, crashed, or
silent with or without corrupt data): what corrupt-load and interrupted-save share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from harness.backends import BackendRef, get_backend
from harness.core import truth
from harness.core.context import RankContext
from harness.core.parity import NOT_COMPARED, Mismatch, Shard
from harness.core.result import Check
from harness.core.topology import Topology
from harness.core.zoo import ModelSpec
from harness.faults.damage import Damage
from harness.judge.checks import state_check
from harness.models import mcore as models
from harness.run.world import WorldError, WorldTimeout, exception_of


class RefusedLoadError(RuntimeError):
    """Raised by a load-side rank around the backend's load only, so the parent tells a refusal of
    the damaged checkpoint from a harness error elsewhere in the rank. Message: the exception chain."""


def chain_text(exc: BaseException) -> str:
    """`Type: message` of an exception and every cause/context below it, outermost first (what a
    user's traceback shows)."""
    parts, seen = [], set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        odd = "" if isinstance(cur, Exception) else " (a BaseException: `except Exception` does not catch it)"
        parts.append(f"{type(cur).__name__}{odd}: {cur}")
        cur = cur.__cause__ or cur.__context__
    return "\n".join(parts)


@dataclass(frozen=True)
class Outcome:
    kind: Literal["refused", "silent", "crashed"]
    text: str = ""  # refused: the exception chain ("Type: message", outermost first); crashed: the world's error


@dataclass(frozen=True)
class DistPhase:
    model: ModelSpec
    topo: Topology
    backend: BackendRef  # import path + options
    save_to: str | None = None
    load_from: str | None = None


@dataclass
class LoadOut:
    shards: list[Shard]
    shard_bytes: int


def rank_dist(ctx: RankContext, p: DistPhase) -> LoadOut:
    backend = get_backend(p.backend)
    model = models.build_gpt(p.model, p.topo)
    if p.load_from is None:
        models.fill_canonical(model, p.model)
        backend.save(ctx, model, Path(p.save_to))
    else:
        models.fill_canonical(model, p.model.with_seed(p.model.seed + truth.DECOY_SEED_OFFSET))
        try:
            backend.load(ctx, model, Path(p.load_from))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # torch DCP's CheckpointException is a BaseException
            raise RefusedLoadError(chain_text(exc)) from exc
    shards = models.local_shards(model)
    return LoadOut(shards, sum(s.data.numel() * s.data.element_size() for s in shards))


def named(dmg: Damage, text: str) -> list[str]:
    """The damaged files and keys the refusal's text names (empty: an unclear refusal)."""
    return [n for n in dmg.names if n and n in text]


def quote(text: str) -> str:
    """The first line of a refusal, and its last when they differ (torch DCP's CheckpointException
    says only `ranks:dict_keys([0])` first; the rank's root cause is its last line)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    return lines[0][:240] + (f" ... {lines[-1][:240]}" if len(lines) > 1 and lines[-1] != lines[0] else "")


def judge(
    dmg: Damage, outcome: Outcome, expected: dict[str, torch.Tensor] | None = None,
    loaded: dict[str, torch.Tensor] | None = None, problems: list[Mismatch] | None = None, label: str = "loaded",
) -> list[Check]:
    """`outcome` and `loaded-canonical` from what the load did. `expected`/`loaded`/`problems`
    (silent loads only): the truth, the loaded tensors (assembled), and assembly problems."""
    what = f"{dmg.kind} ({dmg.detail})"
    if outcome.kind == "refused":
        hits = named(dmg, outcome.text)
        clarity = f"clear, names {', '.join(hits[:3])}" if hits else f"unclear, names none of {list(dmg.names[:3])}"
        return [
            Check("outcome", "passed", f"refused ({clarity}): {quote(outcome.text)} [damage: {what}]", tolerance=NOT_COMPARED),
            Check("loaded-canonical", "not-run", "the load refused: nothing was loaded", tolerance=NOT_COMPARED),
        ]
    if outcome.kind == "crashed":
        return [
            Check("outcome", "failed", f"crashed: {quote(outcome.text)} [damage: {what}]", tolerance=NOT_COMPARED),
            Check("loaded-canonical", "not-run", "no rank returned from the load", tolerance=NOT_COMPARED),
        ]
    loaded_check = state_check("loaded-canonical", expected or {}, loaded or {}, "canonical", label,
                               f"{len(loaded or {})} tensors loaded equal canonical", problems=problems or [])
    if loaded_check.failed:
        keys = sorted({m.key for m in loaded_check.mismatches})
        warned = f"; it only warned: {outcome.text[:300]}" if outcome.text else ""
        detail = (f"silent: the load of a damaged or foreign checkpoint returned and {len(keys)} tensor(s) differ from canonical "
                  f"({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}): data corruption{warned} [damage: {what}]")
        return [Check("outcome", "failed", detail, tolerance=NOT_COMPARED), loaded_check]
    unread = (f"the damaged {', '.join(dmg.files)} {'was' if len(dmg.files) == 1 else 'were'} never read" if dmg.files
              else "nothing the foreign checkpoint changes was read")
    return [
        Check("outcome", "passed", f"silent-but-intact: the load returned everything bitwise canonical; "
                                   f"{unread} [damage: {what}]", tolerance=NOT_COMPARED),
        loaded_check,
    ]


def outcome_of(exc: WorldError) -> Outcome | None:
    """A failed load world as an outcome; None when a rank failed outside the load (a harness error)."""
    if isinstance(exc, WorldTimeout):
        return Outcome("crashed", f"hung: {exc}")
    tb = exc.rank_traceback or ""
    marker = f"{RefusedLoadError.__name__}: "  # outermost, so last; its message may hold more "X: y" lines
    if marker in tb:
        return Outcome("refused", tb.rsplit(marker, 1)[1].strip())
    if not exception_of(tb)[0]:
        return Outcome("crashed", str(exc))
    return None
