"""hf-roundtrip: HF checkpoint -> Megatron (AutoBridge) at S -> HF export, through Megatron-Bridge.

S == D: export at S (the backend's `save`, `save_hf_pretrained` for bridge_hf). S != D: verl's real
path: save a megatron-core dist checkpoint at S, reload it at D into a model built without HF
weights, export at D.

Checks:
  export-bitwise   the exported safetensors equal the source: same keys, dtypes, bytes
  hf-logits        transformers computes bitwise the same logits from the export as from the source
  megatron-logits  (@topology) the Megatron model's logits equal transformers' within MEGATRON_HF_TOLERANCE
  propagation      the DDP knobs asked of provider.provide_distributed_model reach the built
                   DDP module's ddp_config (verl PR #5775)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from harness import bridge as mb
from harness import truth
from harness.backends import BackendRef, get_backend, resolve
from harness.case import Case, RunEnv, timed
from harness.checks import knob_check, state_check, tensor_check
from harness.hf_models import hf_logits, write_fixture
from harness.parity import Tolerance
from harness.result import CaseResult, Check
from harness.spec import CaseSpec
from harness.topology import Topology
from harness.world import RankContext
from harness.zoo import HFModelSpec, get_model

# Megatron's and transformers' fp32 kernels differ (fused QKV, vocab-parallel logits, RoPE in a
# different order); measured max |diff| on the fixtures ~2e-7 (notes: ~1e-7).
MEGATRON_HF_TOLERANCE = Tolerance(atol=1e-5, rtol=1e-5, why="Megatron vs transformers fp32 kernels")


@dataclass(frozen=True)
class DdpKnobs:
    """What is asked of the provider's DDP wrapper (each must reach the built ddp_config)."""

    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    grad_reduce_in_fp32: bool = False


@dataclass(frozen=True)
class _Phase:
    spec: HFModelSpec
    hf_dir: str
    topo: Topology
    load_weights: bool
    ddp: DdpKnobs
    export_backend: BackendRef  # import path + options
    dist_backend: BackendRef  # import path + options of the dist checkpoint for the S -> D hop
    dist_load: str | None = None
    dist_save: str | None = None
    export_to: str | None = None


@dataclass
class BridgeOut:
    propagation: list[dict[str, Any]]
    logits: torch.Tensor | None


def _rank(ctx: RankContext, p: _Phase) -> BridgeOut:
    from megatron.core.distributed import DistributedDataParallelConfig

    knobs = asdict(p.ddp)
    bm = mb.build(p.hf_dir, p.spec, p.topo, load_weights=p.load_weights, ddp_config=DistributedDataParallelConfig(**knobs))
    dist = get_backend(p.dist_backend)
    if p.dist_load:
        dist.load(ctx, mb.unwrapped(bm), Path(p.dist_load))
    out = BridgeOut(mb.ddp_propagation(bm, knobs), mb.megatron_logits(bm, p.spec, ctx.device))
    if p.dist_save:
        dist.save(ctx, mb.unwrapped(bm), Path(p.dist_save))
    if p.export_to:
        get_backend(p.export_backend).save(ctx, bm, Path(p.export_to))
    return out


def judge(
    src: Topology, dst: Topology, worlds: list[tuple[str, list[BridgeOut]]], source: dict[str, torch.Tensor],
    exported: dict[str, torch.Tensor], ref_logits: torch.Tensor, export_logits: torch.Tensor,
) -> list[Check]:
    """`worlds`: (topology id, outputs) of each world that built the model (one when S == D)."""
    checks = [
        state_check("export-bitwise", source, exported, "hf-source", f"export@{dst.id}",
                    f"{len(exported)} tensors, keys and dtypes equal the source"),
        tensor_check("hf-logits", ref_logits, export_logits, "transformers(source)", f"transformers(export@{dst.id})",
                     "transformers logits equal"),
    ]
    for label, outs in worlds:
        meg = next((o.logits for o in outs if o.logits is not None), None)
        if meg is None:
            checks.append(Check(f"megatron-logits@{label}", "failed", "no rank returned logits"))
            continue
        checks.append(tensor_check(f"megatron-logits@{label}", ref_logits, meg, "transformers(source)", f"megatron@{label}",
                                   "Megatron logits match transformers", MEGATRON_HF_TOLERANCE))
    checks.append(knob_check("propagation", [(label, [o.propagation for o in outs]) for label, outs in worlds],
                             f"{', '.join(DdpKnobs.__dataclass_fields__)} reach the provider-built DDP"))
    return checks


class HFRoundtrip(Case):
    name = "hf-roundtrip"
    description = "HF -> Megatron at S (-> dist ckpt -> D) -> HF export equals the source bitwise"
    model_kind = "hf"
    Options = DdpKnobs
    needs = frozenset({"hf_export", "read_plain"})
    checks = ("export-bitwise", "hf-logits", "megatron-logits", "propagation")

    def run(self, spec: CaseSpec, opts: DdpKnobs, env: RunEnv, result: CaseResult) -> None:
        run_roundtrip(get_model(spec.model, "hf"), spec.source, spec.target, spec.backend_ref, opts, env, result)


def run_roundtrip(model: HFModelSpec, src: Topology, dst: Topology, export_backend: BackendRef, opts: DdpKnobs, env: RunEnv,
                  result: CaseResult) -> None:
    """The fixture, the worlds (export at S, or save at S -> load at D -> export) and the judge, for
    any HFModelSpec: the matrix case and harness.explore (which draws shapes outside the zoo) run this."""
    hf_dir, export = env.case_dir / "hf-source", env.case_dir / "hf-export"
    paths = dict(export_backend=export_backend, dist_backend=resolve("mcore_dist"))
    with timed(result, "fixture"):
        write_fixture(model, hf_dir)
    if src == dst:
        outs = env.launch(result, "export", _rank, _Phase(model, str(hf_dir), src, True, opts, export_to=str(export), **paths), src)
        worlds = [(src.id, outs)]
    else:
        ckpt = env.case_dir / "dist-ckpt"
        first = env.launch(result, "save", _rank, _Phase(model, str(hf_dir), src, True, opts, dist_save=str(ckpt), **paths), src)
        outs = env.launch(result, "load", _rank, _Phase(
            model, str(hf_dir), dst, False, opts, dist_load=str(ckpt), export_to=str(export), **paths), dst)
        worlds = [(src.id, first), (dst.id, outs)]
    with timed(result, "compare"):
        backend = get_backend(export_backend)
        ids = truth.fixed_input_ids(model)
        result.checks.extend(judge(src, dst, worlds, backend.read_full(None, hf_dir), backend.read_full(None, export),
                                   hf_logits(hf_dir, ids), hf_logits(export, ids)))


CASE = HFRoundtrip()
