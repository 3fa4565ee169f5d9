"""The plan's host-memory model (harness/plan/memory.py) against measurement, at small sizes.

For a zoo GPT (default gpt-25m, fp32 on CPU/gloo) at DP 1 and 2, each save/load strategy runs in a
fresh world as benchmarks/save_memory.py does: one real Adam step, then `dist_checkpointing.save`
of model + optimizer (tracked: phase save) and, in the same world, building the load template,
`dist_checkpointing.load` and the restore (tracked: phase load). Freed heap is handed back to the
OS (gc + malloc_trim) before each phase, so a peak is not hidden in pages the allocator kept. The
prediction for the same model and topology comes from the plan's own path: the model built on
meta under the fake process group (harness.plan.collect.topology_records), its records through
harness.plan.memory with device "cpu".

    python -m benchmarks.memory_calibration --out DIR [--model gpt-25m] [--dp 1 2]

Writes DIR/calibration.json (rows: strategy, dp, rank, phase, predicted, measured bytes, ratio)
and DIR/calibration.md (the table)."""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harness.core.context import RankContext
from harness.core.memory import MiB, track
from harness.core.topology import Topology
from harness.plan import memory
from harness.run.world import WorldError, launch


@dataclass(frozen=True)
class _Job:
    model: str
    topo: Topology
    strategy: str
    ckpt: str


def _trim() -> None:
    """Return freed heap to the OS, so the next phase's baseline holds only live state."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _strategies(fully_parallel: bool):
    """(save strategy, load strategy) as Megatron-LM builds them; None: dist_checkpointing's default."""
    if not fully_parallel:
        return None, None
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return (FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), group),
            FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy(), group, exchange_algo="broadcast"))


def _rank(ctx: RankContext, job: _Job) -> dict:
    """One strategy in a fresh world: train a step, save (tracked), load it back (tracked)."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from harness.core.zoo import get_model
    from harness.models import training
    from harness.models.parallel import init_parallel

    _, fmt, mem_eff, fully_parallel = memory.STRATEGIES[memory.STRATEGY_NAMES.index(job.strategy)]
    if fmt == "fully_reshardable":  # the harness's shim for megatron-core's KeyError 'step' (harness/compat/mcore.py)
        from harness.compat import mcore as compat

        compat.apply_workaround("fully_reshardable_step")
    spec = get_model(job.model, "gpt")
    init_parallel(job.topo)
    ddp, optimizer = training.build_training(spec, job.topo, training.TrainConfig())
    training.train_steps(ddp, optimizer, spec, 0, 1)  # real, non-zero optimizer state
    save_strategy, load_strategy = _strategies(fully_parallel)
    ckpt = Path(job.ckpt)
    if ctx.is_rank0:
        ckpt.mkdir(parents=True)
    dist.barrier()
    _trim()
    with track("save", interval_s=0.002) as saved:
        state = training.sharded_state(ddp, optimizer, fmt, mem_eff, is_loading=False)
        if save_strategy is None:
            dist_checkpointing.save(state, str(ckpt))
        else:
            dist_checkpointing.save(state, str(ckpt), save_strategy)
    del state
    dist.barrier()
    _trim()
    with track("load", interval_s=0.002) as loaded:
        template = training.sharded_state(ddp, optimizer, fmt, mem_eff, is_loading=True)
        if load_strategy is None:
            state = dist_checkpointing.load(template, str(ckpt))
        else:
            state = dist_checkpointing.load(template, str(ckpt), load_strategy)
        with torch.no_grad():  # fp32 main params are views of leaf params (the harness's `load_no_grad` workaround)
            training.TrainingJob(ddp, optimizer, sharding=fmt, mem_efficient=mem_eff).restore(state)
    params = sum(p.numel() for d in ddp for p in d.module.parameters())
    return {"state_bytes": training.rank_state_bytes(ddp, optimizer), "params": params,
            "save": saved.to_dict(), "load": loaded.to_dict()}


def plan_model(name: str):
    """The zoo model as the plan reads a model (harness.plan.model.PlanModel), fp32 as the worlds train it."""
    from harness.core.zoo import get_model
    from harness.plan.model import PlanModel

    s = get_model(name, "gpt")
    if s.is_moe or s.tied_embeddings or not s.swiglu or s.normalization != "RMSNorm" or s.add_bias_linear:
        raise ValueError(f"{name}: the plan builds untied SwiGLU RMSNorm GPTs without biases only")
    return PlanModel(name=s.name, num_layers=s.num_layers, hidden_size=s.hidden_size,
                     num_attention_heads=s.num_attention_heads, num_query_groups=s.num_query_groups,
                     ffn_hidden_size=s.ffn_hidden_size, vocab_size=s.vocab_size, seq_length=s.seq_length,
                     dtype="float32")


def predict(name: str, topo: Topology) -> tuple[dict, dict]:
    """(per rank {strategy: peaks}, the coordinate inputs) from the plan's records of `topo`."""
    from harness.plan.collect import topology_records

    coords = memory.coordinate_inputs(topology_records(plan_model(name), topo))
    setup = memory.Setup(device="cpu", fp32_model=True)
    out: dict[int, dict] = {}
    for rank in range(topo.world_size):
        coord, d, e = memory.rank_layout(rank, topo.tp, topo.dp, topo.ep)
        out[rank] = {s: memory.rank_peaks(coords[coord], topo.dp, topo.expert_dp, d, e, s, setup)
                     for s in memory.STRATEGY_NAMES}
    return out, {f"{c[0]},{c[1]},{c[2]}": v.to_json() for c, v in coords.items()}


