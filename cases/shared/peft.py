"""What the PEFT cases share (peft-export, peft-resume, and verl-checkpoint's adapter checks): the
adapter options (a LoRA layout: kind, rank, alpha, target subset, layer filter; cases.shared.lora_layout),
the HF target modules, loading an exported adapter as users do, and the adapter-config, logits and
merged-logits checks with their tolerances."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal

import torch

from harness.core.parity import EXACT, Tolerance, compare_tensors, max_abs_diff, widened
from harness.core.result import Check
from harness.core.topology import Topology
from harness.core.zoo import HFModelSpec
from harness.models import bridge as mb
from harness.models.hf import HF_DTYPES, quiet_hf, reference_attention
from harness.models.mcore import DType
from harness.models.vl import forward_model

PEFT_TOLERANCE = Tolerance(atol=1e-5, rtol=1e-5, why="Megatron+LoRA vs transformers+PEFT fp32 kernels")
# bf16: MEGATRON_HF_TOLERANCE_BF16's reasons plus the LoRA branch, which the two sides compute in
# different precisions: Megatron in bf16, peft in fp32 (PeftModel.from_pretrained's
# autocast_adapter_dtype upcasts bf16 adapter weights to fp32; the branch's output is cast back).
# Measured (hf-llama, hf-qwen2, hf-llama-tied; lora and canonical_lora; tp1, tp2, pp2, tp2pp2):
# max |diff| 3.42e-2 (qwen2 canonical_lora tp2), the others 1.56e-2..2.51e-2; the bound is 1.75x
# that in absolute terms. The adapter moves these logits by 1.6..2.1, a lost lora_alpha by as
# much, so a no-op or half-scaled adapter stays far outside it.
PEFT_TOLERANCE_BF16 = Tolerance(atol=6e-2, rtol=3e-2, why="Megatron+LoRA (bf16) vs transformers+PEFT (bf16 base, fp32 LoRA) kernels")
# merge_and_unload folds s*B@A into W: the merged model computes (W + s*B@A) x instead of W x + s*B(A x),
# another summation order (fp32), and in bf16 rounds the merged weight to bf16 where the unmerged
# model keeps the LoRA branch in fp32. Measured max |merged - unmerged| logits (docs/explore-lora.md):
# the matrices' fp32 cases 3.70e-6 (hf-nemotron tp2), 0.95e-6..2.7e-6 the others (39 cases); what
# `ckpt-harness explore --kind lora` drew: 1.66e-5 (a 12-layer Nemotron, hidden 12, alpha/r 6.5..7) and
# 1.66e-4 (a 9-layer Qwen3-MoE, alpha/r 18): the error grows with depth and the adapter's scale, so
# atol 1e-4 at alpha/r <= 2, times alpha/r / 2 above (merge_tolerance); bf16 5.49e-2 (hf-nemotron tp1),
# 1.56e-2..2.73e-2 the others. A merge that loses the adapter moves them by the adapter's effect
# (1.3..3.4), a tied lm_head merged into the embedding by 1.41.
MERGE_TOLERANCE = Tolerance(atol=1e-4, rtol=1e-5, why="peft merge_and_unload vs unmerged LoRA fp32 summation order")
MERGE_TOLERANCE_BF16 = Tolerance(atol=6e-2, rtol=3e-2, why="merged bf16 weights vs bf16 base + fp32 LoRA branch")
# The Bridge merges s*(B@A) with B the fused qkv / [gate; up] lora_B (peft/lora_merge.py), peft per q/k/v/gate/up
# module: the same products, another GEMM blocking, so fp32 weights may differ in the last bits. Found by
# `ckpt-harness explore --kind lora` (ranks 6 and 10; rank 4, the matrices' default, happened to agree bitwise):
# max |diff| 2.98e-8 over 60 tensors; a lost or mis-sliced adapter moves a merged weight by its delta (~1e-2).
MERGE_WEIGHTS_TOLERANCE = Tolerance(atol=1e-6, rtol=1e-6, why="Bridge B@A on the fused qkv/fc1 lora_B vs peft's per module")
MIN_ADAPTER_EFFECT = 1e-3  # max |logits(lora) - logits(base)| below this means the adapter did nothing
#: kind -> Megatron targets (DoRA: LoRA's, each with a magnitude per output row; peft-export's PeftExportOptions alone offers it)
ADAPTERS = {"lora": mb.LORA_TARGETS, "canonical_lora": mb.CANONICAL_TARGETS, "dora": mb.LORA_TARGETS}


def hf_target_modules(model: HFModelSpec, opts: "PeftOptions | None" = None) -> list[str]:
    """The HF module names (adapter_config.json target_modules) the layout's targets adapt, as the
    HF checkpoint spells them (MiniMax-M2's routed experts: w1/w3/w2, cases.shared.lora_layout.checkpoint_leaves)."""
    from .lora_layout import checkpoint_leaves, hf_modules

    targets = (opts or PeftOptions()).base_targets(model)
    return sorted({leaf for t in targets for m in hf_modules(model, t) for leaf in checkpoint_leaves(model, m)})


@dataclass(frozen=True)
class PeftOptions:
    adapter: Literal["lora", "canonical_lora"] = "lora"
    dim: int = 4
    alpha: int = 8
    dtype: DType = "fp32"
    #: the adapter kind's base linears to adapt (LoRA: linear_qkv, linear_proj, linear_fc1, linear_fc2;
    #: CanonicalLoRA: linear_q, linear_k, linear_v, linear_proj, linear_fc1_up, linear_fc1_gate, linear_fc2); () all
    targets: tuple[str, ...] = ()
    #: global decoder layers to adapt, each target then the Bridge's wildcard entry `*.layers.N.*.<target>`; () every layer
    layers: tuple[int, ...] = ()
    #: grouped-expert adapter layout (harness.models.bridge.EXPERT_LAYOUTS): shared (the Bridge's default), per-expert,
    #: shared-outer (Megatron-Bridge's experts_shared_outer_loras, LoRA only)
    experts: Literal["shared", "per-expert", "shared-outer"] = "shared"
    #: "all": every module the targets name (the Bridge's default); "language": a VL model's language path only, its
    #: Megatron-built ViT (vision_model.*) left without adapters (entries `*language_model.*.<target>`)
    scope: Literal["all", "language"] = "all"

    def base_targets(self, model: HFModelSpec | None = None) -> tuple[str, ...]:
        """The asked targets; the defaults as the model has them (cases.shared.lora_layout.model_targets): CanonicalLoRA's
        on a non-gated MLP target fc1's up side only (there is no gate), multi-latent attention's the MLA linears."""
        if self.targets:
            return self.targets
        targets = ADAPTERS[self.adapter]
        if model is not None:
            from .lora_layout import model_targets

            targets = model_targets(model, targets)
        return targets

    def entries(self, model: HFModelSpec | None = None) -> list:
        """The Megatron target_modules entries (cases.shared.lora_layout.Entry) the Bridge adapter gets."""
        from .lora_layout import entries

        return entries(self.base_targets(model), self.layers, "language_model" if self.scope == "language" else "")

    def spec(self, model: HFModelSpec | None = None) -> mb.AdapterSpec:
        return mb.AdapterSpec(self.adapter, self.dim, self.alpha, tuple(e.pattern for e in self.entries(model)), experts=self.experts)

    def validate_layout(self, model: HFModelSpec, topologies: Iterable[Topology]) -> None:
        """ValueError naming the option when the layout cannot be built on `model` at `topologies`."""
        from .lora_layout import validate

        if self.experts == "shared-outer" and self.adapter != "lora":
            raise ValueError(f"option experts: shared-outer is LoRA's layout only (Megatron-Bridge experts_shared_outer_loras), not {self.adapter}'s")
        if self.adapter == "dora" and self.experts != "shared":
            raise ValueError(f"option experts: {self.experts} is not DoRA's (Megatron-Bridge's DoRA has no expert-layout fields)")
        validate(model, self.adapter, self.dim, self.targets, self.layers, topologies, ADAPTERS)


def load_peft(base_dir: Path, adapter_dir: Path, dtype: str = "fp32") -> Any:
    """The exported adapter `adapter_dir` over the HF base `base_dir`, loaded as users do
    (PeftModel.from_pretrained over AutoModelForCausalLM.from_pretrained; a VL checkpoint's
    ConditionalGeneration class, harness.models.vl.auto_class_of)."""
    from peft import PeftModel

    from harness.models.vl import auto_class_of

    # eager attention where transformers' sdpa path drops an option the config sets (Gemma2's attention
    # soft-cap: harness.models.hf.SDPA_DROPS), as hf-roundtrip's reference; its merged model inherits it
    attn = reference_attention(base_dir)
    kw: dict[str, Any] = {"attn_implementation": attn} if attn else {}
    return PeftModel.from_pretrained(auto_class_of(base_dir).from_pretrained(base_dir, dtype=HF_DTYPES[dtype], **kw), adapter_dir)


def peft_load_problems(base_dir: Path, adapter_dir: Path, dtype: str = "fp32", input_ids: torch.Tensor | None = None) -> list[str]:
    """What goes wrong when users load the HF PEFT adapter `adapter_dir` over the HF base `base_dir`
    with peft ([] when nothing; the peft-load check of peft-export, peft-resume, verl-checkpoint and
    the golden corpus; harness.judge.adapter_load judges it). Load as users do
    (PeftModel.from_pretrained, which only warns about missing keys and says nothing of unexpected
    ones: a warning filters away), then load the same files again through load_adapter, whose load
    result lists both whatever PEFT's warning level; read every loaded lora_B and the file's, and
    the adapted logits of `input_ids` (default: a fixed batch of the vocabulary) against the base
    model's with the adapter disabled (redai-studio/Relax #262: a prefix-less adapter loads with
    one warning and every lora_B zero); and every lora_A/lora_B tensor of the file that is not 2D
    (harness.judge.lora_tensors: Megatron-Bridge #6076's 3D shared-outer key, which stock PEFT cannot load)."""
    import warnings

    from harness.backends._safetensors import read_safetensors
    from harness.judge.adapter_load import AdapterLoad, adapter_load_problems
    from harness.judge.lora_tensors import lora_tensor_problems

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_peft(base_dir, adapter_dir, dtype)
    r = AdapterLoad(warnings=[str(w.message) for w in caught if "adapter keys" in str(w.message)])
    loaded = [m.lora_B["default"].weight for m in model.modules() if hasattr(m, "lora_B") and "default" in getattr(m, "lora_B", {})]
    r.loaded_lora_b = len(loaded)
    r.loaded_lora_b_max = max((float(b.detach().abs().max()) for b in loaded), default=0.0)
    state = read_safetensors(adapter_dir)
    saved = [v for k, v in state.items() if "lora_B" in k]
    r.saved_lora_b, r.saved_lora_b_max = len(saved), max((float(v.abs().max()) for v in saved), default=0.0)
    with torch.no_grad():
        model.eval()
        if input_ids is None:
            vocab = int(model.get_base_model().config.get_text_config().vocab_size)
            input_ids = (torch.arange(16) * 7 % vocab).reshape(2, 8)
        adapted = forward_model(model)(input_ids=input_ids).logits.float()
        with model.disable_adapter():
            base = forward_model(model)(input_ids=input_ids).logits.float()
    r.effect = max_abs_diff(adapted, base)
    result = model.load_adapter(adapter_dir, adapter_name="recheck")
    r.missing, r.unexpected = list(result.missing_keys), list(result.unexpected_keys)
    return adapter_load_problems(r) + lora_tensor_problems(state)


#: the task_type a causal LM's adapter_config.json names: AutoPeftModelForCausalLM and PeftModel.from_pretrained
#: pick peft's task class (PeftModelForCausalLM: generate, labels) by it
CAUSAL_LM = "CAUSAL_LM"


#: what peft's LoraConfig reads when adapter_config.json leaves a key out: a LoRA export may omit use_dora
CONFIG_DEFAULTS: dict[str, Any] = {"use_dora": False}


def config_check(cfg: dict[str, Any], asked: dict[str, Any]) -> Check:
    """adapter_config.json's `asked` keys (a missing one as peft reads it: CONFIG_DEFAULTS) equal what was asked."""
    got = {k: sorted(cfg.get(k) or []) if k == "target_modules" else cfg.get(k, CONFIG_DEFAULTS.get(k)) for k in asked}
    bad = [f"{k}: asked {asked[k]!r}, exported {got[k]!r}" for k in asked if asked[k] != got[k]]
    return Check("adapter-config", "failed" if bad else "passed",
                 "; ".join(bad) or f"r={got.get('r')} lora_alpha={got.get('lora_alpha')}", tolerance=EXACT)


#: the LoRA scale alpha/r at which PEFT_TOLERANCE was measured (the matrices' default: alpha 8, r 4)
MEASURED_SCALE = 2.0


def logits_tolerance(dtype: str, scale: float = MEASURED_SCALE) -> Tolerance:
    """PEFT_TOLERANCE(_BF16); in fp32 its atol grows with the LoRA scale alpha/r past the measured
    2 (the branch's rounding error is s * B(Ax)'s): `ckpt-harness explore --kind lora` drew 1.99e-5 at
    alpha/r 18 on a 6-layer Qwen3-MoE, and 1e-5 holds at 2. bf16's bound already covers the drawn scales."""
    return PEFT_TOLERANCE_BF16 if dtype == "bf16" else _scaled(PEFT_TOLERANCE, scale)


def _scaled(tol: Tolerance, scale: float) -> Tolerance:
    """An fp32 bound measured at alpha/r MEASURED_SCALE, its atol grown with alpha/r past it."""
    if scale <= MEASURED_SCALE:
        return tol
    return Tolerance(tol.atol * scale / MEASURED_SCALE, tol.rtol, f"{tol.why}, x alpha/r {scale:g} / 2")


@torch.no_grad()
def peft_reference_error(base_dir: Path, adapter_dir: Path, input_ids: torch.Tensor, fp32_logits: torch.Tensor) -> float:
    """max |transformers+PEFT fp32 logits - the same adapter's fp64 forward| (the eager experts: torch._grouped_mm
    takes no fp64). What a fixture whose fp32 forward drifts (gated DeltaNet's token recurrence) allows past the fixed bound."""
    from peft import PeftModel

    from harness.models.vl import auto_class_of

    quiet_hf()
    attn = reference_attention(base_dir)
    kw: dict[str, Any] = {"attn_implementation": attn} if attn else {}
    base = auto_class_of(base_dir).from_pretrained(base_dir, dtype=torch.float64, experts_implementation="eager", **kw)
    exact = forward_model(PeftModel.from_pretrained(base, adapter_dir).eval())(input_ids=input_ids).logits
    return float((fp32_logits.double() - exact).abs().max())


def logits_check(hf_lora: torch.Tensor, hf_base: torch.Tensor, megatron: torch.Tensor, src: str, dtype: str = "fp32",
                 scale: float = MEASURED_SCALE, reference_error: float | None = None) -> Check:
    """transformers+PEFT vs Megatron+LoRA within logits_tolerance, widened by `reference_error` (fp32 only: None in bf16)."""
    tol = widened(logits_tolerance(dtype, scale), reference_error if dtype == "fp32" else None, "transformers+peft's")
    m = compare_tensors("logits", hf_lora, megatron, "transformers+peft", f"megatron+lora@{src}", tol)
    effect = max_abs_diff(hf_lora, hf_base)
    if m is None and effect < MIN_ADAPTER_EFFECT:
        detail, status = f"adapter changes logits by only {effect:.2e} (< {MIN_ADAPTER_EFFECT}): a no-op adapter", "failed"
    else:
        detail, status = (str(m), "failed") if m else (f"match; adapter moves logits by {effect:.3f} vs base", "passed")
    return Check("logits", status, detail, max_abs_diff(hf_lora, megatron), tol, [m] if m else [])


def peft_wrapped(base_dir: Path, adapter_dir: Path) -> set[str]:
    """The HF modules PeftModel.from_pretrained wraps with the adapter (cases.shared.lora_layout.peft_units)."""
    from .lora_layout import peft_units

    quiet_hf()
    return peft_units(load_peft(base_dir, adapter_dir))


@dataclass
class PeftViews:
    """One PeftModel.from_pretrained load of an exported adapter over its HF base, as users do."""

    units: set[str]  # the HF modules it wraps (cases.shared.lora_layout.peft_units)
    lora_logits: torch.Tensor  # the unmerged adapter's
    merged_logits: torch.Tensor  # after merge_and_unload()
    merged: dict[str, torch.Tensor]  # merge_and_unload()'s weights


@torch.no_grad()
def peft_views(base_dir: Path, adapter_dir: Path, input_ids: torch.Tensor, dtype: str = "fp32", save_merged_to: Path | None = None,
               resave_to: Path | None = None) -> PeftViews:
    """Load the adapter once: the modules it wraps, its logits unmerged, then merge_and_unload()'s
    logits and weights (`save_merged_to`: what save_pretrained writes of them; an MoE model needs it:
    transformers 5 holds Qwen3-MoE's experts fused in memory and writes them per expert, the layout
    the Bridge's merged export has). `resave_to`: the loaded PeftModel's own save_pretrained there
    (default arguments, as users save an adapter again), after the unmerged logits, before the merge
    (cases.shared.peft_resave judges it)."""
    from .lora_layout import peft_units
    from harness.backends._safetensors import read_safetensors

    quiet_hf()
    model = load_peft(base_dir, adapter_dir, dtype)
    model.eval()
    units = peft_units(model)
    lora = forward_model(model)(input_ids=input_ids).logits.float()
    if resave_to is not None:
        model.save_pretrained(resave_to)
    merged_model = model.merge_and_unload()
    merged_logits = forward_model(merged_model)(input_ids=input_ids).logits.float()
    if save_merged_to is not None:
        merged_model.save_pretrained(save_merged_to, safe_serialization=True)
        merged = read_safetensors(save_merged_to)
    else:
        merged = {k: v.detach().clone() for k, v in merged_model.state_dict().items()}
    return PeftViews(units, lora, merged_logits, merged)


def merge_weights_tolerance(dtype: str) -> Tolerance | None:
    """The `merge` check's: MERGE_WEIGHTS_TOLERANCE in fp32; bf16 weights compare bitwise (None)."""
    return None if dtype == "bf16" else MERGE_WEIGHTS_TOLERANCE


def merge_tolerance(dtype: str, scale: float = MEASURED_SCALE) -> Tolerance:
    """MERGE_TOLERANCE(_BF16); in fp32 its atol grows with alpha/r past 2, as logits_tolerance's
    (explore drew 1.66e-4 at alpha/r 18 on a 9-layer Qwen3-MoE: within 9e-4)."""
    return MERGE_TOLERANCE_BF16 if dtype == "bf16" else _scaled(MERGE_TOLERANCE, scale)


def merged_logits_check(merged: torch.Tensor, unmerged: torch.Tensor, megatron: torch.Tensor | None, src: str, dtype: str = "fp32",
                        scale: float = MEASURED_SCALE) -> Check:
    """merged-logits: transformers+PEFT after merge_and_unload() against the unmerged adapter and
    against Megatron+LoRA at `src`, both within merge_tolerance (the merged model's own reordering
    comes on top of the unmerged one's kernel differences: 1.44e-5 from Megatron's logits found by explore)."""
    tol = merge_tolerance(dtype, scale)
    bad = [m for m in (compare_tensors("logits", unmerged, merged, "peft unmerged", "peft merge_and_unload", tol),
                       compare_tensors("logits", megatron, merged, f"megatron+lora@{src}", "peft merge_and_unload", tol)
                       if megatron is not None else None) if m is not None]
    diff = max_abs_diff(merged, unmerged)
    if megatron is None:
        return Check("merged-logits", "failed", "no rank returned Megatron logits", diff, tol)
    if bad:
        return Check("merged-logits", "failed", "; ".join(map(str, bad)), diff, tol, bad)
    return Check("merged-logits", "passed", f"merged within {diff:.2e} of unmerged and {max_abs_diff(merged, megatron):.2e} of "
                 f"megatron+lora@{src}", diff, tol)
