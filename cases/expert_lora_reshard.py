"""expert-lora-reshard: Megatron-Bridge's shared grouped-expert LoRA (its default MoE LoRA,
`share_expert_adapters=True`: one adapter per grouped expert linear, shared by the experts of an EP
rank) through an adapter-only dist checkpoint saved at S and loaded at D (Megatron-Bridge #5379).

World "save" at S: the Bridge model (an HF MoE family whose Bridge maps grouped experts, e.g.
hf-olmoe; harness.models.cpu_experts builds them on CPU) with LoRA on linear_fc1/linear_fc2,
filled with the harness's seeded adapter values; with option `source_values: per-rank` each EP rank
then gives its shared adapters its own seeded values: what a checkpoint holds whose EP ranks
drifted apart (written before Megatron-Bridge #5396 broadcast the init, or under the gradient drift
#6009 fixed). The adapter-only state (harness.models.bridge.adapter_state) is saved through the
entry's backend (mcore_dist: megatron-core's dist_checkpointing, as verl saves adapters).
World "load" at D: the same model with decoy adapter values loads it through the same backend.

Checks:
  shared-expert-mean  every shared adapter tensor at D equals the mean of the source values of the
                      expert slots its EP rank holds (harness.judge.expert_lora); a failure says
                      whose value it kept instead
  adapter-params      every other adapter (a family's shared experts' and dense MLPs', a local
                      expert's), gathered over TP, is at D bitwise what it was at S; no other
                      adapter at all passes, saying so
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch

from .contract import Case
from harness.backends import BackendRef, get_backend, ref_of
from harness.core import truth
from harness.core.context import RankContext
from harness.core.result import CaseResult
from harness.core.spec import CaseSpec
from harness.core.topology import Topology
from harness.core.zoo import HFModelSpec, get_model
from harness.judge.checks import state_check
from harness.judge.expert_lora import SharedPiece, is_shared_expert_adapter, shared_expert_mean_check
from harness.models import bridge as mb
from harness.models import peft_mapping
from harness.models.hf import write_fixture
from harness.run.envelope import RunEnv

TARGETS = ("linear_fc1", "linear_fc2")  # the expert linears (a family's shared experts and dense MLPs match too)
#: seed offset of EP rank r's own values under `source_values: per-rank` (r + 1 times this)
_RANK_SEED = 1009


@dataclass(frozen=True)
class ExpertLoraOptions:
    dim: int = 4
    alpha: int = 8
    #: per-rank: each EP rank of S holds its own shared adapter values; equal: every EP rank the same
    source_values: Literal["per-rank", "equal"] = "per-rank"


@dataclass(frozen=True)
class _Phase:
    spec: HFModelSpec
    hf_dir: str
    topo: Topology
    adapter: mb.AdapterSpec
    dist_backend: BackendRef
    save_to: str | None = None
    load_from: str | None = None
    per_rank: bool = False


@dataclass
class RankOut:
    shared: list[SharedPiece]  # the shared grouped-expert adapters
    others: list[dict]  # every other adapter tensor (mb.adapter_pieces' form)


def _shared_pieces(bm: mb.BridgeModel, spec: HFModelSpec) -> list[SharedPiece]:
    """This rank's shared grouped-expert adapter tensors under their global layer names."""
    from megatron.core import parallel_state as ps

    offset = mb._layer_offset(spec)
    ep_rank, ep = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
    tp_rank = ps.get_expert_tensor_parallel_rank()
    return [SharedPiece(mb.global_name(n, offset), ep_rank, ep, tp_rank, p.detach().clone().cpu())
            for n, p in mb.unwrapped(bm).named_parameters() if is_shared_expert_adapter(n)]


@torch.no_grad()
def _per_rank_values(bm: mb.BridgeModel, spec: HFModelSpec, adapter: mb.AdapterSpec) -> int:
    """Give every shared grouped-expert adapter this EP rank's own seeded values; how many."""
    from megatron.core import parallel_state as ps

    seed, offset, n = adapter.seed + _RANK_SEED * (ps.get_expert_model_parallel_rank() + 1), mb._layer_offset(spec), 0
    for name, p in mb.unwrapped(bm).named_parameters():
        if is_shared_expert_adapter(name):
            p.copy_(truth.adapter_tensor(seed, mb.global_name(name, offset), ps.get_expert_tensor_parallel_rank(), tuple(p.shape)))
            n += 1
    return n


def _rank(ctx: RankContext, p: _Phase) -> RankOut:
    bm = mb.build(p.hf_dir, p.spec, p.topo, adapter=p.adapter)
    mb.fill_adapters(bm, p.spec, p.adapter if p.save_to else replace(p.adapter, seed=p.adapter.seed + 1))  # load side: decoys
    if p.per_rank:
        _per_rank_values(bm, p.spec, p.adapter)
    dist = get_backend(p.dist_backend)
    if p.load_from:
        state = dist.load_state(ctx, mb.adapter_state(bm), Path(p.load_from))
        mb.unwrapped(bm).load_state_dict(state["model"], strict=False)
    out = RankOut(_shared_pieces(bm, p.spec), [q for q in mb.adapter_pieces(bm, p.spec) if not is_shared_expert_adapter(q["name"])])
    if p.save_to:
        dist.save_state(ctx, mb.adapter_state(bm), Path(p.save_to))
    return out


class ExpertLoraReshard(Case):
    name = "expert-lora-reshard"
    description = "Megatron-Bridge shared grouped-expert LoRA across an EP reshard of its adapter checkpoint: the EP mean, not one rank's value"
    model_kind = "hf"
    Options = ExpertLoraOptions
    needs = frozenset({"weights"})  # the backend saves and loads the adapter-only dist checkpoint
    checks = ("shared-expert-mean", "adapter-params")

    def validate_options(self, spec: CaseSpec, opts: ExpertLoraOptions) -> None:
        model = get_model(spec.model, "hf")
        if not getattr(model, "num_experts", None):
            raise ValueError(f"case {self.name} needs an MoE model, got {spec.model!r}")

    def run(self, spec: CaseSpec, opts: ExpertLoraOptions, env: RunEnv, result: CaseResult) -> None:
        model = get_model(spec.model, "hf")
        adapter = mb.AdapterSpec("lora", opts.dim, opts.alpha, TARGETS)
        d = env.case_dir
        hf_dir = write_fixture(model, d / "fixture")
        phase = _Phase(model, str(hf_dir), spec.source, adapter, ref_of(spec))
        first = env.launch("save", _rank, replace(phase, save_to=str(d / "adapter-dist-ckpt"), per_rank=opts.source_values == "per-rank"),
                           spec.source)
        again = env.launch("load", _rank, replace(phase, topo=spec.target, load_from=str(d / "adapter-dist-ckpt")), spec.target)
        with env.timed("compare"):
            result.checks.append(shared_expert_mean_check([p for o in first for p in o.shared], [p for o in again for p in o.shared],
                                                          int(model.num_experts)))
            result.checks.append(state_check(
                "adapter-params", peft_mapping.gather([q for o in first for q in o.others], model.gated),
                peft_mapping.gather([q for o in again for q in o.others], model.gated), spec.source.id, spec.target.id,
                "the other adapters at D equal those at S", empty_ok="no adapter besides the shared grouped-expert ones"))


CASE = ExpertLoraReshard()
