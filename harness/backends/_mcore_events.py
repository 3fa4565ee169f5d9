"""What one save or load that mcore_dist recorded (harness.run.events) did differently from what its
options (McoreDistOptions) asked: the strategy check's reading of each event, apart from the backend
that records them; and the tracker of the fully-parallel load's exchange that feeds those events."""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from harness.run.events import each_event


def manifest_problems(directory: Path) -> list[str]:
    """Megatron-Core's integrity manifest (integrity.json) against the checkpoint it describes, each file
    hashed here with hashlib: a manifest whose hashes are wrong but agree with the same code's own
    verification (a changed chunk size, algorithm or file list) passes every load yet refuses the
    checkpoint under another release's verification, or protects nothing."""
    import hashlib
    import json

    manifest = Path(directory) / "integrity.json"
    try:
        doc = json.loads(manifest.read_text())
        algorithm, files = doc["algorithm"], doc["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{manifest} is not a manifest of algorithm and files: {type(exc).__name__}: {exc}"]
    if algorithm != "sha256":
        return [f"algorithm {algorithm!r}, megatron-core's documented manifest is sha256"]
    here = sorted(f.name for f in Path(directory).iterdir() if f.is_file() and f.name != manifest.name)
    out = [f"{name}: in the checkpoint, not in the manifest" for name in here if name not in files]
    out += [f"{name}: in the manifest, not in the checkpoint" for name in sorted(files) if name not in here]
    if not here:
        out.append(f"{directory} holds no file besides the manifest")
    for name in (n for n in here if n in files):
        with open(Path(directory) / name, "rb") as f:  # streamed: a checkpoint file may be larger than host memory
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        if files[name] != digest:
            out.append(f"{name}: the manifest's sha256 {str(files[name])[:16]}... is not the file's")
    return out


#: megatron-core's strictness flags whose `load` returns (state, missing keys, unexpected keys)
RETURNING = frozenset({"return_all", "return_unexpected"})
#: the flags under which the dist load leaves out the keys the checkpoint lacks instead of failing
TOLERATING = RETURNING | {"log_all", "log_unexpected", "ignore_all"}


def returned_keys(out: Any, strict: str, event: dict) -> Any:
    """The loaded state of a `dist_checkpointing.load` result; under a returning strictness, the
    missing keys (the checkpoint holds, no rank asked) and unexpected keys (this rank asked, the
    checkpoint lacks) it returned go into the load's `event`, for the case to hold to its truth."""
    if strict not in RETURNING:
        return out
    if not (isinstance(out, tuple) and len(out) == 3):
        event["returned_keys"] = False  # the strategy check names it
        return out
    state, missing, unexpected = out
    event.update(returned_keys=True, missing_keys=sorted(missing), unexpected_keys=sorted(unexpected))
    return state


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
        if ev.get("manifest") is False:
            out.append("the save wrote no integrity manifest (integrity.json), though verify_integrity asked for one")
        out += [f"integrity manifest: {p}" for p in ev.get("manifest_problems") or []]
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
            asked = getattr(o, "exchange_algo", "broadcast")
            if ev.get("exchanges") and ev.get("exchange_algos", [asked]) != [asked]:
                out.append(f"exchanged with {', '.join(ev['exchange_algos'])}, asked {asked}")
        if o.cache_metadata and not ev.get("metadata_cached"):
            out.append("the load strategy cached no checkpoint metadata")
        if o.strict in RETURNING and not ev.get("returned_keys"):
            out.append(f"strict {o.strict}: the load returned no missing and unexpected keys beside the state")
    return out


def strategy_check(o: Any, default: Any, events: dict[str, dict[str, list[dict]]], backend: str) -> Any:
    """Every save and load of the case ran what the options asked (events recorded by
    save_state/load_state in each rank): the wrapper class and the group it spans (the DP x CP
    group of that world), the fully-parallel load's exchange, the async strategy, and with
    cache_metadata what megatron-core's caches gave each save of a job (save 1 plans from
    scratch and validates access integrity; save 2 starts from the cached local plan, save 3
    from the cached central plan and global metadata, the fully-parallel distribution is
    cached from save 2) and that each load cached the checkpoint's metadata; and each training
    load read back the content metadata the save wrote (option content_metadata). None when every
    option is at its `default` (the strategy fields; strict and layout are not strategies) and no
    training checkpoint was loaded (nothing was asked)."""
    from harness.core.parity import EXACT
    from harness.core.result import Check
    from harness.judge.checks import STRATEGY_CHECK

    flat = each_event(events, backend=backend)
    read_back = any(e["op"] == "content_metadata" for _, _, e in flat)
    if o == default and not read_back and o.strict not in RETURNING:
        return None
    problems: list[str] = []
    seen: dict[str, set] = {"save": set(), "load": set(), "content_metadata": set()}
    for phase, rank, ev in flat:
        where = f"{phase}@rank{rank} {ev['op']} {ev.get('n', '')}".rstrip()
        problems += [f"{where}: {p}" for p in event_problems(o, ev)]
        seen[ev["op"]].add(phase)
    if not seen["save"] and o != default:
        problems.append("no save ran through this backend")
    if (o.load_strategy != "default" or o.strict in RETURNING) and not seen["load"]:
        problems.append("no load ran through this backend")
    asked = ", ".join(f"{k}={v}" for k, v in vars(o).items())
    if problems:
        return Check(STRATEGY_CHECK, "failed", f"asked {asked}; " + "; ".join(problems[:12])
                     + (f"; ... {len(problems) - 12} more" if len(problems) > 12 else ""), tolerance=EXACT)
    n_saves, n_loads = (sum(e["op"] == op for _, _, e in flat) for op in ("save", "load"))
    return Check(STRATEGY_CHECK, "passed", f"{n_saves} rank-save(s) in {sorted(seen['save'])} and {n_loads} rank-load(s) in "
                 f"{sorted(seen['load'])} ran what was asked: {asked}"
                 + ("; every training load read back the content metadata its save wrote" if read_back and o.content_metadata else ""),
                 tolerance=EXACT)


@contextmanager
def tracked_exchange(calls: list) -> Iterator[None]:
    """(mcore_dist) Record the fully-parallel load's data exchange (megatron-core's exchange_by_distribution,
    called by FullyParallelLoadStrategyWrapper.load) as its own memory phase, `exchange`, and
    its exchange algorithm in `calls`, one per call."""
    from megatron.core.dist_checkpointing.strategies import fully_parallel

    from harness.core.memory import track

    original = fully_parallel.exchange_by_distribution
    signature = inspect.signature(original)

    def exchange(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append(bound.arguments.get("exchange_algo"))
        with track("exchange"):
            return original(*args, **kwargs)

    fully_parallel.exchange_by_distribution = exchange
    try:
        yield
    finally:
        fully_parallel.exchange_by_distribution = original
