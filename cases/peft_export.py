"""peft-export: LoRA / CanonicalLoRA on a Bridge model, exported as an HF PEFT adapter.

S == D: export at S. S != D: the adapter-only dist checkpoint (filtered with the Bridge's
apply_peft_adapter_filter_to_state_dict, as verl saves it) goes from S to D, and the adapter
exported at D must equal the one exported directly at S.

Checks:
  peft-load          PeftModel.from_pretrained loads the adapter into the HF base without a
                     missing-key warning; load_adapter reports no missing or unexpected keys
  adapter-derivation every exported tensor equals the harness's own derivation from the Megatron
                     adapter parameters (TP gather, QKV split per query group, fc1 gate/up halves)
  adapter-config     r, lora_alpha, target_modules and base_model_name_or_path are what was asked
  merge              the Bridge's merged export equals peft's merge_and_unload() weights
  logits             Megatron+LoRA logits equal transformers+PEFT logits (PEFT_TOLERANCE) and
                     differ from the base model's (the adapter is not a no-op)
  resharded-export   (S != D) the adapter exported at D equals the direct export at S, bitwise
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from cases.reshard_weights import state_check
from harness import bridge as mb
from harness import peft_mapping
from harness.backends import get_backend
from harness.case import Case, RunEnv, timed
from harness.hf_models import HFModelSpec, fixed_input_ids, get_hf_model, hf_logits, read_safetensors, write_fixture
from harness.matrix import CaseSpec
from harness.parity import Tolerance, compare_state, compare_tensors, max_abs_diff
from harness.result import CaseResult, Check
from harness.topology import Topology
from harness.world import RankContext

PEFT_TOLERANCE = Tolerance(atol=1e-5, rtol=1e-5, why="Megatron+LoRA vs transformers+PEFT fp32 kernels")
MIN_ADAPTER_EFFECT = 1e-3  # max |logits(lora) - logits(base)| below this means the adapter did nothing
ADAPTERS = {"lora": mb.LORA_TARGETS, "canonical_lora": mb.CANONICAL_TARGETS}  # kind -> Megatron targets
# Both kinds export the same HF PEFT target modules.
HF_TARGET_MODULES = sorted({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


@dataclass(frozen=True)
class _Phase:
    spec: HFModelSpec
    hf_dir: str
    topo: Topology
    adapter: mb.AdapterSpec
    fill: bool
    adapter_load: str | None = None
    adapter_save: str | None = None
    export_to: str | None = None
    merged_to: str | None = None


def _rank(ctx: RankContext, p: _Phase) -> dict[str, Any]:
    from harness import compat, models

    models.init_parallel(p.topo)
    bm = mb.build(p.hf_dir, p.spec, p.topo, adapter=p.adapter)
    peft_backend = get_backend("bridge_peft")
    if p.fill:
        mb.fill_adapters(bm, p.spec, p.adapter)
    else:  # decoy adapter weights: the load below must replace every one of them
        mb.fill_adapters(bm, p.spec, replace(p.adapter, seed=p.adapter.seed + 1))
    if p.adapter_load:
        state = peft_backend.load_state(ctx, peft_backend.adapter_state(bm), Path(p.adapter_load))
        mb.unwrapped(bm).load_state_dict(state["model"], strict=False)
    out = {"pieces": mb.adapter_pieces(bm, p.spec), "logits": mb.megatron_logits(bm, p.spec, ctx.device)}
    if p.adapter_save:
        peft_backend.save_state(ctx, peft_backend.adapter_state(bm), Path(p.adapter_save))
    if p.export_to:
        peft_backend.save(ctx, bm, Path(p.export_to))
    if p.merged_to:
        get_backend("bridge_hf").save(ctx, bm, Path(p.merged_to))  # save_hf_pretrained merges adapters
    out["compat"] = compat.installed()
    return out


def _peft_load_problems(base_dir: Path, adapter_dir: Path) -> list[str]:
    """Load as users do (PeftModel.from_pretrained, which only warns about missing keys and says
    nothing of unexpected ones), then load the same files again through load_adapter, whose
    result lists both."""
    import warnings

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, adapter_dir)
    problems = [f"from_pretrained warned: {w.message}" for w in caught if "adapter keys" in str(w.message)]
    result = model.load_adapter(adapter_dir, adapter_name="recheck")
    problems += [f"missing: {k}" for k in result.missing_keys]
    problems += [f"unexpected: {k}" for k in result.unexpected_keys]
    return problems


def _peft_merged(base_dir: Path, adapter_dir: Path) -> dict[str, torch.Tensor]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32), adapter_dir)
    merged = model.merge_and_unload()
    return {k: v.detach().clone() for k, v in merged.state_dict().items()}


class PeftExport(Case):
    name = "peft-export"
    description = "Megatron-Bridge LoRA/CanonicalLoRA -> HF PEFT adapter, checked against peft and an independent derivation"
    model_kind = "hf"

    def validate(self, spec: CaseSpec) -> None:
        self.check_model_kind(spec)
        unknown = set(spec.opts) - {"adapter", "dim", "alpha"}
        if unknown:
            raise ValueError(f"case {self.name}: unknown option(s) {sorted(unknown)}; known: adapter, dim, alpha")
        if spec.opts.get("adapter", "lora") not in ADAPTERS:
            raise ValueError(f"adapter must be one of {sorted(ADAPTERS)}")
        if spec.backend != "bridge_peft":
            raise ValueError(f"case {self.name} exports through bridge_peft, got backend {spec.backend}")

    def run(self, spec: CaseSpec, env: RunEnv, result: CaseResult) -> None:
        model = get_hf_model(spec.model)
        kind = spec.opts.get("adapter", "lora")
        adapter = mb.AdapterSpec(kind, int(spec.opts.get("dim", 4)), int(spec.opts.get("alpha", 8)), ADAPTERS[kind])
        src, dst = spec.source, spec.target
        hf_dir = env.case_dir / "hf-base"
        direct, merged = env.case_dir / "adapter@source", env.case_dir / "merged@source"
        with timed(result, "fixture"):
            write_fixture(model, hf_dir)
        resharded = src != dst
        ckpt = env.case_dir / "adapter-dist-ckpt"
        first = env.launch(
            result, "save", _rank,
            _Phase(model, str(hf_dir), src, adapter, True, adapter_save=str(ckpt) if resharded else None,
                   export_to=str(direct), merged_to=str(merged)),
            src.world_size,
        )
        result.compat_shims = first[0]["compat"]
        if resharded:
            again = env.launch(
                result, "load", _rank,
                _Phase(model, str(hf_dir), dst, adapter, False, adapter_load=str(ckpt), export_to=str(env.case_dir / "adapter@target")),
                dst.world_size,
            )
        with timed(result, "compare"):
            self._checks(result, model, adapter, hf_dir, direct, merged, first, src)
            if resharded:
                a, b = read_safetensors(direct), read_safetensors(env.case_dir / "adapter@target")
                mism = compare_state(a, b, f"adapter-export@{src.id}", f"adapter-export@{dst.id}")
                result.checks.append(
                    state_check("resharded-export", mism, f"{len(b)} adapter tensors exported at {dst.id} equal the export at {src.id}")
                )
                mism = compare_state(peft_mapping.gather([p for o in first for p in o["pieces"]]),
                                     peft_mapping.gather([p for o in again for p in o["pieces"]]), src.id, dst.id)
                result.checks.append(state_check("adapter-params", mism, "Megatron adapter parameters at D equal those at S"))

    def _checks(self, result, model, adapter, hf_dir: Path, direct: Path, merged: Path, outs, src) -> None:
        problems = _peft_load_problems(hf_dir, direct)
        result.checks.append(
            Check("peft-load", "failed" if problems else "passed", "; ".join(problems[:8]) or "no missing or unexpected keys", tolerance="exact")
        )
        exported = read_safetensors(direct)
        derived = peft_mapping.to_hf_peft(peft_mapping.gather([p for o in outs for p in o["pieces"]]), model)
        mism = compare_state(derived, exported, "harness-derivation", f"bridge-export@{src.id}")
        result.checks.append(state_check("adapter-derivation", mism, f"{len(exported)} adapter tensors equal the independent derivation"))
        cfg = json.loads((direct / "adapter_config.json").read_text())
        asked = {"r": adapter.dim, "lora_alpha": adapter.alpha, "target_modules": HF_TARGET_MODULES, "base_model_name_or_path": str(hf_dir)}
        got = {"r": cfg.get("r"), "lora_alpha": cfg.get("lora_alpha"), "target_modules": sorted(cfg.get("target_modules") or []),
               "base_model_name_or_path": cfg.get("base_model_name_or_path")}
        bad = [f"{k}: asked {asked[k]!r}, exported {got[k]!r}" for k in asked if asked[k] != got[k]]
        result.checks.append(Check("adapter-config", "failed" if bad else "passed", "; ".join(bad) or f"r={got['r']} lora_alpha={got['lora_alpha']}", tolerance="exact"))
        peft_merged = _peft_merged(hf_dir, direct)
        bridge_merged = read_safetensors(merged)
        if model.tied:  # the HF model's state dict lists the tied lm_head; safetensors stores it once
            peft_merged = {k: v for k, v in peft_merged.items() if k in bridge_merged or k != "lm_head.weight"}
        mism = compare_state(peft_merged, bridge_merged, "peft merge_and_unload", "bridge merged export")
        result.checks.append(state_check("merge", mism, "merged weights equal peft merge_and_unload()"))
        ids = fixed_input_ids(model)
        hf_lora, hf_base = hf_logits(hf_dir, ids, adapter=direct), hf_logits(hf_dir, ids)
        meg = next(o["logits"] for o in outs if o["logits"] is not None)
        m = compare_tensors("logits", hf_lora, meg, "transformers+peft", f"megatron+lora@{src.id}", PEFT_TOLERANCE)
        effect = max_abs_diff(hf_lora, hf_base)
        if m is None and effect < MIN_ADAPTER_EFFECT:
            detail, status = f"adapter changes logits by only {effect:.2e} (< {MIN_ADAPTER_EFFECT}): a no-op adapter", "failed"
        else:
            detail, status = (str(m), "failed") if m else (f"match; adapter moves logits by {effect:.3f} vs base", "passed")
        result.checks.append(Check("logits", status, detail, max_abs_diff(hf_lora, meg), str(PEFT_TOLERANCE), [m] if m else []))


CASE = PeftExport()
