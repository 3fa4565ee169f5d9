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

from harness.core.context import RankContext
from harness.core.memory import MiB, track
from harness.core.topology import Topology
from harness.run.world import WorldError, launch

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
    from harness.backends import get_backend
    from harness.core.zoo import get_model
    from harness.models import training
    from harness.models.parallel import init_parallel

    spec = get_model(job.model, "gpt")
    init_parallel(job.topo)
    ddp, optimizer = training.build_training(spec, job.topo, training.TrainConfig())
    training.train_steps(ddp, optimizer, spec, 0, 1)  # real, non-zero optimizer state
    with track("save", interval_s=0.002) as m:
        state = training.sharded_state(ddp, optimizer, job.sharding, job.mem_efficient, is_loading=False)
        get_backend("mcore_dist").save_state(ctx, state, Path(job.ckpt))
    return {"state_bytes": training.rank_state_bytes(ddp, optimizer), "save": m.to_dict()}


def run(model: str, dps: list[int], out: Path, merge: bool = False) -> list[dict]:
    from harness.core.zoo import get_model
    from harness.run.preload import warm

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
                # host-wide memory in use (total - available, every process) as rank 0 sampled it
                # during the save, and the host's total: what the OOM killer actually runs out of
                "host_used_peak_mib": round(m["host_used_peak"] / MiB, 1),
                "host_used_baseline_mib": round(m["host_used_baseline"] / MiB, 1),
                "host_total_mib": round(m["host_total"] / MiB, 1),
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


NO_HOST = ("host-wide memory in use was not recorded by this run (its results.json predates the field); "
           "the next `python -m benchmarks.save_memory` run records it")


def _has_host(rows: list[dict]) -> bool:
    return any("host_used_peak_mib" in r for r in rows)


def _table(rows: list[dict], path: Path) -> None:
    lines = [
        "| DP | format | rank-0 training state MiB | rank-0 peak RSS delta during save MiB | other ranks' max delta MiB "
        "| host-wide in use at peak MiB (of total) | save s |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['dp']} | {r['variant']} | - | **{r['error']}** | - | - | - |")
            continue
        host = f"{r['host_used_peak_mib']} (of {r['host_total_mib']})" if "host_used_peak_mib" in r else "-"
        lines.append(f"| {r['dp']} | {r['variant']} | {r['rank0_state_mib']} | {r['rank0_peak_delta_mib']} | "
                     f"{r['other_ranks_max_peak_delta_mib']} | {host} | {r['save_s']} |")
    if not _has_host(rows):
        lines.append(f"\n{NO_HOST}.")
    path.write_text("\n".join(lines) + "\n")


def _plot(rows: list[dict], path: Path, model: str) -> None:
    """Left: rank 0's peak RSS delta per format vs DP; series dodged sideways with their own marker
    (hollow vs filled) and line style, so formats with equal values (fully_reshardable with and
    without mem_efficient on rank 0) stay visible; a world the kernel killed is a red X at the top
    of the axis, joined to its series by a dotted line and labelled. Right: host-wide memory in use
    at the save's peak against the host's total (the OOM line), where the run recorded it; a killed
    world is an X on that line; an older results.json says it has no host numbers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, hx) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1.25, 1]})
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    styles = [("o", "-", "full"), ("s", "--", "none"), ("^", ":", "full")]
    ok = [r for r in rows if "error" not in r]
    top = max((r["rank0_peak_delta_mib"] for r in ok), default=1) * 1.18
    host_total = max((r["host_total_mib"] for r in ok if "host_total_mib" in r), default=None)
    for i, variant in enumerate(variants):
        marker, line, fill = styles[i % len(styles)]
        dodge = (i - (len(variants) - 1) / 2) * 0.08
        mine = [r for r in rows if r["variant"] == variant]
        pts = [(r["dp"] + dodge, r["rank0_peak_delta_mib"]) for r in mine if "error" not in r]
        drawn = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, linestyle=line, fillstyle=fill,
                        markersize=8, mew=1.6, label=f"{variant}")
        color = drawn[0].get_color()
        host = [(r["dp"] + dodge, r["host_used_peak_mib"]) for r in mine if "host_used_peak_mib" in r]
        if host:
            hx.plot([p[0] for p in host], [p[1] for p in host], marker=marker, linestyle=line, fillstyle=fill,
                    markersize=8, mew=1.6, color=color, label=variant)
            for r in mine:  # from the host's use when the save began (other jobs included) to its peak
                if "host_used_baseline_mib" in r:
                    hx.vlines(r["dp"] + dodge, r["host_used_baseline_mib"], r["host_used_peak_mib"], color=color, lw=3, alpha=0.35)
        for r in mine:
            if "error" not in r:
                continue
            x = r["dp"] + dodge
            if pts:
                ax.plot([pts[-1][0], x], [pts[-1][1], top], linestyle=":", color=color, alpha=0.7)
            ax.plot([x], [top], marker="X", color="red", markersize=12, mew=1, linestyle="none",
                    label=f"{variant} DP={r['dp']}: killed (SIGKILL)")
            ax.annotate(f"{variant} DP={r['dp']}: killed (SIGKILL, host OOM): no sample survived, drawn at the top", (x, top),
                        textcoords="offset points", xytext=(-12, 9), ha="right", va="bottom", color="red", fontsize=8)
            if host_total is not None:
                hx.plot([x], [host_total], marker="X", color="red", markersize=12, linestyle="none")
    state = [(r["dp"], r["rank0_state_mib"]) for r in ok if r["variant"] == variants[0]]
    ax.plot([p[0] for p in state], [p[1] for p in state], linestyle="--", color="grey", label="rank-0 training state")
    ax.set_ylim(0, top * 1.12)
    dps = sorted({r["dp"] for r in rows})
    for a in (ax, hx):
        a.set_xticks(dps)
        a.set_xlabel("data-parallel size")
        a.grid(alpha=0.3)
    ax.set_ylabel("rank 0: peak RSS over its baseline during save (MiB)")
    ax.set_title(f"Rank-0 host memory of an optimizer checkpoint save\n({model}, CPU/gloo)", fontsize=10)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(0.0, 0.42))
    hx.set_title("Host-wide memory in use at the save's peak (total - available, every\nprocess; the bar starts at the host's use when the save began)", fontsize=10)
    hx.set_ylabel("MiB")
    if host_total is not None:
        hx.axhline(host_total, color="red", linestyle="--", lw=1)
        hx.annotate(f"host total {host_total:.0f} MiB: the OOM killer's limit", (dps[0], host_total), textcoords="offset points",
                    xytext=(0, 4), color="red", fontsize=8)
        hx.set_ylim(0, host_total * 1.1)
        hx.legend(fontsize=8, loc="lower right")
    else:
        hx.set_yticks([])
        hx.text(0.5, 0.5, "\n".join(_wrap(NO_HOST, 46)), transform=hx.transAxes, ha="center", va="center", fontsize=9, color="#57606a")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width)


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
