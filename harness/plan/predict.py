"""What a save writes and a load reads, per rank, from the records; and the host memory a rank's
weights and distributed-optimizer state take (an estimate, formula below).

Per model-parallel coordinate (tp, pp, ep):
- written at save: the bytes of the coordinate's main replicas (replica id all zeros), which
  megatron-core writes from data-parallel rank 0 of each replica group (a fully-parallel save
  spreads the same bytes over the data-parallel group with context parallel: about dense written /
  (dp x cp) + expert written / expert-dp each);
- read at load: every local box the rank asks for, replicas included (every dp and cp rank reads);
- weights in host memory: the same local bytes;
- distributed optimizer (estimate): 12 bytes per local parameter (fp32 main copy + two fp32 Adam
  moments), divided over the data-parallel group with context parallel, dp x cp ranks (megatron-core's
  `get_data_parallel_group(with_context_parallel=True)`; expert parameters over the expert-data-parallel
  group, topo.expert_dp); both formats hold it so in memory, they differ in what the checkpoint can be loaded at.
- per save/load strategy, the host peaks per rank and per node (harness/plan/memory.py: what each
  megatron-core path gathers and stages, `host_memory`).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Iterable

from harness.core.topology import Topology
from harness.plan import memory

OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 main param + exp_avg + exp_avg_sq
FORMATS = ("fully_reshardable", "dp_reshardable")


def _is_expert(key: str) -> bool:
    return ".experts." in key


def per_coordinate(records: Iterable, topo: Topology) -> list[dict]:
    rows: dict[tuple, dict] = defaultdict(lambda: {"written": 0, "read": 0, "params": 0, "optimizer": 0.0, "keys": 0})
    dpcp = topo.dp * topo.cp
    for r in records:
        row = rows[tuple(r.coord)]
        row["rank"] = min(row.get("rank", r.rank), r.rank)
        row["read"] += r.nbytes
        row["params"] += r.numel
        row["keys"] += 1
        row["written"] += r.nbytes if r.main else 0
        row["optimizer"] += OPTIMIZER_BYTES_PER_PARAM * r.numel / (topo.expert_dp if _is_expert(r.key) else dpcp)
    return [{"tp": c[0], "pp": c[1], "ep": c[2], **v, "optimizer": int(v["optimizer"]),
             "host": v["read"] + int(v["optimizer"])} for c, v in sorted(rows.items())]


def summary(records: list, topo: Topology, setup: memory.Setup | None = None) -> dict:
    """The side's totals, per-coordinate rows and per-strategy host-memory peaks (`setup`: how the
    job runs, default a GPU job with one DDP bucket per buffer and 8 ranks a node)."""
    rows = per_coordinate(records, topo)
    ranks = Counter(coord for coord, _, _ in memory.topology_layout(topo))  # ranks per (tp, pp, ep) coordinate
    spread: dict[tuple, float] = defaultdict(float)  # a coordinate's fully-parallel share of its main bytes
    for r in records:
        if r.main:
            spread[tuple(r.coord)] += r.nbytes / (topo.expert_dp if _is_expert(r.key) else topo.dp * topo.cp)
    size = sum(r.nbytes for r in records if r.main)
    params = sum(r.numel for r in records if r.main)
    return {
        "topology": topo.id, "world_size": topo.world_size, "coordinates": len(rows),
        "checkpoint_weight_bytes": size, "parameters": params,
        "checkpoint_optimizer_bytes_estimate": OPTIMIZER_BYTES_PER_PARAM * params,
        "max_written_per_rank": max(r["written"] for r in rows),
        "max_written_per_rank_fully_parallel": max((math.ceil(v) for v in spread.values()), default=0),
        "max_read_per_rank": max(r["read"] for r in rows),
        "total_read_all_ranks": sum(r["read"] * ranks[(r["tp"], r["pp"], r["ep"])] for r in rows),
        "max_host_bytes_per_rank": max(r["host"] for r in rows),
        "host_memory": memory.topology_table(records, topo, setup or memory.Setup()),
        "per_coordinate": rows,
    }


def optimizer_verdict(fmt: str, src: Topology, dst: Topology) -> str | None:
    """Why the optimizer state of `fmt` saved at src cannot be loaded at dst (None: it can)."""
    if fmt == "dp_reshardable" and (src.tp, src.pp, src.ep) != (dst.tp, dst.pp, dst.ep):
        return (f"dp_reshardable optimizer state is laid out per (tp, pp, ep) rank: saved at {src.id}, it loads only at "
                f"the same tp/pp/ep (here {dst.id} changes them); save with fully_reshardable to change them")
    return None
