"""Rank-0 peak host memory while saving a training checkpoint, vs DP size and optimizer format.

verl made dp_reshardable its default (PR #5705) because fully_reshardable gathers the optimizer
state on DP rank 0. This measures that trade on one model: for DP in (1, 2, 4) and each sharding
type (fully_reshardable with and without mem_efficient), rank 0's peak RSS over its baseline
during `dist_checkpointing.save`, next to the bytes of training state rank 0 holds.

    python -m benchmarks.save_memory --out reports/bench-memory [--model gpt-150m] [--dp 1 2 4]

Writes OUT/results.json, OUT/table.md and OUT/save_memory.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from harness.memory import MiB, track
from harness.topology import Topology
from harness.world import RankContext, WorldError, launch

VARIANTS = (("dp_reshardable", False), ("fully_reshardable", False), ("fully_reshardable", True))


@dataclass(frozen=True)
class _Job:
    model: str
    topo: Topology
    sharding: str
    mem_efficient: bool
    ckpt: str


def _save(ctx: RankContext, job: _Job) -> dict:
    """One variant per fresh world: freed-but-kept heap from an earlier save cannot hide a peak."""
    from harness import models, training
    from harness.backends import get_backend
    from harness.zoo import get_model

    spec = get_model(job.model, "gpt")
    models.init_parallel(job.topo)
    ddp, optimizer = training.build_training(spec, job.topo, training.TrainConfig())
    training.train_steps(ddp, optimizer, spec, 0, 1)  # real, non-zero optimizer state
    with track("save", interval_s=0.002) as m:
        state = training.sharded_state(ddp, optimizer, job.sharding, job.mem_efficient, is_loading=False)
        get_backend("mcore_dist").save_state(ctx, state, Path(job.ckpt))
    return {"state_bytes": training.rank_state_bytes(ddp, optimizer), "save": m.to_dict()}


def run(model: str, dps: list[int], out: Path, merge: bool = False) -> list[dict]:
    from harness.preload import warm
    from harness.zoo import get_model

    warm()
    spec = get_model(model, "gpt")
    rows = []
    for dp in dps:
        topo = Topology(dp=dp)
        topo.validate(spec)
        for sharding, mem_eff in VARIANTS:
            name = f"{sharding}{'+mem_efficient' if mem_eff else ''}"
            scratch = Path(tempfile.mkdtemp(prefix="ckpt-harness-bench-"))
            start = time.perf_counter()
            try:
                job = _Job(model, topo, sharding, mem_eff, str(scratch / "ckpt"))
                results = launch(_save, job, topo.world_size, scratch / "world", timeout_s=1800)
            except WorldError as exc:  # typically the kernel's OOM killer: that is the finding
                rows.append({"model": model, "dp": dp, "variant": name, "error": str(exc).splitlines()[0][:200]})
                print(f"dp={dp} {name:32s} FAILED: {rows[-1]['error']}", flush=True)
                continue
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            wall = time.perf_counter() - start
            r0, m = results[0], results[0]["save"]
            rows.append({
                "model": model, "dp": dp, "variant": name,
                "rank0_state_mib": round(r0["state_bytes"] / MiB, 1),
                "rank0_peak_delta_mib": round(m["peak_delta"] / MiB, 1),
                "rank0_sampled_peak_delta_mib": round((m["sampled_peak_rss"] - m["baseline_rss"]) / MiB, 1),
                "rank0_baseline_mib": round(m["baseline_rss"] / MiB, 1),
                "other_ranks_max_peak_delta_mib": round(max((r["save"]["peak_delta"] for r in results[1:]), default=0) / MiB, 1),
                # every rank's peak RSS added up: an upper bound of the job's host footprint during
                # the save (the ranks need not peak at once), what the kernel's OOM killer weighs
                "all_ranks_peak_rss_sum_mib": round(sum(r["save"]["peak_rss"] for r in results) / MiB, 1),
                "save_s": m["seconds"], "world_wall_s": round(wall, 1),
            })
            print(f"dp={dp} {name:32s} rank0 peak delta {rows[-1]['rank0_peak_delta_mib']:8.1f} MiB "
                  f"(rank0 state {rows[-1]['rank0_state_mib']} MiB) save {m['seconds']:.1f}s", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    if merge and (out / "results.json").exists():
        new = {(r["model"], r["dp"], r["variant"]) for r in rows}
        old = [r for r in json.loads((out / "results.json").read_text()) if (r["model"], r["dp"], r["variant"]) not in new]
        rows = sorted(old + rows, key=lambda r: (r["model"], r["dp"], [v[0] + ("+mem_efficient" if v[1] else "") for v in VARIANTS].index(r["variant"])))
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    _table(rows, out / "table.md")
    _plot(rows, out / "save_memory.png", model)
    return rows


def _table(rows: list[dict], path: Path) -> None:
    lines = [
        "| DP | format | rank-0 training state MiB | rank-0 peak RSS delta during save MiB | other ranks' max delta MiB | save s |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['dp']} | {r['variant']} | - | **{r['error']}** | - | - |")
            continue
        lines.append(f"| {r['dp']} | {r['variant']} | {r['rank0_state_mib']} | {r['rank0_peak_delta_mib']} | {r['other_ranks_max_peak_delta_mib']} | {r['save_s']} |")
    path.write_text("\n".join(lines) + "\n")


def _plot(rows: list[dict], path: Path, model: str) -> None:
    """Rank-0 peak delta per format vs DP. Series are dodged sideways and drawn with their own
    marker and line style, so formats with equal values (fully_reshardable with and without
    mem_efficient on rank 0) stay visible; a world the kernel killed is a red x at the top; the
    job's host total (every rank's peak RSS added up) is drawn where the run recorded it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    styles = [("o", "-"), ("s", "--"), ("^", ":")]
    top = max((r.get("all_ranks_peak_rss_sum_mib", 0) or r["rank0_peak_delta_mib"] for r in rows if "error" not in r), default=1) * 1.15
    for i, variant in enumerate(variants):
        marker, line = styles[i % len(styles)]
        dodge = (i - (len(variants) - 1) / 2) * 0.06
        pts = [(r["dp"] + dodge, r["rank0_peak_delta_mib"]) for r in rows if r["variant"] == variant and "error" not in r]
        drawn = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, linestyle=line, label=f"{variant}: rank 0")
        host = [(r["dp"] + dodge, r["all_ranks_peak_rss_sum_mib"]) for r in rows
                if r["variant"] == variant and "error" not in r and "all_ranks_peak_rss_sum_mib" in r]
        if host:
            ax.plot([p[0] for p in host], [p[1] for p in host], marker=marker, linestyle=line, alpha=0.45,
                    color=drawn[0].get_color(), label=f"{variant}: all ranks' peak RSS summed")
        for r in rows:
            if r["variant"] == variant and "error" in r:
                ax.plot([r["dp"] + dodge], [top], marker="x", color="red", markersize=10, mew=2)
                ax.annotate(f"{variant} at DP={r['dp']}: killed (host OOM)", (r["dp"] + dodge, top), textcoords="offset points",
                            xytext=(-150, -14), color="red", fontsize=8)
    state = [(r["dp"], r["rank0_state_mib"]) for r in rows if r["variant"] == variants[0] and "error" not in r]
    ax.plot([p[0] for p in state], [p[1] for p in state], linestyle="--", color="grey", label="rank-0 training state")
    ax.set_ylim(0, top * 1.08)
    ax.set_xlabel("data-parallel size")
    ax.set_xticks(sorted({r["dp"] for r in rows}))
    ax.set_ylabel("peak RSS over baseline during save (MiB)")
    ax.set_title(f"Host memory of an optimizer checkpoint save ({model}, CPU/gloo)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-150m")
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--out", type=Path, default=Path("reports/bench-memory"))
    p.add_argument("--merge", action="store_true", help="keep OUT/results.json rows of other DP sizes")
    p.add_argument("--replot", action="store_true", help="redraw OUT/table.md and OUT/save_memory.png from OUT/results.json, run nothing")
    a = p.parse_args(argv)
    if a.replot:
        rows = json.loads((a.out / "results.json").read_text())
        _table(rows, a.out / "table.md")
        _plot(rows, a.out / "save_memory.png", a.model)
        return
    run(a.model, a.dp, a.out, a.merge)


if __name__ == "__main__":
    main()