def run(model: str, dps: list[int], out: Path) -> dict:
    from harness.run.preload import warm

    warm()
    rows: list[dict] = []
    inputs: dict[str, dict] = {}
    for dp in dps:
        topo = Topology(dp=dp)
        predicted, inputs[topo.id] = predict(model, topo)
        for name, _, _, fully_parallel in memory.STRATEGIES:
            if fully_parallel and dp == 1:
                continue  # the wrappers hand a group of one to the base strategy: the default's numbers
            scratch = Path(tempfile.mkdtemp(prefix="ckpt-harness-calib-"))
            t0 = time.perf_counter()
            try:
                results = launch(_rank, _Job(model, topo, name, str(scratch / "ckpt")), topo.world_size,
                                 scratch / "world", timeout_s=900)
            except WorldError as exc:
                for phase in ("save", "load"):
                    rows.append({"strategy": name, "dp": dp, "rank": 0, "phase": phase, "predicted": None,
                                 "measured": None, "error": str(exc).strip().splitlines()[-1][:200]})
                print(f"dp={dp} {name}: FAILED {rows[-1]['error']}", flush=True)
                continue
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            for rank, r in enumerate(results):
                for phase in ("save", "load"):
                    p = predicted[rank][name]
                    meas = r[phase]["peak_delta"]
                    rows.append({"strategy": name, "dp": dp, "rank": rank, "phase": phase,
                                 "predicted": p[f"{phase}_delta"], "measured": meas,
                                 "ratio": round(p[f"{phase}_delta"] / meas, 3) if meas > 0 else None,
                                 "predicted_baseline": p["baseline"], "state_bytes": r["state_bytes"],
                                 "params": r["params"], "seconds": r[phase]["seconds"]})
            print(f"dp={dp} {name:48s} " + "  ".join(
                f"r{x['rank']} {x['phase']} {x['predicted'] / MiB:7.1f}/{x['measured'] / MiB:7.1f} MiB"
                for x in rows if x["dp"] == dp and x["strategy"] == name) + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    problems = memory.calibration_problems(rows)
    for r in rows:  # the prediction is for the model the world trained only if the plan built the same parameters
        built = next(iter(inputs[f"tp1pp1dp{r['dp']}cp1"].values()))
        if "params" in r and r["params"] != built["params_dense"] + built["params_expert"]:
            problems.append(f"{r['strategy']} dp{r['dp']} rank {r['rank']}: the world's model has {r['params']:,} "
                            f"parameters, the plan built {built['params_dense'] + built['params_expert']:,}")
    doc = {"model": model, "device": "cpu", "bound": list(memory.BOUND), "floor_bytes": memory.FLOOR,
           "inputs": inputs, "rows": rows, "problems": problems}
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "calibration.md").write_text(table(doc))
    return doc


def table(doc: dict) -> str:
    """predicted vs measured vs ratio, per strategy, DP size, rank and phase (MiB)."""
    lines = [f"{doc['model']} on CPU (gloo), fp32, 1 Adam step; peak RSS over the phase's baseline, MiB; "
             f"bound {doc['bound'][0]}..{doc['bound'][1]} (both raised to {doc['floor_bytes'] // MiB} MiB)", "",
             "| strategy | DP | rank | save predicted | save measured | ratio | load predicted | load measured | ratio |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    cells: dict[tuple, dict] = {}
    for r in doc["rows"]:
        cells.setdefault((r["strategy"], r["dp"], r["rank"]), {})[r["phase"]] = r
    for (name, dp, rank), ph in cells.items():
        parts = []
        for phase in ("save", "load"):
            r = ph.get(phase, {})
            if r.get("measured") is None:
                parts += ["-", f"**{r.get('error', 'not run')}**", "-"]
                continue
            ratio = max(r["predicted"], doc["floor_bytes"]) / max(r["measured"], doc["floor_bytes"])
            parts += [f"{r['predicted'] / MiB:.1f}", f"{r['measured'] / MiB:.1f}", f"{ratio:.2f}"]
        lines.append(f"| {name} | {dp} | {rank} | " + " | ".join(parts) + " |")
    lines += ["", f"problems: {doc['problems'] or 'none'}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-25m")
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--out", type=Path, default=Path("reports/memory-calibration"))
    a = p.parse_args(argv)
    doc = run(a.model, a.dp, a.out)
    print(table(doc))


if __name__ == "__main__":
    main()
