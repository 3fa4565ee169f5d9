"""Checks read from a torch_dist checkpoint's `.metadata` alone (torch DCP's index, through the
allowlist unpickler of harness.judge.ckpt_content; no tensor data): two user reports
(docs/user-reports.md) are about what that index says, not about the values.

expert-chunks (NVIDIA/Megatron-LM #7162): every expert tensor (`*.mlp.experts.*`, model weights and
  optimizer state alike) must be described by chunks whose offsets, sizes and global shape have the
  same rank, that tile the global shape exactly once (no gap, no overlap: a shifted offset keeps the
  element count, so a count alone misses it), and that sit one per expert on the prepended global
  expert axis (size 1 there, offsets 0..E-1). #7162 found chunks with offsets over prepend + ndim
  axes and sizes over ndim only: DCP's global plan then reads the wrong region or refuses.
dp-slices (vime #139, radixark/Megatron-LM #66): in a dp_reshardable save, how many param pieces
  each DP rank's slice of each DDP bucket holds (chunks of the bucket's `.param` key per writer
  rank). The report's "Cannot merge two lists" needs those counts to differ across ranks; the check
  passes when they do (the model meets the trigger), fails when all are equal (the case would test
  nothing of the report)."""

from __future__ import annotations

import re
from bisect import bisect_left
from collections import Counter, defaultdict
from math import prod
from pathlib import Path
from typing import Any

from harness.core.parity import EXACT, NOT_COMPARED
from harness.core.result import Check

EXPERT_CHUNKS = "expert-chunks"
DP_SLICES = "dp-slices"

Chunk = tuple[tuple[int, ...], tuple[int, ...]]
#: key -> (global shape, chunks as (offsets, sizes))
Table = dict[str, tuple[tuple[int, ...], list[Chunk]]]
_BUCKET_PARAM = re.compile(r"optimizer\.distributed\.dp_group_idx_\d+\.gbuf_idx_\d+\..*\.bucket_idx_\d+\.param$")
_WRITER = re.compile(r"__(\d+)_\d+\.distcp$")


def chunk_table(md: Any) -> Table:
    """Every tensor item of a DCP Metadata: its global shape and its chunks."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {key: (tuple(item.size), [(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks])
            for key, item in md.state_dict_metadata.items() if isinstance(item, TensorStorageMetadata)}


def tiling_problems(shape: tuple[int, ...], chunks: list[Chunk]) -> list[str]:
    """Why `chunks` do not tile `shape` exactly once (empty: they do). Counted on the grid of every
    chunk boundary, so it costs the number of distinct cuts, not the tensor's size."""
    if not chunks:
        return ["no chunk at all"]
    ranks = [r for o, s in chunks if (r := (len(o), len(s))) != (len(shape), len(shape))]
    if ranks:
        return [f"{len(ranks)} chunk(s) whose offsets/sizes ranks {ranks[0]} disagree with the global rank {len(shape)}"]
    outside = [o for o, s in chunks if any(a < 0 or b <= 0 or a + b > n for a, b, n in zip(o, s, shape))]
    if outside:
        return [f"{len(outside)} chunk(s) outside the global shape {list(shape)}, e.g. at {outside[0]}"]
    cuts = [sorted({0, n, *(o[a] for o, _ in chunks), *(o[a] + s[a] for o, s in chunks)}) for a, n in enumerate(shape)]
    cover: Counter = Counter()
    for o, s in chunks:
        spans = [range(bisect_left(c, o[a]), bisect_left(c, o[a] + s[a])) for a, c in enumerate(cuts)]
        cells = [()]
        for span in spans:
            cells = [cell + (i,) for cell in cells for i in span]
        cover.update(cells)
    grid = prod(len(c) - 1 for c in cuts)
    twice = [cell for cell, n in cover.items() if n > 1]
    out = []
    if len(cover) < grid:
        out.append(f"gap: {grid - len(cover)} of {grid} boundary cells are in no chunk")
    if twice:
        start = tuple(cuts[a][i] for a, i in enumerate(twice[0]))
        out.append(f"overlap: {len(twice)} boundary cell(s) in more than one chunk, e.g. the one at {start}")
    return out


def is_expert_key(key: str) -> bool:
    """A routed expert's tensor (SequentialMLP/TEGroupedMLP), not the shared expert or the router."""
    return ".mlp.experts." in key


