"""What the PEFT cases share (peft-export, and verl-checkpoint's adapter checks): the adapter options,
the HF target modules, loading an exported adapter as users do, and the adapter-config and logits
checks with their tolerances."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from harness.core.parity import EXACT, Tolerance, compare_tensors, max_abs_diff
from harness.core.result import Check
from harness.core.zoo import HFModelSpec
from harness.models import bridge as mb
from harness.models.hf import HF_DTYPES
from harness.models.mcore import DType

PEFT_TOLERANCE = Tolerance(atol=1e-5, rtol=1e-5, why="Megatron+LoRA vs transformers+PEFT fp32 kernels")
# bf16: MEGATRON_HF_TOLERANCE_BF16's reasons plus the LoRA branch, which the two sides compute in
# different precisions: Megatron in bf16, peft in fp32 (PeftModel.from_pretrained's
# autocast_adapter_dtype upcasts bf16 adapter weights to fp32; the branch's output is cast back).
# Measured (hf-llama, hf-qwen2, hf-llama-tied; lora and canonical_lora; tp1, tp2, pp2, tp2pp2):
# max |diff| 3.42e-2 (qwen2 canonical_lora tp2), the others 1.56e-2..2.51e-2; the bound is 1.75x
# that in absolute terms. The adapter moves these logits by 1.6..2.1, a lost lora_alpha by as
# much, so a no-op or half-scaled adapter stays far outside it.
PEFT_TOLERANCE_BF16 = Tolerance(atol=6e-2, rtol=3e-2, why="Megatron+LoRA (bf16) vs transformers+PEFT (bf16 base, fp32 LoRA) kernels")
MIN_ADAPTER_EFFECT = 1e-3  # max |logits(lora) - logits(base)| below this means the adapter did nothing
ADAPTERS = {"lora": mb.LORA_TARGETS, "canonical_lora": mb.CANONICAL_TARGETS}  # kind -> Megatron targets
# Both kinds export the same HF PEFT target modules; a non-gated MLP has no gate_proj.
HF_TARGET_MODULES = sorted({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


def hf_target_modules(model: HFModelSpec) -> list[str]:
    return HF_TARGET_MODULES if model.gated else [m for m in HF_TARGET_MODULES if m != "gate_proj"]


@dataclass(frozen=True)
class PeftOptions:
    adapter: Literal["lora", "canonical_lora"] = "lora"
    dim: int = 4
    alpha: int = 8
    dtype: DType = "fp32"

    def spec(self, model: HFModelSpec | None = None) -> mb.AdapterSpec:
        """The Bridge adapter; CanonicalLoRA on a non-gated MLP targets fc1's up side only (there is no gate)."""
        targets = ADAPTERS[self.adapter]
        if model is not None and not model.gated:
            targets = tuple(t for t in targets if t != "linear_fc1_gate")
        return mb.AdapterSpec(self.adapter, self.dim, self.alpha, targets)


def peft_load_problems(base_dir: Path, adapter_dir: Path, dtype: str = "fp32") -> list[str]:
    """What goes wrong when users load the HF PEFT adapter `adapter_dir` over the HF base `base_dir`
    with peft ([] when nothing; the peft-load check of peft-export, verl-checkpoint and the golden
    corpus). Load as users do (PeftModel.from_pretrained, which only warns about missing keys and says
    nothing of unexpected ones), then load the same files again through load_adapter, whose
    result lists both."""
    import warnings

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=HF_DTYPES[dtype])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, adapter_dir)
    problems = [f"from_pretrained warned: {w.message}" for w in caught if "adapter keys" in str(w.message)]
    result = model.load_adapter(adapter_dir, adapter_name="recheck")
    problems += [f"missing: {k}" for k in result.missing_keys]
    problems += [f"unexpected: {k}" for k in result.unexpected_keys]
    return problems


def config_check(cfg: dict[str, Any], asked: dict[str, Any]) -> Check:
    got = {k: sorted(cfg.get(k) or []) if k == "target_modules" else cfg.get(k) for k in asked}
    bad = [f"{k}: asked {asked[k]!r}, exported {got[k]!r}" for k in asked if asked[k] != got[k]]
    return Check("adapter-config", "failed" if bad else "passed",
                 "; ".join(bad) or f"r={got.get('r')} lora_alpha={got.get('lora_alpha')}", tolerance=EXACT)


def logits_tolerance(dtype: str) -> Tolerance:
    return PEFT_TOLERANCE_BF16 if dtype == "bf16" else PEFT_TOLERANCE


def logits_check(hf_lora: torch.Tensor, hf_base: torch.Tensor, megatron: torch.Tensor, src: str, dtype: str = "fp32") -> Check:
    tol = logits_tolerance(dtype)
    m = compare_tensors("logits", hf_lora, megatron, "transformers+peft", f"megatron+lora@{src}", tol)
    effect = max_abs_diff(hf_lora, hf_base)
    if m is None and effect < MIN_ADAPTER_EFFECT:
        detail, status = f"adapter changes logits by only {effect:.2e} (< {MIN_ADAPTER_EFFECT}): a no-op adapter", "failed"
    else:
        detail, status = (str(m), "failed") if m else (f"match; adapter moves logits by {effect:.3f} vs base", "passed")
    return Check("logits", status, detail, max_abs_diff(hf_lora, megatron), tol, [m] if m else [])
