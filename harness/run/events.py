"""The rank's event sink: what backends did in this process (which strategy a save or load really
ran, whether a cache served it). Backends append with `record_event`; the case envelope
(harness.run.envelope) drains it per rank into CaseResult.backend_events, and the backend's
`strategy_check` judges it after the case."""

from __future__ import annotations

_events: list[dict] = []


def record_event(event: dict, backend: str | None = None) -> None:
    """Append `event`, tagged with the `backend` that recorded it (a case may save through one
    backend and load through another: each strategy check reads its own)."""
    _events.append(dict(event) if backend is None else {**event, "backend": backend})


def each_event(events: dict[str, dict[str, list[dict]]], op: str | None = None,
               backend: str | None = None) -> list[tuple[str, str, dict]]:
    """(phase, rank, event) for every event of a case's `backend_events` (per world phase, per rank,
    as the envelope drained them), phases and ranks in sorted order; only those of `op` and of
    `backend` when given."""
    return [(phase, rank, e) for phase, ranks in sorted(events.items()) for rank, evs in sorted(ranks.items())
            for e in evs if (op is None or e.get("op") == op) and (backend is None or e.get("backend") == backend)]


def drain_events() -> list[dict]:
    out = list(_events)
    _events.clear()
    return out
