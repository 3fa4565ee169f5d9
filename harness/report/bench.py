"""The throughput benchmark's report (harness.orchestration.bench): one Markdown table, each figure
with its ratio to torch DCP at the same model and world size, and one PNG plot of the figures
against the number of ranks. Pure: reads the benchmark's rows, writes nothing but its files."""

from __future__ import annotations

from pathlib import Path

#: (row key, column title, format): times, bytes and GB/s medians over the repeats, memory the largest repeat's
FIELDS: tuple[tuple[str, str, str], ...] = (
    ("save_block_s", "save blocking s", "{:.3f}"),
    ("save_total_s", "save total s", "{:.3f}"),
    ("load_s", "load s", "{:.3f}"),
    ("mb_written", "MB written", "{:.2f}"),
    ("save_gbps", "save GB/s", "{:.3f}"),
    ("load_gbps", "load GB/s", "{:.3f}"),
    ("save_peak_delta_mib", "save peak RSS +MiB", "{:.1f}"),
    ("load_peak_delta_mib", "load peak RSS +MiB", "{:.1f}"),
    ("save_peak_rss_mib", "save peak RSS MiB", "{:.1f}"),
)
PLOTTED = ("save_block_s", "save_total_s", "load_s", "save_peak_delta_mib")
REFERENCE = "dcp"


def cell(row: dict, key: str, fmt: str) -> str:
    """`value (ratio x)`; the DCP row's own figures carry no ratio, a figure DCP measured as 0 none either."""
    value = row["median"][key]
    ratio = row.get("ratio", {}).get(key)
    text = fmt.format(value)
    if row["strategy"] == REFERENCE or ratio is None:
        return text
    return f"{text} ({ratio:.2f}x)"


def markdown(doc: dict) -> str:
    """The table of every row of `doc` (what harness.orchestration.bench.run_bench returns), led by
    the machine it ran on; a skipped or failed strategy is a row saying why."""
    m = doc["machine"]
    lines = [
        f"Throughput benchmark: times, bytes and GB/s the median of {doc['repeats']} repeat(s); (N x) = ratio to "
        "torch DCP (`torch.distributed.checkpoint.save/load` of the same model) at the same model and ranks, "
        "none where DCP's figure is too small to divide by. Peak RSS is the largest rank's in the largest repeat "
        "(the job's first save or load); +MiB is over the rank's RSS when the phase began.",
        "",
        f"Machine: {m['cpus']} CPUs, {m['host_gib']} GiB, torch {m['torch']}, megatron-core {m['megatron_core']}, "
        f"dist backend {m['dist_backend']}; load average {m['load_before']} before, {m['load_after']} after.",
        "",
        "| model | ranks | strategy | " + " | ".join(title for _, title, _ in FIELDS) + " |",
        "|---|---:|---|" + "---:|" * len(FIELDS),
    ]
    for r in doc["rows"]:
        head = f"| {r['model']} | {r['world']} | {r['strategy']} |"
        if r.get("skipped") or r.get("error"):
            why = (f"skipped: {r['skipped']}" if r.get("skipped") else f"**error: {r['error']}**").replace("|", "\\|")
            lines.append(f"{head} {why} |" + " |" * (len(FIELDS) - 1))
            continue
        lines.append(f"{head} " + " | ".join(cell(r, k, f) for k, _, f in FIELDS) + " |")
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> None:
    """One panel per (figure, model): the figure against ranks, a line per strategy (DCP dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in doc["rows"] if "median" in r]
    models = list(dict.fromkeys(r["model"] for r in doc["rows"]))
    titles = {k: t for k, t, _ in FIELDS}
    fig, axes = plt.subplots(len(PLOTTED), len(models), figsize=(4.2 * len(models), 2.6 * len(PLOTTED)), squeeze=False)
    strategies = list(dict.fromkeys(r["strategy"] for r in doc["rows"]))
    for col, model in enumerate(models):
        for row_i, key in enumerate(PLOTTED):
            ax = axes[row_i][col]
            for s in strategies:
                pts = sorted((r["world"], r["median"][key]) for r in rows if r["model"] == model and r["strategy"] == s)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s,
                            linestyle="--" if s == REFERENCE else "-", color="black" if s == REFERENCE else None)
            ax.set_title(f"{model}: {titles[key]}", fontsize=9)
            ax.set_xticks(sorted({r["world"] for r in doc["rows"]}))
            ax.set_xlabel("ranks", fontsize=8)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"checkpoint throughput (times: median of {doc['repeats']}), {doc['machine']['cpus']} CPUs, {doc['machine']['dist_backend']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
