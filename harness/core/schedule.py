"""Where and when a case ran on a node's GPUs (GPU packing, harness.orchestration.schedulers.packing), and the
arithmetic of a schedule: shared by the planner (a predicted schedule) and the reports (the one
that ran), which sit on floors that cannot import each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence


@dataclass(frozen=True)
class Placement:
    """One case's GPU set (indices 0..node_gpus-1 of the node's visible GPUs) and its time on them,
    in seconds from the packed run's start; `run_started` (epoch seconds) tells one run's cases
    from another's in a merged report, `devices` is the CUDA_VISIBLE_DEVICES the case got."""

    gpus: tuple[int, ...]
    node_gpus: int
    start_s: float
    end_s: float
    run_started: float = 0.0
    devices: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"gpus": list(self.gpus), "node_gpus": self.node_gpus, "start_s": round(self.start_s, 3),
                "end_s": round(self.end_s, 3), "run_started": round(self.run_started, 3), "devices": self.devices}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Placement:
        return cls(tuple(int(g) for g in doc["gpus"]), int(doc["node_gpus"]), float(doc["start_s"]), float(doc["end_s"]),
                   float(doc.get("run_started", 0.0)), str(doc.get("devices", "")))


@dataclass(frozen=True)
class Summary:
    """A schedule in numbers. `busy_fraction`: GPU-seconds held by cases over node_gpus x wall (a GPU
    held counts as busy: this is what packing fills, not the kernels' utilisation); `serial_s`: the
    sum of the cases' times, what running them one at a time would take."""

    node_gpus: int
    cases: int
    wall_s: float
    serial_s: float
    busy_fraction: float
    peak_gpus: int

    @property
    def speedup(self) -> float:
        return self.serial_s / self.wall_s if self.wall_s > 0 else 1.0

    @property
    def serial_busy_fraction(self) -> float:
        """The busy fraction of the same cases run one at a time (the same GPU-seconds over serial_s)."""
        return self.busy_fraction * self.wall_s / self.serial_s if self.serial_s > 0 else 0.0

    def line(self) -> str:
        return (f"{self.cases} case(s) packed on a {self.node_gpus}-GPU node: wall {self.wall_s:.1f} s vs "
                f"{self.serial_s:.1f} s one at a time ({self.speedup:.2f}x); GPUs busy {100 * self.busy_fraction:.1f}% "
                f"(one at a time: {100 * self.serial_busy_fraction:.1f}%), at most {self.peak_gpus} GPU(s) at once")


def summarize(placements: Sequence[Placement]) -> Summary:
    """The numbers of one run's placements (one node); ValueError on an empty or mixed set."""
    if not placements:
        raise ValueError("no placement to summarise")
    nodes = {p.node_gpus for p in placements}
    if len(nodes) != 1:
        raise ValueError(f"placements of nodes of different sizes {sorted(nodes)}: summarise one run at a time")
    node = nodes.pop()
    wall = max(p.end_s for p in placements) - min(p.start_s for p in placements)
    held = sum(len(p.gpus) * (p.end_s - p.start_s) for p in placements)
    events = sorted([(p.start_s, 1, len(p.gpus)) for p in placements] + [(p.end_s, 0, -len(p.gpus)) for p in placements])
    peak = now = 0
    for _, _, delta in events:  # at one instant, ends (0) before starts (1): a freed set is reused, not doubled
        now += delta
        peak = max(peak, now)
    return Summary(node, len(placements), wall, sum(p.end_s - p.start_s for p in placements),
                   held / (node * wall) if wall > 0 else 0.0, peak)


def summaries(records: Iterable[dict[str, Any] | None]) -> list[Summary]:
    """One Summary per packed run among results.json `placement` records (None: a case not packed),
    oldest run first: a merged report holds one run per shard."""
    runs: dict[tuple[float, int], list[Placement]] = {}
    for rec in records:
        if rec:
            p = Placement.from_json(rec)
            runs.setdefault((p.run_started, p.node_gpus), []).append(p)
    return [summarize(runs[k]) for k in sorted(runs)]
