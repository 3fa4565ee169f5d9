"""A plan as plan.json (everything) and plan.md (a readable summary with the per-strategy table)."""

from __future__ import annotations

import json
from pathlib import Path


def gib(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{int(n)} B"


def write(plan: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "plan.json", out / "plan.md"
    js.write_text(json.dumps(plan, indent=1) + "\n", encoding="utf-8")
    md.write_text(markdown(plan), encoding="utf-8")
    return md, js


def _problems(title: str, items: list[str]) -> list[str]:
    if not items:
        return [f"- {title}: none"]
    return [f"- {title}: {len(items)}", *[f"  - `{p}`" for p in items[:20]],
            *([f"  - ... {len(items) - 20} more (plan.json)"] if len(items) > 20 else [])]


def host_memory_table(save: dict, load: dict) -> list[str]:
    """Strategy x (save peak, load peak), per rank and per node: the save at the save topology, the
    load at the load topology (harness/plan/memory.py)."""
    hs, hl = save.get("host_memory"), load.get("host_memory")
    if not hs or not hl:
        return []
    n = hs["ranks_per_node"]
    where = ("the state in GPU memory: host bytes are what the save/load stages and gathers" if hs["device"] == "cuda"
             else "the state on the host: absolute = training state + the phase's peak")
    bucket = "one per buffer" if hs["bucket_numel"] is None else f"{hs['bucket_numel']:,} params"
    lines = ["## Host memory per save/load strategy", "",
             f"Predicted peaks (harness/plan/memory.py; {where}; DDP bucket {bucket}). Save at {save['topology']}, "
             f"load at {load['topology']}; a node is {n} consecutive ranks (the fullest one shown).", "",
             f"| strategy | save peak / rank | load peak / rank | save peak / node of {n} | load peak / node of {n} |"
             + (" save / rank over state | load / rank over state |" if hs["device"] == "cpu" else ""),
             "|---|---|---|---|---|" + ("---|---|" if hs["device"] == "cpu" else "")]
    for name, s in hs["strategies"].items():
        ld = hl["strategies"][name]
        lines.append(f"| {name} | {gib(s['save_peak_per_rank'])} | {gib(ld['load_peak_per_rank'])} | "
                     f"{gib(s['save_peak_per_node'])} | {gib(ld['load_peak_per_node'])} |"
                     + (f" {gib(s['save_peak_delta_per_rank'])} | {gib(ld['load_peak_delta_per_rank'])} |"
                        if hs["device"] == "cpu" else ""))
    return lines


def markdown(plan: dict) -> str:
    save, load, m = plan["save"], plan["load"], plan["model"]
    lines = [
        f"# Checkpoint plan: {m['name']} {save['topology']} -> {load['topology']} ({plan['format']})", "",
        f"**Verdict: {plan['verdict']}** (exit {plan['exit_code']})", "",
        *(["**Caveats** (what the estimates below do not model at these topologies):", "",
           *[f"- {c}" for c in plan["caveats"]], ""] if plan.get("caveats") else []),
        f"Model: {m['num_layers']} layers, hidden {m['hidden_size']}, heads {m['num_attention_heads']}/"
        f"{m['num_query_groups']}, ffn {m['ffn_hidden_size']}, vocab {m['vocab_size']}"
        + (f", {m['num_moe_experts']} experts top-{m['moe_router_topk']}" if m["num_moe_experts"] else "")
        + f", {m['dtype']}; {save['parameters']:,} parameters.", "",
        "| | save | load |", "|---|---|---|",
        f"| topology | {save['topology']} | {load['topology']} |",
        f"| world size | {save['world_size']} | {load['world_size']} |",
        f"| model-parallel coordinates built | {save['coordinates']} | {load['coordinates']} |",
        f"| checkpoint weights (main replicas) | {gib(save['checkpoint_weight_bytes'])} | {gib(load['checkpoint_weight_bytes'])} |",
        f"| optimizer state in checkpoint (estimate) | {gib(save['checkpoint_optimizer_bytes_estimate'])} | |",
        f"| max bytes written per rank (dp rank 0 writes) | {gib(save['max_written_per_rank'])} | |",
        f"| max bytes written per rank (fully-parallel save) | {gib(save['max_written_per_rank_fully_parallel'])} | |",
        f"| max weight bytes read per rank | | {gib(load['max_read_per_rank'])} |",
        f"| weight bytes read, all ranks | | {gib(load['total_read_all_ranks'])} |",
        f"| max host memory per rank: weights + optimizer (estimate) | {gib(save['max_host_bytes_per_rank'])} "
        f"| {gib(load['max_host_bytes_per_rank'])} |",
        "",
        "Host memory estimate per rank = local weight bytes + 12 B x local parameters / (dp x cp) (fp32 main "
        "param + 2 fp32 Adam moments, the distributed optimizer shards them over data parallel with context "
        "parallel; expert parameters over expert data parallel). Activations, gradients buffers and the save's staging "
        "copies are not in it.", "",
        *host_memory_table(save, load), "",
        "## Validation", "",
        *_problems(f"save plan ({save['topology']}) gaps/overlaps/disagreements", plan["save_problems"]),
        *_problems(f"load plan ({load['topology']}) gaps/overlaps/disagreements", plan["load_problems"]),
        *_problems("keys the load would miss (asked for, not saved)", plan["keys"]["missing"]),
        *_problems("keys the load does not expect (saved, not asked for)", plan["keys"]["unexpected"]),
        *_problems("keys whose global shape or dtype differ", plan["keys"]["mismatched"]),
        f"- optimizer state ({plan['format']}): {plan['optimizer'] or 'loadable at the target'}", "",
        "## Per model-parallel coordinate", "",
    ]
    for side, s in (("save", save), ("load", load)):
        lines += [f"### {side} {s['topology']}", "", "| tp | pp | ep | first rank | keys | parameters | written | read | host (est.) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        rows = s["per_coordinate"]
        shown = rows if len(rows) <= 32 else rows[:16] + rows[-16:]
        for r in shown:
            lines.append(f"| {r['tp']} | {r['pp']} | {r['ep']} | {r['rank']} | {r['keys']} | {r['params']:,} | "
                         f"{gib(r['written'])} | {gib(r['read'])} | {gib(r['host'])} |")
        if shown is not rows:
            lines.append(f"| ... | | | | | | | | {len(rows) - 32} more rows in plan.json |")
        lines.append("")
    lines.append(f"Planned in {plan['seconds']:.1f} s.")
    return "\n".join(lines) + "\n"
