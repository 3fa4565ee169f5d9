"""hf-roundtrip: HF checkpoint -> Megatron (AutoBridge) at S -> HF export, through Megatron-Bridge.

S == D: export at S (`save_hf_pretrained`). S != D: verl's real path: save a megatron-core
dist checkpoint at S, reload it at D into a model built without HF weights, export at D.

Checks:
  export-bitwise   the exported safetensors equal the source: same keys, dtypes, bytes
  hf-logits        transformers computes bitwise the same logits from the export as from the source
  megatron-logits  the Megatron model's logits equal transformers' within MEGATRON_HF_TOLERANCE
  propagation      the DDP knobs asked of provider.provide_distributed_model reach the built
                   DDP module's ddp_config (verl PR #5775)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cases.reshard_weights import state_check
from harness import bridge as mb
from harness.backends import get_backend
from harness.case import Case, RunEnv, timed
from harness.hf_models import HFModelSpec, fixed_input_ids, get_hf_model, hf_logits, write_fixture
from harness.matrix import CaseSpec
from harness.parity import Tolerance, compare_state, compare_tensors, max_abs_diff
from harness.result import CaseResult, Check
from harness.topology import Topology
from harness.world import RankContext

# Megatron's and transformers' fp32 kernels differ (fused QKV, vocab-parallel logits, RoPE in a
# different order); measured max |diff| on the fixtures ~2e-7 (notes: ~1e-7).
MEGATRON_HF_TOLERANCE = Tolerance(atol=1e-5, rtol=1e-5, why="Megatron vs transformers fp32 kernels")
DDP_KNOBS = ("use_distributed_optimizer", "overlap_grad_reduce", "grad_reduce_in_fp32")


@dataclass(frozen=True)
class _Phase:
    spec: HFModelSpec
    hf_dir: str
    topo: Topology
    load_weights: bool
    ddp: tuple[tuple[str, Any], ...]
    dist_load: str | None = None
    dist_save: str | None = None
    export_to: str | None = None


def _rank(ctx: RankContext, p: _Phase) -> dict[str, Any]:
    from megatron.core.distributed import DistributedDataParallelConfig

    from harness import compat, models

    models.init_parallel(p.topo)
    bm = mb.build(p.hf_dir, p.spec, p.topo, load_weights=p.load_weights, ddp_config=DistributedDataParallelConfig(**dict(p.ddp)))
    dist_backend = get_backend("mcore_dist")
    if p.dist_load:
        dist_backend.load(ctx, mb.unwrapped(bm), Path(p.dist_load))
    out = {"propagation": mb.ddp_propagation(bm, dict(p.ddp)), "logits": mb.megatron_logits(bm, p.spec, ctx.device)}
    if p.dist_save:
        dist_backend.save(ctx, mb.unwrapped(bm), Path(p.dist_save))
    if p.export_to:
        get_backend("bridge_hf").save(ctx, bm, Path(p.export_to))
    out["compat"] = compat.installed()
    return out


def propagation_check(outs: list[dict]) -> Check:
    bad = [f"rank {r}: {x['knob']} asked {x['asked']!r}, built {x['actual']!r}" for r, o in enumerate(outs) for x in o["propagation"] if not x["ok"]]
    if bad:
        return Check("propagation", "failed", "; ".join(bad[:6]), tolerance="exact")
    return Check("propagation", "passed", f"{', '.join(DDP_KNOBS)} reach the provider-built DDP", tolerance="exact")


def logits_of(outs: list[dict]):
    return next((o["logits"] for o in outs if o.get("logits") is not None), None)


class HFRoundtrip(Case):
    name = "hf-roundtrip"
    description = "HF -> Megatron at S (-> dist ckpt -> D) -> HF export equals the source bitwise"
    model_kind = "hf"

    def validate(self, spec: CaseSpec) -> None:
        self.check_model_kind(spec)
        unknown = set(spec.opts) - set(DDP_KNOBS)
        if unknown:
            raise ValueError(f"case {self.name}: unknown option(s) {sorted(unknown)}; DDP knobs: {DDP_KNOBS}")
        if spec.backend != "bridge_hf":
            raise ValueError(f"case {self.name} exports through bridge_hf, got backend {spec.backend}")

    def run(self, spec: CaseSpec, env: RunEnv, result: CaseResult) -> None:
        model = get_hf_model(spec.model)
        src, dst = spec.source, spec.target
        ddp = tuple(sorted({"use_distributed_optimizer": False, "overlap_grad_reduce": False, "grad_reduce_in_fp32": False, **spec.opts}.items()))
        hf_dir, export = env.case_dir / "hf-source", env.case_dir / "hf-export"
        with timed(result, "fixture"):
            write_fixture(model, hf_dir)
        if src == dst:
            outs = env.launch(result, "export", _rank, _Phase(model, str(hf_dir), src, True, ddp, export_to=str(export)), src.world_size)
            first = outs
        else:
            ckpt = env.case_dir / "dist-ckpt"
            first = env.launch(result, "save", _rank, _Phase(model, str(hf_dir), src, True, ddp, dist_save=str(ckpt)), src.world_size)
            outs = env.launch(
                result, "load", _rank, _Phase(model, str(hf_dir), dst, False, ddp, dist_load=str(ckpt), export_to=str(export)), dst.world_size
            )
        result.compat_shims = first[0]["compat"]
        with timed(result, "compare"):
            backend = get_backend("bridge_hf")
            source, exported = backend.read_full(None, hf_dir), backend.read_full(None, export)
            mism = compare_state(source, exported, "hf-source", f"export@{dst.id}")
            result.checks.append(state_check("export-bitwise", mism, f"{len(exported)} tensors, keys and dtypes equal the source"))
            ids = fixed_input_ids(model)
            ref = hf_logits(hf_dir, ids)
            got = hf_logits(export, ids)
            m = compare_tensors("logits", ref, got, "transformers(source)", f"transformers(export@{dst.id})")
            result.checks.append(Check("hf-logits", "failed" if m else "passed", str(m) if m else "transformers logits equal", max_abs_diff(ref, got), "bitwise", [m] if m else []))
            for label, o in ((src.id, first), (dst.id, outs)) if src != dst else ((src.id, first),):
                meg = logits_of(o)
                m = compare_tensors("logits", ref, meg, "transformers(source)", f"megatron@{label}", MEGATRON_HF_TOLERANCE)
                result.checks.append(
                    Check(f"megatron-logits@{label}", "failed" if m else "passed", str(m) if m else "Megatron logits match transformers",
                          max_abs_diff(ref, meg), str(MEGATRON_HF_TOLERANCE), [m] if m else [])
                )
            result.checks.append(propagation_check(first + (outs if src != dst else [])))


CASE = HFRoundtrip()
