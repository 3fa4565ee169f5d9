"""Per-rank host-memory peaks of a training-checkpoint save and load, per optimizer format and save
strategy: what megatron-core 0.19.2 allocates on the host in each path, applied to a plan's
per-coordinate records (parameter counts, dense vs expert, dp / expert-dp sizes). Why: the plan's
single "weights + 12 B x params / dp" number cannot tell dp_reshardable from fully_reshardable,
and the latter is what OOM'd verl's >30B saves (verl #5154/#5670, hence #5705).

Where the bytes come from (site-packages/megatron/core/, 0.19.2):
- optimizer/distrib_optimizer.py:1828 `sharded_param_state_dp_reshardable` (:1865, :1227): the rank's own
  DO shard (param + exp_avg + exp_avg_sq, 12 B/param over dp) wrapped as ShardedTensors, no copy.
- :1690 `sharded_param_state_fully_reshardable` -> :1262 `get_parameter_state_dp_zero`:
  `world_tensors` (:1316) = 3 fp32 tensors of the whole buffer = 12 B x every local parameter of the
  model-parallel coordinate, on CPU; per bucket `local_shards` (:1340, 12 B x bucket / dp), and
  per state key a received list (:1363, 4 B x bucket) + `torch.cat` (:1393) while the previous
  key's cat is still referenced: 12 B x bucket. Not mem-efficient (:1729): all_gather, every DP
  rank holds the world tensors (`return_on_all_ranks`); mem-efficient: gloo gather, DP rank 0 only.
  At load (`is_loading`) every rank allocates the world tensors (`return_on_all_ranks or
  is_loading`, :1738) and loads the whole coordinate's state into them; no gather.
- dist_checkpointing/strategies/filesystem_async.py:114 `prepare_write_data` (:165): every tensor
  this rank writes that is a view of a larger CPU storage is cloned, all at once, before the write
  (world-tensor slices, DDP-buffer params); :227-246 `preload_tensors` copies GPU tensors to host:
  on a GPU job every written byte is staged on the host.
- strategies/fully_parallel.py:46 `FullyParallelSaveStrategyWrapper` (:105): the main replicas are spread
  over the dp group (written ~ / dp); with mem-efficient only DP rank 0 holds the optimizer items.
  Load (:195, exchange_utils.py:539): each rank reads ~1/dp; what it receives are new tensors
  (`_get_empty_tensor_for_exchange`, `.to(orig_device)`), on the host for a host target (the
  world tensors, which torch.zeros has already touched), not copied into the target.
- torch DCP FileSystemReader: one item at a time read and copied: ~2x the largest item transient.
- transformer/mlp.py:425 `apply_swiglu_sharded_factory`: a gated fc1 is saved as two halves and merged
  at load with `torch.cat` (a new tensor per state: the model's fc1 weights, and with
  fully_reshardable its 3 optimizer states), held until the restore copies them in.

"dp" below is megatron-core's data-parallel group with context parallel (dp x cp ranks,
`get_data_parallel_group(with_context_parallel=True)`): the distributed optimizer and the
fully-parallel save shard over it; expert parameters over the expert-data-parallel group.

Deltas are over the rank's training-state baseline; absolute adds that baseline where it lives on
the host (device "cpu": this project's CPU worlds; "cuda": the state is in GPU memory, 0 on host).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

F32 = 4  # bytes of an fp32 optimizer element
KEYS = 3  # param, exp_avg, exp_avg_sq
RANKS_PER_NODE = 8

#: (name, sharding type, mem_efficient, fully-parallel save+load)
STRATEGIES: tuple[tuple[str, str, bool, bool], ...] = (
    ("dp_reshardable", "dp_reshardable", False, False),
    ("dp_reshardable+fully_parallel", "dp_reshardable", False, True),
    ("fully_reshardable", "fully_reshardable", False, False),
    ("fully_reshardable+fully_parallel", "fully_reshardable", False, True),
    ("fully_reshardable+mem_efficient", "fully_reshardable", True, False),
    ("fully_reshardable+mem_efficient+fully_parallel", "fully_reshardable", True, True),
)
STRATEGY_NAMES = tuple(s[0] for s in STRATEGIES)


def _is_expert(key: str) -> bool:
    return ".experts." in key


@dataclass(frozen=True)
class CoordInputs:
    """What one model-parallel coordinate holds, from its records: local parameters (dense,
    expert), local weight bytes, the weight bytes and parameters its DP rank 0 writes (main
    replicas, the dp axis of the replica id aside), and its largest tensor."""

    params_dense: int
    params_expert: int
    weight_bytes_dense: int
    weight_bytes_expert: int
    main_weight_bytes_dense: int
    main_weight_bytes_expert: int
    main_params_dense: int
    main_params_expert: int
    max_numel: int
    glu_params_dense: int = 0  # gated fc1 weights: a factory whose load merge is a fresh torch.cat
    glu_params_expert: int = 0

    def to_json(self) -> dict:
        return asdict(self)


def coordinate_inputs(records: Iterable) -> dict[tuple[int, int, int], CoordInputs]:
    """Per (tp, pp, ep) coordinate, from plan records (harness.plan.collect.Record or alike)."""
    acc: dict[tuple, dict[str, int]] = {}
    for r in records:
        a = acc.setdefault(tuple(r.coord), dict.fromkeys(CoordInputs.__dataclass_fields__, 0))
        part = "expert" if _is_expert(r.key) else "dense"
        main = not any(tuple(r.replica_id)[:-1])  # written by the coordinate's dp (expert-dp) rank 0
        a[f"params_{part}"] += r.numel
        a[f"weight_bytes_{part}"] += r.nbytes
        a[f"main_weight_bytes_{part}"] += r.nbytes if main else 0
        a[f"main_params_{part}"] += r.numel if main else 0
        a["max_numel"] = max(a["max_numel"], r.numel)
        a[f"glu_params_{part}"] += r.numel if r.key.endswith("linear_fc1.weight") else 0
    return {c: CoordInputs(**v) for c, v in sorted(acc.items())}


@dataclass(frozen=True)
class Setup:
    """How the job runs: where its state lives, its DDP bucket size (None: one bucket per buffer,
    megatron-core's choice without overlap_grad_reduce), its model dtype (fp32: the distributed
    optimizer's main params are views of the DDP param buffer, bf16: their own fp32 copies)."""

    device: str = "cuda"
    bucket_numel: int | None = None
    fp32_model: bool = False
    ranks_per_node: int = RANKS_PER_NODE


def state_bytes(c: CoordInputs, dp: int, edp: int, setup: Setup) -> int:
    """The rank's training state (harness.models.training.rank_state_bytes): weights + its DO shard
    (2 moments; + the fp32 main params when the model is not fp32)."""
    per = (KEYS - 1 if setup.fp32_model else KEYS) * F32
    return c.weight_bytes_dense + c.weight_bytes_expert + int(per * (c.params_dense / dp + c.params_expert / edp))


def _gather(params: int, group: int, receiver: bool, setup: Setup) -> int:
    """get_parameter_state_dp_zero's transient over one buffer: local shards (12 B x bucket / dp)
    and, on a receiving rank, the received list + cat + the previous key's cat (12 B x bucket)."""
    if params == 0:
        return 0
    bucket = params if setup.bucket_numel is None else min(setup.bucket_numel, params)
    return int(KEYS * F32 * bucket / group) + (KEYS * F32 * bucket if receiver else 0)


def rank_peaks(c: CoordInputs, dp: int, edp: int, dp_rank: int, edp_rank: int, strategy: str,
               setup: Setup = Setup()) -> dict[str, int]:
    """One rank's predicted save and load peaks (delta over its training state, and absolute)."""
    _, fmt, mem_eff, fully_parallel = STRATEGIES[STRATEGY_NAMES.index(strategy)]
    d0, e0 = dp_rank == 0, edp_rank == 0
    cpu = setup.device == "cpu"
    shard = KEYS * F32 * (c.params_dense / dp + c.params_expert / edp)  # the rank's own DO state
    # weights this rank writes: DP rank 0 of each replica group, or its share under fully-parallel
    if fully_parallel:
        weights_written = c.main_weight_bytes_dense / dp + c.main_weight_bytes_expert / edp
    else:
        weights_written = c.main_weight_bytes_dense * d0 + c.main_weight_bytes_expert * e0
    world = gather = 0.0
    if fmt == "dp_reshardable":
        opt_written = shard
        # CPU: only views are cloned; fp32 main params are views of the DDP param buffer, moments are not
        opt_staged = (F32 * (c.params_dense / dp + c.params_expert / edp) if setup.fp32_model else 0) if cpu else opt_written
    else:
        holds_d, holds_e = (d0, e0) if mem_eff else (True, True)
        world_d, world_e = KEYS * F32 * c.params_dense * holds_d, KEYS * F32 * c.params_expert * holds_e
        world = world_d + world_e
        gather = max(world_d + _gather(c.params_dense, dp, holds_d, setup),
                     world_d + world_e + _gather(c.params_expert, edp, holds_e, setup))
        main_d, main_e = KEYS * F32 * c.main_params_dense * holds_d, KEYS * F32 * c.main_params_expert * holds_e
        if fully_parallel and not mem_eff:
            opt_written = main_d / dp + main_e / edp
        else:
            opt_written = main_d * d0 + main_e * e0
        opt_staged = opt_written  # world-tensor slices: views, cloned on CPU; on host already on GPU jobs
    save = max(gather, world + weights_written + opt_staged)
    # load: the read (item by item, ~2x the largest), then the GLU merges (fresh cats), each on top of
    # the world tensors fully_reshardable fills on every rank and what a fully-parallel load received
    glu = c.glu_params_dense + c.glu_params_expert
    merges = KEYS * F32 * glu if fmt == "fully_reshardable" else 0
    if cpu:  # the merged fc1 weights (on a GPU job they are merged on the device)
        merges += (c.weight_bytes_dense + c.weight_bytes_expert) * glu / max(1, c.params_dense + c.params_expert)
    held = KEYS * F32 * (c.params_dense + c.params_expert) if fmt == "fully_reshardable" else 0
    if fully_parallel:  # what a rank receives instead of reading becomes new tensors (not the targets)
        if cpu:  # weight replicas; on a GPU job they land on the device
            held += c.weight_bytes_dense * (dp - 1) / dp + c.weight_bytes_expert * (edp - 1) / edp
        if fmt == "fully_reshardable":  # world-tensor items: host targets on any job
            held += KEYS * F32 * (c.params_dense * (dp - 1) / dp + c.params_expert * (edp - 1) / edp)
    load = held + max(2 * F32 * c.max_numel, merges)
    base = state_bytes(c, dp, edp, setup) if cpu else 0
    return {"save_delta": int(save), "load_delta": int(load), "baseline": base,
            "save_peak": int(save) + base, "load_peak": int(load) + base}


def topology_layout(topo) -> list[tuple[tuple[int, int, int], int, int]]:
    """Per global rank of `topo` (a harness.core.topology.Topology): ((tp, pp, ep) coordinate, its rank
    in the data-parallel group with context parallel (the distributed optimizer's and the fully-parallel
    save's group, dp x cp ranks), its expert-data-parallel rank), from megatron-core's RankGenerator
    (harness.plan.collect.rank_coordinates): any cp, any etp."""
    from harness.compat.cuda import guard_megatron_import
    from harness.plan.collect import rank_coordinates

    guard_megatron_import()  # rank_coordinates imports megatron.core
    return [((c["tp"], c["pp"], c["ep"]), c["dp"] * topo.cp + c["cp"], c["edp"]) for c in rank_coordinates(topo)]


def rank_layout(rank: int, tp: int, dp: int, ep: int) -> tuple[tuple[int, int, int], int, int]:
    """topology_layout of one rank at tp, dp, ep (cp 1, etp = tp; the pipeline stage follows from the
    rank), for callers that hold no Topology."""
    from harness.core.topology import Topology

    return topology_layout(Topology(tp=tp, pp=rank // (tp * dp) + 1, dp=dp, ep=ep))[rank]


def topology_table(records: Iterable, topo, setup: Setup = Setup()) -> dict:
    """Per strategy: max over ranks of the save/load peak (delta and absolute) and max over nodes of
    `ranks_per_node` consecutive ranks of the summed absolute peaks."""
    return inputs_table(coordinate_inputs(records), topo, setup=setup)


def inputs_table(coords: dict[tuple[int, int, int], CoordInputs], topo, pp: int | None = None, dp: int | None = None,
                 ep: int = 1, setup: Setup = Setup()) -> dict:
    """topology_table from coordinate inputs (the records' model-parallel coordinates do not change
    with dp: one build answers every dp size). `topo`: a Topology, or its tp with pp, dp, ep given
    (cp 1, etp = tp). The optimizer shards over dp x cp (expert parameters over the topology's
    expert-data-parallel group)."""
    from harness.core.topology import Topology

    if not isinstance(topo, Topology):
        topo = Topology(tp=topo, pp=pp, dp=dp, ep=ep)
    dpcp, edp = topo.dp * topo.cp, topo.expert_dp
    out: dict[str, dict] = {}
    layout = topology_layout(topo)
    for name in STRATEGY_NAMES:
        row = dict.fromkeys(("save_delta", "load_delta", "save_peak", "load_peak"), 0)
        nodes: dict[int, list[int]] = {}
        for rank, (coord, d, e) in enumerate(layout):
            if coord not in coords:
                continue
            p = rank_peaks(coords[coord], dpcp, edp, d, e, name, setup)
            for k in row:
                row[k] = max(row[k], p[k])
            node = nodes.setdefault(rank // setup.ranks_per_node, [0, 0])
            node[0] += p["save_peak"]
            node[1] += p["load_peak"]
        out[name] = {"save_peak_delta_per_rank": row["save_delta"], "load_peak_delta_per_rank": row["load_delta"],
                     "save_peak_per_rank": row["save_peak"], "load_peak_per_rank": row["load_peak"],
                     "save_peak_per_node": max((n[0] for n in nodes.values()), default=0),
                     "load_peak_per_node": max((n[1] for n in nodes.values()), default=0)}
    return {"device": setup.device, "bucket_numel": setup.bucket_numel, "fp32_model": setup.fp32_model,
            "ranks_per_node": setup.ranks_per_node, "strategies": out}


# ---------------------------------------------------------------- calibration


#: predicted / measured must lie in this band for every strategy, rank and phase: measured on
#: gpt-25m (docs/measurements.md, 30 rows) the ratios lie in 0.90..1.06; the band leaves ~25% for
#: allocator and sampling noise and still fails a model that drops fully_reshardable's gather (down
#: to 0.07), its transient (0.40), the save's staging copies (0.26) or the load's GLU merges (0.72)
BOUND = (0.75, 1.33)
#: bytes under which a peak is noise for the ratio (a load's read buffers, allocator reuse: a
#: dp_reshardable load measures 41-48 MiB where 32 MiB are predicted)
FLOOR = 48 * 2**20


def calibration_problems(rows: list[dict], bound: tuple[float, float] = BOUND, floor: int = FLOOR) -> list[str]:
    """Rows {strategy, dp, rank, phase, predicted, measured} (bytes) whose ratio predicted/measured
    (both raised to `floor`) leaves `bound`; an empty input, or a row without a measurement, is a
    problem too (a calibration that measured nothing proves nothing)."""
    if not rows:
        return ["no calibration rows: nothing was measured"]
    lo, hi = bound
    problems = []
    for r in rows:
        where = f"{r.get('strategy')} dp{r.get('dp')} rank {r.get('rank')} {r.get('phase')}"
        if not isinstance(r.get("measured"), (int, float)) or not isinstance(r.get("predicted"), (int, float)):
            problems.append(f"{where}: no measurement ({r.get('error', 'missing')})")
            continue
        ratio = max(r["predicted"], floor) / max(r["measured"], floor)
        if not lo <= ratio <= hi:
            problems.append(f"{where}: predicted {r['predicted'] / 2**20:.1f} MiB / measured "
                            f"{r['measured'] / 2**20:.1f} MiB = {ratio:.2f}, outside {lo}..{hi}")
    return problems
