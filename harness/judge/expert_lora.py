"""Judging a shared grouped-expert LoRA adapter across an expert-parallel reshard (Megatron-Bridge
#5379, docs/user-reports.md).

Megatron-Bridge's default MoE LoRA (`share_expert_adapters=True`) wraps a grouped expert linear
(`experts.linear_fc1` / `experts.linear_fc2`) with one adapter shared by the experts of an EP rank.
Its adapter checkpoint gives that 2D tensor a global expert axis: EP rank r writes it once per
expert slot it holds. Loading at another EP, a rank reads the slots it now holds, and the loaded
adapter must be their mean (#5379: "the intended expert-parallel mean instead of selecting one
rank value"). When the EP ranks of the checkpoint agree (Bridge broadcasts the init from EP rank 0
since #5396), every rule gives the same value; they disagree in a checkpoint written before that,
or after the cross-EP drift Megatron-Bridge #6009 fixed, and there only the mean is right.

A piece is one rank's shared adapter tensor; the expectation for a rank of the target is the mean,
in float64, of the source values of the expert slots it holds (at EP 1: the mean over every EP rank
of the source). Pure functions of the pieces; the worlds are cases/expert_lora_reshard.py's."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from harness.core.parity import Tolerance, max_abs_diff
from harness.core.result import Check

#: the fix's mean (FP32-or-higher accumulator, cast once) against this float64 one, cast to fp32: the
#: last bit of a mean of a few fp32 values; a kept rank's value sits ~0.1 away (truth.adapter_tensor's scale)
SHARED_MEAN_TOLERANCE = Tolerance(atol=1e-6, rtol=1e-6, why="a mean of fp32 values, accumulated in fp32 or wider")


@dataclass(frozen=True)
class SharedPiece:
    """One rank's shared grouped-expert adapter tensor."""

    name: str  # decoder.layers.<global>.mlp.experts.linear_fc{1,2}.adapter.linear_{in,out}.weight
    ep_rank: int
    ep: int
    tp_rank: int  # expert-TP rank: pieces of different expert-TP ranks are different slices
    data: torch.Tensor


def is_shared_expert_adapter(name: str) -> bool:
    """A grouped expert linear's shared adapter (not a local expert's, not a shared expert's)."""
    return ".mlp.experts.linear_fc" in name and ".adapter." in name and ".local_experts." not in name


def _slots(ep_rank: int, ep: int, num_experts: int) -> range:
    per = num_experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)


def expected(source: list[SharedPiece], ep_rank: int, ep: int, num_experts: int) -> dict[tuple[str, int], torch.Tensor]:
    """(name, expert-TP rank) -> what the target rank `ep_rank` of `ep` must hold: the mean of the
    source values of its expert slots."""
    by_slot: dict[tuple[str, int], dict[int, torch.Tensor]] = defaultdict(dict)
    for p in source:
        for slot in _slots(p.ep_rank, p.ep, num_experts):
            by_slot[(p.name, p.tp_rank)][slot] = p.data
    out = {}
    for key, slots in by_slot.items():
        values = [slots[s] for s in _slots(ep_rank, ep, num_experts) if s in slots]
        if values:
            out[key] = torch.stack([v.double() for v in values]).mean(0).to(values[0].dtype)
    return out


def _whose(got: torch.Tensor, source: list[SharedPiece], name: str, tp_rank: int) -> str:
    """Which source EP rank's value `got` is bitwise, if any ('' when none)."""
    ranks = sorted({p.ep_rank for p in source if p.name == name and p.tp_rank == tp_rank and torch.equal(p.data, got)})
    return f"; it is bitwise source EP rank {', '.join(map(str, ranks))}'s value (one rank's value kept)" if ranks else ""


def shared_expert_mean_check(source: list[SharedPiece], target: list[SharedPiece], num_experts: int,
                             tol: Tolerance = SHARED_MEAN_TOLERANCE) -> Check:
    """shared-expert-mean: every shared grouped-expert adapter tensor of every target rank equals the
    mean of the source values of its expert slots (within `tol`); fails on no pieces at all, and
    when the two sides do not hold the same adapters."""
    if not source or not target:
        return Check("shared-expert-mean", "failed", f"no shared grouped-expert adapter ({len(source)} source, "
                     f"{len(target)} target pieces): the layout has none to judge", tolerance=tol)
    names = lambda ps: {(p.name, p.tp_rank) for p in ps}  # noqa: E731
    if names(source) != names(target):
        odd = sorted(names(source) ^ names(target))[:4]
        return Check("shared-expert-mean", "failed", f"source and target hold different shared adapters, e.g. {odd}", tolerance=tol)
    bad, worst, spread = [], 0.0, 0.0
    for p in target:
        want = expected(source, p.ep_rank, p.ep, num_experts)[(p.name, p.tp_rank)]
        diff = max_abs_diff(want, p.data)
        worst = max(worst, diff)
        spread = max([spread] + [max_abs_diff(want, q.data) for q in source if (q.name, q.tp_rank) == (p.name, p.tp_rank)])
        if not torch.allclose(p.data.double(), want.double(), atol=tol.atol, rtol=tol.rtol):
            bad.append(f"{p.name} at EP rank {p.ep_rank} of {p.ep}: max |diff| {diff:.3g} from the mean of its expert slots' "
                       f"source values{_whose(p.data, source, p.name, p.tp_rank)}")
    if bad:
        return Check("shared-expert-mean", "failed", f"{len(bad)} of {len(target)}: " + "; ".join(bad[:3]), worst, tol)
    return Check("shared-expert-mean", "passed", f"{len(target)} shared adapter tensors equal the mean of their expert slots' "
                 f"source values (source EP ranks differ by up to {spread:.3g} from it)", worst, tol)
