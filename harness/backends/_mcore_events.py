"""What one save or load that mcore_dist recorded (harness.run.events) did differently from what its
options (McoreDistOptions) asked: the strategy check's reading of each event, apart from the backend
that records them."""

from __future__ import annotations

from typing import Any


def event_problems(o: Any, ev: dict) -> list[str]:
    """What in one recorded save or load differs from what options `o` ask."""
    out = []
    if ev["op"] == "content_metadata":
        if o.content_metadata and not ev["read"]:
            out.append("the checkpoint holds no content metadata, though the save passed the job's (content_metadata: true)")
        elif o.content_metadata and any(ev["read"].get(k) != v for k, v in ev["job"].items()):
            out.append(f"content metadata read back {ev['read']} differs from what the job saves {ev['job']}")
        return out
    if ev["op"] == "save":
        if ev["strategy"] != o.save_strategy:
            out.append(f"ran the {ev['strategy']} save strategy, asked {o.save_strategy}")
        if ev["strategy"] == "fully_parallel":
            if ev["group"] != ev["dp_cp"]:
                out.append(f"distributed over a group of {ev['group']} ranks, the DP x CP group has {ev['dp_cp']}")
            want = "cached" if o.cache_metadata and ev["n"] > 1 else "computed"
            if ev.get("distribution") != want:
                out.append(f"save distribution {ev.get('distribution') or 'not applied'}, expected {want}")
        if o.cache_metadata:
            want = min(ev["n"] - 1, 2)
            if ev["plan_reuse"] != want:
                out.append(f"started from plan-cache level {ev['plan_reuse']}, megatron-core's cache gives save {ev['n']} level {want} "
                           "(0: plans from scratch, 1: cached local plan, 2: cached central plan + global metadata)")
            if ev["validated"] != (ev["n"] == 1):
                out.append(f"validate_access_integrity={ev['validated']} (Megatron-LM validates only a job's first save)")
        elif ev["plan_reuse"] is not None:
            out.append(f"plan cache in use (level {ev['plan_reuse']}) without cache_metadata")
        if ev["async"] != o.async_save:
            out.append(f"async_save {ev['async']}, asked {o.async_save}")
    else:
        if ev["strategy"] != o.load_strategy:
            out.append(f"ran the {ev['strategy']} load strategy, asked {o.load_strategy}")
        if ev["strategy"] == "fully_parallel":
            if ev["group"] != ev["dp_cp"]:
                out.append(f"distributed over a group of {ev['group']} ranks, the DP x CP group has {ev['dp_cp']}")
            if ev["group"] > 1 and not ev.get("exchanges"):
                out.append("no tensor exchange between the group's ranks (each read everything itself)")
        if o.cache_metadata and not ev.get("metadata_cached"):
            out.append("the load strategy cached no checkpoint metadata")
    return out
