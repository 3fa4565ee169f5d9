"""The rank's event sink: what backends did in this process (which strategy a save or load really
ran, whether a cache served it). Backends append with `record_event`; the case envelope
(harness.run.envelope) drains it per rank into CaseResult.backend_events, and the backend's
`strategy_check` judges it after the case."""

from __future__ import annotations

_events: list[dict] = []


def record_event(event: dict) -> None:
    _events.append(dict(event))


def drain_events() -> list[dict]:
    out = list(_events)
    _events.clear()
    return out