def expert_problems(shape: tuple[int, ...], chunks: list[Chunk], num_experts: int) -> list[str]:
    """The prepended global expert axis (the one before the 2-D weight): E long, one chunk row per expert."""
    out = tiling_problems(shape, chunks)
    if out and "ranks" in out[0]:
        return out
    axis = len(shape) - 3
    if axis < 0 or shape[axis] != num_experts:
        return out + [f"no expert axis of {num_experts} before the weight's 2 axes in global shape {list(shape)}"]
    wide = [o for o, s in chunks if s[axis] != 1]
    if wide:
        out.append(f"{len(wide)} chunk(s) span several experts on the expert axis {axis}, e.g. at {wide[0]}")
    per_expert = Counter(o[axis] for o, _ in chunks)
    rows = {e: per_expert.get(e, 0) for e in range(num_experts)}
    if len(set(rows.values())) != 1 or set(per_expert) - set(rows):
        out.append(f"chunks per expert along axis {axis}: {dict(sorted(per_expert.items()))} (expected the same count for "
                   f"each of experts 0..{num_experts - 1})")
    return out


def expert_chunks_check(table: Table, num_experts: int, where: str) -> Check:
    """expert-chunks over every expert key of `table`; no expert key at all fails (nothing was checked)."""
    keys = sorted(k for k in table if is_expert_key(k))
    if not keys:
        return Check(EXPERT_CHUNKS, "failed", f"{where}: no expert tensor (*.mlp.experts.*) in the checkpoint's metadata",
                     tolerance=NOT_COMPARED)
    bad = [(k, p) for k in keys if (p := expert_problems(*table[k], num_experts))]
    if bad:
        shown = "; ".join(f"{k}: {', '.join(p)}" for k, p in bad[:3])
        return Check(EXPERT_CHUNKS, "failed", f"{where}: {len(bad)} of {len(keys)} expert tensors mis-described: {shown}"
                     + (f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""), tolerance=EXACT)
    chunks = sum(len(table[k][1]) for k in keys)
    return Check(EXPERT_CHUNKS, "passed", f"{where}: {len(keys)} expert tensors, {chunks} chunks: each tiles its global shape "
                 f"exactly once, one chunk row per expert 0..{num_experts - 1} on the prepended expert axis", tolerance=EXACT)


def writer_counts(md: Any) -> dict[str, dict[int, int]]:
    """dp_reshardable bucket `.param` key -> {writer rank: chunks it wrote}: the length of that rank's
    bucket list (params and the paddings between them) in the distributed optimizer's param_state."""
    out: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for index, info in md.storage_data.items():
        if _BUCKET_PARAM.search(index.fqn) and (m := _WRITER.search(info.relative_path)):
            out[index.fqn][int(m.group(1))] += 1
    return {k: dict(sorted(v.items())) for k, v in sorted(out.items())}


def dp_slices_check(counts: dict[str, dict[int, int]], where: str) -> Check:
    """dp-slices: passes when some bucket's DP ranks hold different numbers of param pieces."""
    if not counts:
        return Check(DP_SLICES, "failed", f"{where}: no dp_reshardable bucket (optimizer.distributed.*.param) in the metadata",
                     tolerance=NOT_COMPARED)
    uneven = {k: v for k, v in counts.items() if len(v) > 1 and len(set(v.values())) > 1}
    shown = "; ".join(f"{k.split('optimizer.distributed.')[-1]}: {v}" for k, v in list((uneven or counts).items())[:4])
    if not uneven:
        return Check(DP_SLICES, "failed", f"{where}: every bucket's DP slices hold as many param pieces on each rank ({shown}): "
                     "the per-rank param_state lists have one length, the report's trigger is not met", tolerance=NOT_COMPARED)
    return Check(DP_SLICES, "passed", f"{where}: {len(uneven)} of {len(counts)} buckets hold a different number of param pieces "
                 f"per DP rank (writer rank: pieces): {shown}", tolerance=NOT_COMPARED)


def metadata_checks(ckpt: Path, num_experts: int | None, sharding: str) -> list[Check]:
    """The checks of the torch_dist directories under `ckpt`: expert-chunks for an MoE model,
    dp-slices for a dp_reshardable save."""
    from harness.judge.ckpt_content import load_metadata

    dirs = sorted(p.parent for p in Path(ckpt).rglob(".metadata"))
    if not dirs:
        names = [n for n, wanted in ((EXPERT_CHUNKS, num_experts), (DP_SLICES, sharding == "dp_reshardable")) if wanted]
        return [Check(n, "failed", f"no torch_dist .metadata under {ckpt}", tolerance=NOT_COMPARED) for n in names]
    out = []
    for d in dirs:
        md, where = load_metadata(d / ".metadata"), str(d.relative_to(ckpt)) if d != Path(ckpt) else "ckpt"
        if num_experts:
            out.append(expert_chunks_check(chunk_table(md), num_experts, where))
        if sharding == "dp_reshardable":
            out.append(dp_slices_check(writer_counts(md), where))
    return out
